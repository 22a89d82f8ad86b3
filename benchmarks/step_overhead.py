"""Step-time overhead of `ExtGRPOTrainer(loss_type="ipo")` against `trl.GRPOTrainer(loss_type="dapo")`.

Same tiny model, data and seed; the two trainers' runs alternate in one process (A B B A A B ...) so that machine
noise hits both alike. A step is timed from `on_step_begin` to `on_step_end` (generation, the loss, backward and
the optimizer); the first step of every run is a warm-up and is not counted. Prints the median step time of each
and their ratio (target ≤ 1.05), and writes the table into benchmarks/RESULTS.md.

    python benchmarks/step_overhead.py [--rounds 6] [--steps 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from _results import machine, write_section  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from trl_ext import ExtGRPOConfig, ExtGRPOTrainer  # noqa: E402
from trl_ext.testing import build_tiny_model_and_tokenizer  # noqa: E402


class StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


def reward(completions, **kwargs):
    return [len(set(text)) / 10 for text in completions]


def run(kind: str, steps: int, output_dir: str) -> list[float]:
    model, tokenizer = build_tiny_model_and_tokenizer(0, hidden_size=64, intermediate_size=128, initializer_range=0.5)
    dataset = Dataset.from_dict({"prompt": [f"What is {i} + {i + 1}?" for i in range(64)]})
    common = dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=32,
        num_iterations=2,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-3,
        seed=0,
        disable_tqdm=True,
    )
    if kind == "ext-ipo":
        trainer_cls, config = ExtGRPOTrainer, ExtGRPOConfig(loss_type="ipo", **common)
    else:
        trainer_cls, config = GRPOTrainer, GRPOConfig(loss_type="dapo", **common)
    timer = StepTimer()
    trainer = trainer_cls(
        model, reward, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[timer]
    )
    trainer.train()
    return timer.times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="pairs of runs (each pair runs both trainers)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    args = parser.parse_args()

    times: dict[str, list[float]] = {"trl-dapo": [], "ext-ipo": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            order = ["trl-dapo", "ext-ipo"] if round_index % 2 == 0 else ["ext-ipo", "trl-dapo"]
            for kind in order:
                times[kind].extend(run(kind, args.steps, tmp))

    medians = {kind: statistics.median(values) for kind, values in times.items()}
    ratio = medians["ext-ipo"] / medians["trl-dapo"]
    table = "\n".join(
        [
            "| trainer | loss | steps timed | median step (ms) |",
            "|---|---|---|---|",
            f"| trl.GRPOTrainer | dapo | {len(times['trl-dapo'])} | {1000 * medians['trl-dapo']:.2f} |",
            f"| trl_ext.ExtGRPOTrainer | ipo | {len(times['ext-ipo'])} | {1000 * medians['ext-ipo']:.2f} |",
        ]
    )
    verdict = "meets" if ratio <= 1.05 else "misses"
    body = (
        "## Step overhead: ExtGRPOTrainer(ipo) vs GRPOTrainer(dapo)\n\n"
        f"`python benchmarks/step_overhead.py --rounds {args.rounds} --steps {args.steps}` ({machine()}). "
        "Tiny Qwen2 (hidden 64), 8 completions of up to 32 tokens a step, num_iterations 2; runs alternated in "
        "one process; first step of each run not counted.\n\n"
        f"{table}\n\n**Median step-time ratio ipo/dapo: {ratio:.3f}** (target ≤ 1.05: {verdict})."
    )
    print(table)
    print(f"median step-time ratio ExtGRPOTrainer(ipo) / GRPOTrainer(dapo): {ratio:.3f} (target <= 1.05)")
    write_section("step_overhead", body)


if __name__ == "__main__":
    main()
