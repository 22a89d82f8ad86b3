"""Run by tests/trainers/test_ext_grpo.py under `torchrun --nproc_per_node 2`: ranks produce different row counts."""

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from tests.utils import cpu_config_kwargs, digit_reward, end_distributed_script, toy_dataset  # noqa: E402
from trl_ext import ExtGRPOConfig, ExtGRPOTrainer  # noqa: E402
from trl_ext.testing import build_tiny_model_and_tokenizer  # noqa: E402


class UnequalRowsTrainer(ExtGRPOTrainer):
    def process_scored_batch(self, batch, inputs):
        if self.accelerator.process_index == 0:
            return batch
        extra = torch.arange(3)
        return {
            key: torch.cat([value, value[extra]]) if isinstance(value, torch.Tensor) and value.dim() > 0 else value
            for key, value in batch.items()
        }

    def _compute_loss(self, model, inputs):
        self.calls.append((int((~inputs["is_padding_row"]).sum()), len(inputs["prompt_ids"])))
        return super()._compute_loss(model, inputs)


def main(out_dir: str) -> None:
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    config = ExtGRPOConfig(**cpu_config_kwargs(out_dir, loss_type="ipo", max_steps=2, ddp_backend="gloo"))
    trainer = UnequalRowsTrainer(
        model, digit_reward, args=config, train_dataset=toy_dataset(16), processing_class=tokenizer
    )
    trainer.calls = []
    trainer.train()
    rank = trainer.accelerator.process_index
    real, rows = trainer.calls[0]
    Path(out_dir, f"rank{rank}.txt").write_text(f"rank={rank} real_rows={real} rows={rows} steps={len(trainer.calls)}")
    end_distributed_script()  # every rank's results are written: leave without gloo's teardown (tests/utils.py)


if __name__ == "__main__":
    main(sys.argv[1])
