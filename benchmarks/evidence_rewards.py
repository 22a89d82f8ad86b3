"""Rubric judge vs char-span F1 on a miniature evidence-selection task with several right spans: which reward does the
policy game?

The task (`trl_ext.quickstart.evidence_task`): a context of entries ``a=37 b=52 c=37 d=90`` and the question "Quote an
entry with value 37:"; ``a=37`` and ``c=37`` are both right, and one of them answers. Two rewards on the same task:
`CharSpanF1Reward` as it ships (the quote at its first exact occurrence against the *union* of the right entries'
spans) and `RubricJudgeReward` against a **scripted** judge on 127.0.0.1 (`ScriptedRubricJudge`: an oracle applying the
rubric as a careful judge would, precision = how much of the quote is supporting evidence, recall = does it hold a
right entry, one being full recall). The study measures how the two reward *definitions* can be gamed, not how a real
LLM judge fails.

Per seed one tiny Qwen2 policy after a brief cold-start SFT on teacher answers (mostly one right entry, some over-long,
partial, wrong or invented), then from that policy one `ExtGRPOTrainer` run (IPO, LoRA) per arm: ``f1`` trained on the
F1, ``rubric`` on the rubric reward, the other reward, the exact-entry and over-long rates and the quote length logged
on the training samples with weight 0. Held-out prompts (greedy) are scored with both rewards and counted by behaviour
(exact right entry, over-long, partial, wrong, invented). Also: each reward of fixed answer types over the held-out
rows (the definitions, no policy), and each reward's spread over held-out answers of the same behaviour (the noise).
The section "Evidence rewards: rubric judge vs char-span F1" of benchmarks/RESULTS.md is written from it, the plot
goes to benchmarks/images/evidence_rewards.png.

    python benchmarks/evidence_rewards.py --seeds 0 1 2 --steps 100    # about 10 min, 1 torch thread, shared machine
    python benchmarks/evidence_rewards.py --seeds 0 --steps 30 --no-write
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _results import machine, quiet_run, write_section  # noqa: E402

SECTION = "evidence_rewards"
ARM_LABELS = {"f1": "F1-trained", "rubric": "rubric-trained"}
PANELS = {
    "reward": "training reward (the arm's own)",
    "f1": "char-span F1, training samples",
    "rubric": "rubric reward, training samples",
    "exact": "exact right entry rate, training samples",
    "quote_chars": "quote length (chars), training samples",
    "overlong": "over-long quote rate, training samples",
}


def _arrow(before: float, after: float) -> str:
    return f"{before:.2f} → {after:.2f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| seed | arm | exact right entry | partial | over-long | wrong | invented text | holds a right entry "
        "| quote chars | F1 | rubric reward | an answer after RL | RL + eval wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b, a = r["before"], r["after"]
        sample = r["samples_after"][0]["answer"].replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| {r['seed']} | {r['arm']} | {_arrow(b['exact'], a['exact'])} | {_arrow(b['partial'], a['partial'])} "
            f"| {_arrow(b['overlong'], a['overlong'])} | {_arrow(b['wrong'], a['wrong'])} "
            f"| {_arrow(b['invented_text'], a['invented_text'])} | {_arrow(b['holds_right'], a['holds_right'])} "
            f"| {b['quote_chars']:.1f} → {a['quote_chars']:.1f} | {_arrow(b['f1'], a['f1'])} "
            f"| {_arrow(b['rubric'], a['rubric'])} | `{sample}` | {r['rl_wall_s']:.0f} |"
        )
    return "\n".join(lines)


def _stats(values: list[float]) -> str:
    if not values:
        return "–"
    spread = statistics.pstdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.2f} [{min(values):.2f}, {max(values):.2f}] sd {spread:.2f}"


def definition_section(held_out_rows: list[dict]) -> str:
    from trl_ext.quickstart.evidence_task import definition_table

    lines = [
        "| answer type | F1 mean [min, max] sd | rubric reward mean [min, max] sd | rows |",
        "|---|---|---|---|",
    ]
    for kind, scores in definition_table(held_out_rows).items():
        lines.append(f"| {kind} | {_stats(scores['f1'])} | {_stats(scores['rubric'])} | {len(scores['f1'])} |")
    return "\n".join(lines)


def noise_section(rows: list[dict]) -> str:
    """Each reward's spread over the held-out answers of one behaviour, pooled over seeds, the SFT policies and both
    arms."""
    from trl_ext.quickstart.evidence_task import BEHAVIOURS

    records = []
    for seed in sorted({r["seed"] for r in rows}):
        seed_rows = [r for r in rows if r["seed"] == seed]
        records += seed_rows[0]["records_before"]
        for r in seed_rows:
            records += r["records_after"]
    lines = [
        "| behaviour (held-out answers) | answers | F1 mean [min, max] sd | rubric reward mean [min, max] sd |",
        "|---|---|---|---|",
    ]
    for behaviour in BEHAVIOURS:
        chosen = [x for x in records if x["behaviour"] == behaviour]
        if chosen:
            lines.append(
                f"| {behaviour} | {len(chosen)} | {_stats([x['f1'] for x in chosen])} "
                f"| {_stats([x['rubric'] for x in chosen])} |"
            )
    return "\n".join(lines)


def _range(values: list[float], digits: int = 2) -> str:
    low, high = min(values), max(values)
    return f"{low:.{digits}f}" if round(low, digits) == round(high, digits) else f"{low:.{digits}f}–{high:.{digits}f}"


def verdicts(rows: list[dict]) -> str:
    """Per arm: ranges over seeds of the held-out figures, and on how many seeds the arm was *gamed*: its own reward
    rose on the held-out set while the exact-right-entry rate fell by 0.10 or more."""
    lines = []
    seeds = sorted({r["seed"] for r in rows})
    for arm in ("f1", "rubric"):
        runs = [r for r in rows if r["arm"] == arm]
        if not runs:
            continue
        own = "f1" if arm == "f1" else "rubric"
        gamed = [
            r for r in runs if r["after"][own] > r["before"][own] and r["after"]["exact"] <= r["before"]["exact"] - 0.1
        ]
        lines.append(
            f"- {ARM_LABELS[arm]}: held-out exact right entry {_range([r['before']['exact'] for r in runs])} after SFT → "
            f"{_range([r['after']['exact'] for r in runs])} after RL; partial quotes "
            f"{_range([r['after']['partial'] for r in runs])}, over-long {_range([r['after']['overlong'] for r in runs])}, "
            f"with invented text {_range([r['after']['invented_text'] for r in runs])}, holding a right entry "
            f"{_range([r['after']['holds_right'] for r in runs])}, "
            f"mean quote {_range([r['after']['quote_chars'] for r in runs], 1)} chars; its own reward "
            f"{_range([r['before'][own] for r in runs])} → {_range([r['after'][own] for r in runs])}, the other "
            f"({'rubric' if arm == 'f1' else 'F1'}) {_range([r['before']['rubric' if arm == 'f1' else 'f1'] for r in runs])} → "
            f"{_range([r['after']['rubric' if arm == 'f1' else 'f1'] for r in runs])}. Gamed (own held-out reward up, "
            f"exact right entry down by ≥ 0.10) on {len(gamed)} of {len(runs)} seeds."
        )
    judge_faults = sum(r["after"]["judge_not_ok"] + r["before"]["judge_not_ok"] for r in rows)
    lines.append(
        f"- Judge replies not read as a verdict (fallback reward) in the held-out scoring: {judge_faults}; "
        f"seeds {', '.join(map(str, seeds))}."
    )
    return "\n".join(lines)


def plot(rows: list[dict]) -> Path | None:
    from _plots import plot_curves

    curves = {
        title: {
            ARM_LABELS[arm]: [
                ([x for x, _ in r["curves"][key]], [y for _, y in r["curves"][key]]) for r in rows if r["arm"] == arm
            ]
            for arm in ARM_LABELS
        }
        for key, title in PANELS.items()
    }
    try:
        return plot_curves(curves, SECTION, "Evidence selection: F1-trained vs rubric-trained policy")
    except ImportError as error:  # matplotlib is an optional extra
        print(f"(no plot: {error})")
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100, help="RL optimizer steps per arm (default 100)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temporary dir)")
    parser.add_argument(
        "--no-write", action="store_true", help="print the section, do not write RESULTS.md (the plot is still drawn)"
    )
    args = parser.parse_args()

    quiet_run(args.threads)
    from trl_ext.quickstart.evidence_study import EvidenceSettings, evidence_study
    from trl_ext.quickstart.evidence_task import evidence_rows

    settings = replace(EvidenceSettings(), rl_steps=args.steps)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.workdir or Path(tmp)
        rows = evidence_study(args.seeds, ("f1", "rubric"), root, settings, log=print)
        if args.workdir is not None:
            (root / "rows.json").write_text(json.dumps(rows, indent=1))
    total = time.perf_counter() - started
    s = settings
    held_out = evidence_rows(
        args.seeds[0], s.num_sft_examples + s.num_rl_examples + s.num_eval_examples, s.num_entries, s.right_weights
    )[-s.num_eval_examples :]
    command = f"python benchmarks/evidence_rewards.py --seeds {' '.join(map(str, args.seeds))} --steps {args.steps}"
    body = "\n\n".join(
        [
            "## Evidence rewards: rubric judge vs char-span F1",
            f"Written by `{command}` ({machine(threads=False)}, {args.threads} torch thread; {total:.0f} s in all, on a "
            "machine shared with other jobs). Task (`trl_ext.quickstart.evidence_task`): a context of "
            f'{s.num_entries} entries `a=37 b=52 c=37 d=90` and "Quote an entry with value 37:", with 1, 2 or 3 right '
            f"entries (weights {', '.join(f'{w:g}' for w in s.right_weights)}); any one right entry answers. "
            "`CharSpanF1Reward` as it ships (quote at its first exact occurrence, gold = the union of every right "
            "entry's span) against `RubricJudgeReward` asking a **scripted** judge on 127.0.0.1 (`ScriptedRubricJudge`, "
            "an oracle applying the rubric as a careful judge would: precision 1 + 9 · supporting share of the quote's "
            "pieces, a fragment of a right entry counting half; recall 10 for a complete right entry, 5 for a fragment "
            "of one, else 1; reward (p/10 + r/10)/2). So this measures how the reward *definitions* can be gamed, not "
            "how a real LLM judge fails. Per seed: a tiny Qwen2 policy (hidden "
            f"{s.hidden_size}, {s.num_hidden_layers} layers), cold-start SFT on {s.num_sft_examples} teacher answers "
            f"(60% one right entry, 15% over-long, 10% partial, 10% wrong, 5% invented; {s.sft_epochs:g} epochs), then "
            f"per arm from that policy `ExtGRPOTrainer` (IPO, LoRA r {s.lora_r}, {s.rl_steps} steps, "
            f"{s.prompts_per_step} prompts x {s.num_generations} rollouts at temperature {s.temperature:g}, each batch "
            f"used {s.num_iterations} times, lr {s.rl_learning_rate:g} constant), the other reward logged with weight "
            f"0. Held-out: {s.num_eval_examples} prompts never trained on, greedy; `SFT → RL` per cell.",
            table(rows),
            "Each reward of fixed answer types on the held-out rows of seed "
            f"{args.seeds[0]} (the definitions alone, no policy):",
            definition_section(held_out),
            "The noise: each reward over held-out answers of the same behaviour (pooled over seeds, SFT and RL "
            "policies, both arms):",
            noise_section(rows),
            verdicts(rows),
            "![Evidence rewards: training curves per arm](images/evidence_rewards.png)",
        ]
    )
    print(body)
    plot(rows)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
