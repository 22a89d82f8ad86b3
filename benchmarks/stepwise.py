"""Stepwise RLM rows (packed and unpacked) vs the same action tokens as flattened rows: step time and tokens.

All trainers run the same scripted multi-turn RLM trees (depth 2, uneven children) on the tiny model:

- **stepwise-packed**: `StepwiseRLMTrainer` with shared-prefix packing (``prefix_sharing="auto"``, the default):
  one row per turn of every node, each turn a branch off its tree's shared histories (docs/packing.md);
- **stepwise-rows**: the same rows unpacked (``prefix_sharing="off"``): every turn re-encodes the system prompt and
  its whole history;
- **flat**: the same trees flattened into one row per node — the node's first prompt, then its actions and the
  REPL observations between them (observations masked out of the loss with TRL's ``tool_mask``), trained by
  `ExtGRPOTrainer`'s loss on the same advantages, unpacked. Same action tokens, no repeated history.

Processed tokens: what the loss forwards process (rows × (prompt width + completion width); packed: the packed
tokens); padding = 1 − real / processed for the unpacked rows. Runs alternate in one process; prints a table and
writes it into benchmarks/RESULTS.md.

    python benchmarks/stepwise.py [--rounds 2] [--steps 3]
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
sys.path.insert(0, str(Path(__file__).parents[1]))

import torch  # noqa: E402
from _results import machine, write_section  # noqa: E402
from _timing import GenerationTimer, StepTimer  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl.trainer.utils import pad  # noqa: E402

from trl_ext.testing import VariantGenerator, build_tiny_model_and_tokenizer, yes_reward  # noqa: E402
from trl_ext.trainers.stepwise_rlm import StepwiseRLMConfig, StepwiseRLMTrainer  # noqa: E402


class PaddingMeter:
    """Counts real and processed tokens of every micro-batch the loss sees."""

    def __init__(self) -> None:
        self.real = 0
        self.processed = 0

    def add(self, inputs, packed_ratio: float | None = None) -> None:
        """``packed_ratio``: packed tokens / the rows' tokens, when the trainer packed this micro-batch."""
        rows = inputs["prompt_ids"].shape[0]
        width = inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]
        self.processed += round(rows * width * (packed_ratio if packed_ratio is not None else 1.0))
        self.real += int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())

    @property
    def fraction(self) -> float:
        return 1 - self.real / max(1, self.processed)


class MeteredStepwise(GenerationTimer, StepwiseRLMTrainer):
    """Counts the tokens of every micro-batch; times generation (rollouts, rewards, row building) to subtract it."""

    def _compute_loss(self, model, inputs):
        before = len(self._metrics["train"].get("packing/token_ratio", []))
        loss = super()._compute_loss(model, inputs)
        ratios = self._metrics["train"].get("packing/token_ratio", [])
        self.meter.add(inputs, ratios[-1] if len(ratios) > before else None)
        return loss


class FlatRows:
    """`StepwiseRLMTrainer` mixin: one row per node instead of one per turn: the node's first prompt, then its
    actions and the REPL observations between them, observations masked out of the loss (TRL's ``tool_mask``)."""

    def process_scored_batch(self, batch, inputs):
        tokenizer = self.processing_class
        device = batch["completion_ids"].device
        prompts, completions, tool_masks, roots = [], [], [], []
        for root, tree in enumerate(self.last_rollout_trees):
            for node in tree.nodes:
                ids, mask = [], []
                for turn in node.turns:
                    ids += turn.action_ids
                    mask += [1] * len(turn.action_ids)
                    if turn.observation is not None:
                        text = f"<|im_start|>user\n{turn.observation}<|im_end|>\n<|im_start|>assistant\n"
                        observation = tokenizer(text, add_special_tokens=False)["input_ids"]
                        ids += observation
                        mask += [0] * len(observation)
                prompts.append(torch.tensor(node.turns[0].prompt_ids))
                completions.append(torch.tensor(ids))
                tool_masks.append(torch.tensor(mask))
                roots.append(root)
        pad_id = tokenizer.pad_token_id
        row_root = torch.tensor(roots, device=device)
        return {
            "prompt_ids": pad(prompts, padding_value=pad_id, padding_side="left").to(device),
            "prompt_mask": pad([torch.ones_like(p) for p in prompts], padding_side="left").to(device),
            "completion_ids": pad(completions, padding_value=pad_id).to(device),
            "completion_mask": pad([torch.ones_like(c) for c in completions]).to(device),
            "tool_mask": pad(tool_masks, padding_value=0).to(device),
            "advantages": batch["advantages"][row_root],
            "num_items_in_batch": batch["num_items_in_batch"],
        }


