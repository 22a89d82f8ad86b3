"""Shared-prefix packing on GRPO groups: training step time and peak memory, packed vs TRL's rows.

`ExtGRPOTrainer` on 1,024-token prompts, 128-token completions, G = 8 (one prompt per step, one micro-batch of its 8
completions), learning rate 0 so both settings see identical rollouts and must log identical losses:

- **rows**: ``prefix_sharing="off"``: TRL's rows, the prompt encoded once per completion (8 x 1,152 tokens);
- **packed**: ``prefix_sharing="auto"``: the prompt once, the 8 completions as branches (1,024 + 8 x 129 tokens).

Training time = optimizer step minus generation and scoring (identical for both): the loss forward, backward and
the optimizer. Each run is its own process (peak RSS is per process); runs alternate. Prints the table and writes
it into benchmarks/RESULTS.md.

    python benchmarks/packing.py [--rounds 2] [--steps 4] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

PROMPT_TOKENS, COMPLETION_TOKENS, GROUP = 1024, 128, 8


def prompt_text(tokenizer, index: int) -> str:
    """A chat prompt of plain words whose rendered ids are at most PROMPT_TOKENS long, as long as possible."""
    words = "the quick brown fox jumps over the lazy dog hello world yes no true false answer question".split()

    def text(count: int) -> str:
        return " ".join(words[(index + i) % len(words)] for i in range(count))

    def length(count: int) -> int:
        messages = [{"role": "user", "content": text(count)}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])

    low, high = 1, PROMPT_TOKENS  # a word is at least one token: `high` words are too many
    while low < high:  # the largest word count that fits
        middle = (low + high + 1) // 2
        low, high = (middle, high) if length(middle) <= PROMPT_TOKENS else (low, middle - 1)
    return text(low)


def worker(kind: str, steps: int, threads: int) -> dict:
    import torch
    from _timing import GenerationTimer, StepTimer
    from datasets import Dataset

    from trl_ext import ExtGRPOConfig, ExtGRPOTrainer
    from trl_ext.testing import build_tiny_model_and_tokenizer

    class Timed(GenerationTimer, ExtGRPOTrainer):
        pass

    torch.set_num_threads(threads)
    model, tokenizer = build_tiny_model_and_tokenizer(
        0, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, max_position_embeddings=4096
    )
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": prompt_text(tokenizer, i)}] for i in range(8)]}
    )
    with tempfile.TemporaryDirectory() as tmp:
        config = ExtGRPOConfig(
            output_dir=tmp,
            use_cpu=True,
            bf16=False,
            report_to="none",
            per_device_train_batch_size=GROUP,
            num_generations=GROUP,
            max_completion_length=COMPLETION_TOKENS,
            generation_kwargs={"min_new_tokens": COMPLETION_TOKENS},  # every completion full length
            max_steps=steps,
            logging_steps=1,
            save_strategy="no",
            learning_rate=0.0,
            seed=0,
            disable_tqdm=True,
            prefix_sharing="off" if kind == "rows" else "auto",
        )
        timer = StepTimer()
        trainer = Timed(
            model,
            lambda completions, **kw: [len(set(c[0]["content"])) / 10 for c in completions],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer],
        )
        timer.trainer = trainer
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        entropies = [h["entropy"] for h in trainer.state.log_history if "entropy" in h]
        ratios = [h["packing/token_ratio"] for h in trainer.state.log_history if "packing/token_ratio" in h]
    return {
        "training_times": timer.training_times[1:],
        "losses": losses,
        "entropies": entropies,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "token_ratio": ratios[-1] if ratios else 1.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--threads", default="1,2", help="torch threads per run: one or more counts, comma-separated")
    parser.add_argument("--worker", choices=["rows", "packed"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, int(args.threads))))
        return

    from _results import machine, write_section

    kinds = ["rows", "packed"]
    lines, speedups, rss_ratios, all_same = [], {}, {}, True
    for threads in [int(t) for t in args.threads.split(",")]:
        runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
        for round_index in range(args.rounds):
            for kind in kinds if round_index % 2 == 0 else kinds[::-1]:
                command = [sys.executable, __file__, "--worker", kind, "--steps", str(args.steps)]
                command += ["--threads", str(threads)]
                output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
                runs[kind].append(json.loads(output.strip().splitlines()[-1]))
        times = {kind: [t for run in runs[kind] for t in run["training_times"]] for kind in kinds}
        medians = {kind: statistics.median(times[kind]) for kind in kinds}
        rss = {kind: max(run["peak_rss_mb"] for run in runs[kind]) for kind in kinds}
        all_same &= all(
            a["losses"] == pytest_approx(b["losses"]) and a["entropies"] == pytest_approx(b["entropies"])
            for a, b in zip(runs["rows"], runs["packed"])
        )
        tokens = {"rows": GROUP * (PROMPT_TOKENS + COMPLETION_TOKENS)}
        tokens["packed"] = round(runs["packed"][0]["token_ratio"] * tokens["rows"])
        lines += [
            f"| {threads} | {kind} | {len(times[kind])} | {1000 * medians[kind]:.0f} | {tokens[kind]:,} | "
            f"{rss[kind]:.0f} |"
            for kind in kinds
        ]
        speedups[threads] = medians["rows"] / medians["packed"]
        rss_ratios[threads] = rss["packed"] / rss["rows"]
    table = "\n".join(
        [
            "| torch threads | rows | steps timed | median training time / step (ms) | tokens per forward | "
            "peak RSS (MB) |",
            "|---|---|---|---|---|---|",
            *lines,
        ]
    )
    verdict = "meets" if min(speedups.values()) >= 2 else "misses"
    per_threads = ", ".join(f"{speedup:.2f}x with {threads} thread(s)" for threads, speedup in speedups.items())
    body = (
        "## Shared-prefix packing: GRPO groups\n\n"
        f"`python benchmarks/packing.py --rounds {args.rounds} --steps {args.steps} --threads {args.threads}` "
        f"({machine(threads=False)}). Small Qwen2 (hidden 256, 4 layers, 4 heads of 64); {PROMPT_TOKENS}-token "
        f"prompt, G = {GROUP} completions of {COMPLETION_TOKENS} tokens, one micro-batch per step; learning rate 0. "
        "Training time = optimizer step minus generation and scoring; first step of each run not counted. Each run "
        "is its own process; peak RSS of that process (generation included, identical for both).\n\n"
        f"{table}\n\n**Speed-up packed vs rows: {per_threads}** (target >= 2x: {verdict}); peak RSS packed / rows: "
        f"{', '.join(f'{r:.2f}' for r in rss_ratios.values())}; logged losses and entropies equal (1e-4 relative) "
        f"in every run: {all_same} (the losses are on-policy, ~0)."
    )
    print(table)
    print(f"speed-up {per_threads}; same losses and entropies: {all_same}")
    write_section("packing", body)


def pytest_approx(values):
    import pytest

    return pytest.approx(values, rel=1e-4, abs=1e-6)


if __name__ == "__main__":
    main()
