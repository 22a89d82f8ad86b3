"""Run by tests/trainers/test_stepwise_rlm.py under torchrun with 1 or 2 processes: the same global data either way.

Two prompts of different tree sizes ("root task": 14 turns a tree, "small task": 2), four rollouts each: with two
processes each rank holds one prompt's rollouts, so the ranks hold different row counts.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from tests.utils import cpu_config_kwargs, end_distributed_script  # noqa: E402
from trl_ext.testing import VariantGenerator, build_tiny_model_and_tokenizer, yes_reward  # noqa: E402
from trl_ext.trainers.stepwise_rlm import StepwiseRLMConfig, StepwiseRLMTrainer  # noqa: E402


class RecordingTrainer(StepwiseRLMTrainer):
    def process_scored_batch(self, batch, inputs):
        batch = super().process_scored_batch(batch, inputs)
        self.real_rows = len(batch["prompt_ids"])
        return batch


def main(out_dir: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model, tokenizer = build_tiny_model_and_tokenizer(
        0,
        initializer_range=0.2,
    )
    config = StepwiseRLMConfig(
        **cpu_config_kwargs(
            out_dir,
            max_depth=2,
            max_turns=4,
            per_device_train_batch_size=8 // world,
            num_generations=4,
            num_iterations=2,
            max_steps=2,
            learning_rate=0.5,
            optim="sgd",  # Adam's first step is sign-like: float noise in near-zero gradients would flip updates
            ddp_backend="gloo",
            save_rollout_trees=False,
        )
    )
    dataset = Dataset.from_dict({"prompt": ["root task", "small task"], "context": ["abcdefgh", "abcdefgh"]})
    trainer = RecordingTrainer(
        model,
        yes_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        generator=VariantGenerator(tokenizer),
    )
    trainer.train()
    rank = trainer.accelerator.process_index
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    rows = trainer.accelerator.gather(torch.tensor([trainer.real_rows])).tolist()
    if rank == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        Path(out_dir, "losses.txt").write_text(" ".join(repr(x) for x in losses))
        Path(out_dir, "rows.txt").write_text(" ".join(str(x) for x in rows))
    end_distributed_script()  # every rank's results are written: leave without gloo's teardown (tests/utils.py)


if __name__ == "__main__":
    main(sys.argv[1])