class MeteredFlat(FlatRows, MeteredStepwise):
    pass


def run(kind: str, steps: int, output_dir: str) -> tuple[list[float], PaddingMeter]:
    model, tokenizer = build_tiny_model_and_tokenizer(0, hidden_size=64, intermediate_size=128)
    config = StepwiseRLMConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=4,
        steps_per_generation=4,
        gradient_accumulation_steps=4,
        num_generations=4,
        max_depth=2,
        max_turns=4,
        max_steps=steps,
        learning_rate=0.0,  # identical rollouts for every trainer, step after step
        logging_steps=1,
        save_strategy="no",
        save_rollout_trees=False,
        rlm_loss_normalization="token",
        seed=0,
        disable_tqdm=True,
        prefix_sharing="auto" if kind == "stepwise-packed" else "off",
    )
    dataset = Dataset.from_dict({"prompt": ["root task", "small task"] * 8, "context": ["abcdefgh"] * 16})
    trainer_cls = MeteredFlat if kind == "flat" else MeteredStepwise
    timer = StepTimer()
    trainer = trainer_cls(
        model,
        yes_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        generator=VariantGenerator(tokenizer),
        callbacks=[timer],
    )
    trainer.meter = PaddingMeter()
    timer.trainer = trainer
    trainer.train()
    return timer.training_times[1:], trainer.meter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (one generation each)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier timings on a shared, noisy machine)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    kinds = ["stepwise-packed", "stepwise-rows", "flat"]
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    meters: dict[str, PaddingMeter] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for kind in kinds if round_index % 2 == 0 else kinds[::-1]:
                step_times, meter = run(kind, args.steps, tmp)
                times[kind] += step_times
                meters[kind] = meter
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    rows = [
        f"| {kind} | {len(times[kind])} | {1000 * medians[kind]:.0f} | {meters[kind].real:,} | "
        f"{meters[kind].processed:,} | {meters[kind].processed / meters[kind].real:.2f} |"
        for kind in kinds
    ]
    table = "\n".join(
        [
            "| rows | steps timed | median training time / step (ms) | real tokens / run | processed tokens / run "
            "| processed / real |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    ratio = medians["stepwise-packed"] / medians["flat"]
    unpacked_ratio = medians["stepwise-rows"] / medians["flat"]
    verdict = "meets" if ratio <= 1.3 else "misses"
    body = (
        "## Stepwise RLM rows (packed, unpacked) vs flattened rows\n\n"
        f"`python benchmarks/stepwise.py --rounds {args.rounds} --steps {args.steps}` ({machine()}). Tiny Qwen2 "
        "(hidden 64); scripted depth-2 trees (a 6-node tree of 14 turns and a 1-node tree of 2 turns per prompt), "
        "16 roots per step in 4 micro-batches; learning rate 0 so all three see identical rollouts. Training "
        "time = optimizer step minus generation (rollouts, rewards, row building: identical for all); first step "
        "of each run not counted.\n\n"
        f"{table}\n\n**Training-time ratio stepwise packed / flat: {ratio:.2f}** (target <= 1.3: {verdict}); "
        f"unpacked stepwise rows / flat: {unpacked_ratio:.2f}; stepwise rows padding "
        f"{100 * meters['stepwise-rows'].fraction:.1f} % of their processed tokens."
    )
    print(table)
    print(f"training-time ratio stepwise packed/flat: {ratio:.2f} (target <= 1.3); rows/flat: {unpacked_ratio:.2f}")
    write_section("stepwise", body)


if __name__ == "__main__":
    main()
