"""`ExtGRPOTrainer` as a drop-in for `trl.GRPOTrainer`: with TRL's settings it trains seed for seed like TRL."""

from __future__ import annotations

import pytest
from trl import GRPOConfig, GRPOTrainer

from trl_ext.testing import build_tiny_model_and_tokenizer
from trl_ext.trainers import ExtGRPOConfig, ExtGRPOTrainer

from ..utils import cpu_config_kwargs, digit_reward, toy_dataset


def _logged_steps(trainer_class, config_class, output_dir: str) -> list[dict[str, float]]:
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    # steps_per_generation (TRL: gradient_accumulation_steps) > 1: every generation batch of 4 prompts x 2 completions
    # is split into 2 micro-batches (and ExtGRPOTrainer re-splits it by prompt, prefix_sharing="auto").
    config = config_class(
        **cpu_config_kwargs(output_dir, max_steps=3, gradient_accumulation_steps=2, num_generations=2)
    )
    trainer = trainer_class(
        model, digit_reward, args=config, train_dataset=toy_dataset(16), processing_class=tokenizer
    )
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_ext_grpo_trainer_is_seed_for_seed_trl_grpo_trainer(tmp_path):
    """TRL's defaults (loss "dapo", prefix_sharing "auto"): the same samples, hence the same metrics, step by step."""
    trl_steps = _logged_steps(GRPOTrainer, GRPOConfig, str(tmp_path / "trl"))
    ext_steps = _logged_steps(ExtGRPOTrainer, ExtGRPOConfig, str(tmp_path / "ext"))
    assert len(trl_steps) == len(ext_steps) == 3
    for step, (trl_logged, ext_logged) in enumerate(zip(trl_steps, ext_steps, strict=True)):
        shared = set(trl_logged) & set(ext_logged)
        assert {"loss", "reward", "entropy", "completions/mean_length"} <= shared
        for key in sorted(shared - {"step_time", "epoch"}):
            assert ext_logged[key] == pytest.approx(trl_logged[key], rel=1e-5, abs=1e-7), (step, key)
