"""Step-time overhead of `ExtGRPOTrainer(loss_type="ipo")` against `trl.GRPOTrainer(loss_type="dapo")`.

Same tiny model, data and seed, and a learning rate of 0 so that both trainers generate exactly the same
completions and do the same work except the loss; an `ExtGRPOTrainer(loss_type="dapo")` run measures the cost of
the subclass's own bookkeeping (hook, row checks, padding). Runs alternate in one process (rotating order) so that
machine noise hits all alike. A step is timed from `on_step_begin` to `on_step_end` (generation, the loss, backward and
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
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _results import machine, write_section  # noqa: E402
from _timing import GenerationTimer, StepTimer  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from trl_ext import ExtGRPOConfig, ExtGRPOTrainer  # noqa: E402
from trl_ext.testing import build_tiny_model_and_tokenizer  # noqa: E402


class TimedGRPOTrainer(GenerationTimer, GRPOTrainer):
    pass


class TimedExtGRPOTrainer(GenerationTimer, ExtGRPOTrainer):
    pass


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
        learning_rate=0.0,
        seed=0,
        disable_tqdm=True,
    )
    if kind == "ext-ipo":
        trainer_cls, config = TimedExtGRPOTrainer, ExtGRPOConfig(loss_type="ipo", **common)
    elif kind == "ext-dapo":
        trainer_cls, config = TimedExtGRPOTrainer, ExtGRPOConfig(loss_type="dapo", **common)
    else:
        trainer_cls, config = TimedGRPOTrainer, GRPOConfig(loss_type="dapo", **common)
    timer = StepTimer()
    trainer = trainer_cls(
        model, reward, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[timer]
    )
    timer.trainer = trainer
    trainer.train()
    return timer.times[1:], timer.training_times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="pairs of runs (each pair runs both trainers)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier timings on a shared, noisy machine)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    kinds = ["trl-dapo", "ext-ipo", "ext-dapo"]
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    training: dict[str, list[float]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            shift = round_index % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                step_times, training_times = run(kind, args.steps, tmp)
                times[kind] += step_times
                training[kind] += training_times

    medians = {kind: statistics.median(values) for kind, values in times.items()}
    train_medians = {kind: statistics.median(values) for kind, values in training.items()}
    ratio = medians["ext-ipo"] / medians["trl-dapo"]
    train_ratio = train_medians["ext-ipo"] / train_medians["trl-dapo"]
    names = {
        "trl-dapo": ("trl.GRPOTrainer", "dapo"),
        "ext-ipo": ("trl_ext.ExtGRPOTrainer", "ipo"),
        "ext-dapo": ("trl_ext.ExtGRPOTrainer", "dapo"),
    }
    rows = [
        f"| {names[k][0]} | {names[k][1]} | {len(times[k])} | {1000 * medians[k]:.2f} | "
        f"{medians[k] / medians['trl-dapo']:.3f} | {1000 * train_medians[k]:.2f} | "
        f"{train_medians[k] / train_medians['trl-dapo']:.3f} |"
        for k in kinds
    ]
    table = "\n".join(
        [
            "| trainer | loss | steps timed | median step (ms) | ratio | median training time (ms) | ratio |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    verdict = "meets" if ratio <= 1.05 else "misses"
    body = (
        "## Step overhead: ExtGRPOTrainer(ipo) vs GRPOTrainer(dapo)\n\n"
        f"`python benchmarks/step_overhead.py --rounds {args.rounds} --steps {args.steps}` ({machine()}). "
        "Tiny Qwen2 (hidden 64), 8 completions of up to 32 tokens a step, num_iterations 2, learning rate 0 "
        "(identical completions for every trainer); runs alternated in one process; first step of each run not "
        "counted.\n\n"
        f"{table}\n\nRatios are to `GRPOTrainer(dapo)`; training time = the step minus generation and scoring "
        "(identical work for all three here). "
        f"**Median step-time ratio ipo/dapo: {ratio:.3f}**, training-time ratio {train_ratio:.3f} "
        f"(target ≤ 1.05: {verdict})."
    )
    print(table)
    print(
        f"median step-time ratio ExtGRPOTrainer(ipo) / GRPOTrainer(dapo): {ratio:.3f}, "
        f"training-time ratio {train_ratio:.3f} (target <= 1.05)"
    )
    write_section("step_overhead", body)


if __name__ == "__main__":
    main()
