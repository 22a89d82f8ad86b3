"""Build the judge-credit recipes' prompt file from DeepScaleR and DAPO-Math (docs/judge_credit.md:
"filtered DeepScaleR + DAPO-Math prompts").

    python recipes/data/prepare_math_prompts.py --out data/math_prompts.jsonl

Writes JSON lines ``{"prompt": [{"role": "user", "content": ...}], "solution": "<answer>", "source": ...}``: the
columns TRL's ``accuracy_reward`` and ``JudgeCreditTrainer`` (``judge_answer_column: solution``) read.

The reference run's exact filter is not published. This one is ours: drop problems without a reference answer,
answers longer than ``--max-answer-chars`` (proofs, long expressions the verifier handles badly), and duplicate
problems (DAPO-Math repeats DeepScaleR problems); then shuffle with ``--seed``. Needs network access to the Hub.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

DEEPSCALER = "agentica-org/DeepScaleR-Preview-Dataset"
DAPO_MATH = "BytedTsinghua-SIA/DAPO-Math-17k"
INSTRUCTION = "Solve the problem step by step. Put the final answer in \\boxed{}."
_DAPO_PREFIX = re.compile(r"^Solve the following math problem step by step\..*?\n\n", re.DOTALL)
_DAPO_SUFFIX = re.compile(r"\n\nRemember to put your answer on its own line after \"Answer:\"\.?\s*$")


def _normalise(problem: str) -> str:
    return re.sub(r"\s+", " ", problem).strip().lower()


def deepscaler_rows(dataset) -> list[dict]:
    return [
        {"problem": row["problem"], "answer": str(row.get("answer") or "").strip(), "source": DEEPSCALER}
        for row in dataset
    ]


def dapo_rows(dataset) -> list[dict]:
    rows = []
    for row in dataset:
        prompt = row.get("prompt")
        text = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt or "")
        text = _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", text))
        answer = (row.get("reward_model") or {}).get("ground_truth") or row.get("solution") or ""
        rows.append({"problem": text, "answer": str(answer).strip(), "source": DAPO_MATH})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/math_prompts.jsonl")
    parser.add_argument("--max-answer-chars", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from datasets import load_dataset

    rows = deepscaler_rows(load_dataset(DEEPSCALER, split="train"))
    rows += dapo_rows(load_dataset(DAPO_MATH, split="train"))
    seen: set[str] = set()
    kept = []
    for row in rows:
        key = _normalise(row["problem"])
        if not row["answer"] or len(row["answer"]) > args.max_answer_chars or key in seen:
            continue
        seen.add(key)
        kept.append(row)
    random.Random(args.seed).shuffle(kept)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle:
        for row in kept:
            record = {
                "prompt": [{"role": "user", "content": f"{row['problem']}\n\n{INSTRUCTION}"}],
                # accuracy_reward parses the reference with math_verify: give it in \boxed{} form
                "solution": f"\\boxed{{{row['answer']}}}",
                "source": row["source"],
            }
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"{len(kept)} prompts (of {len(rows)}) -> {out}")


if __name__ == "__main__":
    main()
