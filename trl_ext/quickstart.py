"""`trl-ext quickstart`: a few IPO GRPO steps on the built-in tiny model, offline, on the CPU.

The task is deliberately trivial and fast: the reward counts the distinct characters of a completion, so
the run shows the whole pipeline working (generation, reward, group advantages, the IPO trust region, a LoRA
update) in well under a minute, not a model learning something useful.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class QuickstartResult:
    output_dir: Path
    steps: int
    reward_first: float
    reward_last: float
    masked_ratio_max: float
    loss_last: float
    adapter_dir: Path


def distinct_characters_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """Distinct characters / 16, capped at 1: varies between samples, so every group has a learning signal."""
    return [min(1.0, len(set(text)) / 16) for text in completions]


def run_quickstart(output_dir: str | Path = "trl-ext-quickstart", steps: int = 24, seed: int = 0) -> QuickstartResult:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from datasets import Dataset
    from peft import LoraConfig

    from trl_ext.testing import build_tiny_model_and_tokenizer
    from trl_ext.trainers import ExtGRPOConfig, ExtGRPOTrainer

    output_dir = Path(output_dir)
    model, tokenizer = build_tiny_model_and_tokenizer(seed, initializer_range=0.5)
    dataset = Dataset.from_dict({"prompt": [f"Write something about the number {i}." for i in range(64)]})
    config = ExtGRPOConfig(
        output_dir=str(output_dir),
        loss_type="ipo",
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        num_iterations=2,
        max_steps=steps,
        learning_rate=5e-2,
        logging_steps=1,
        save_strategy="no",
        seed=seed,
    )
    trainer = ExtGRPOTrainer(
        model,
        distinct_characters_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    trainer.train()
    adapter_dir = output_dir / "adapter"
    trainer.save_model(str(adapter_dir))

    history = trainer.state.log_history
    rewards = [h["reward"] for h in history if "reward" in h]
    losses = [h["loss"] for h in history if "loss" in h]
    return QuickstartResult(
        output_dir=output_dir,
        steps=trainer.state.global_step,
        reward_first=rewards[0],
        reward_last=rewards[-1],
        masked_ratio_max=max(h.get("ipo/masked_ratio", 0.0) for h in history),
        loss_last=losses[-1],
        adapter_dir=adapter_dir,
    )
