"""`ExtGRPOTrainer` as a drop-in for `trl.GRPOTrainer`: with TRL's settings it trains bit for bit like TRL."""

from __future__ import annotations

import math

import torch
from trl import GRPOConfig, GRPOTrainer

from trl_ext.testing import build_tiny_model_and_tokenizer
from trl_ext.trainers import ExtGRPOConfig, ExtGRPOTrainer

from ..utils import cpu_config_kwargs, digit_reward, toy_dataset


def _train(trainer_class, config_class, output_dir: str) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """The logged steps and the final weights of a 4-step run at a learning rate high enough (0.1) that any
    difference in how the loss is summed shows in the weights."""
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    # steps_per_generation (TRL: gradient_accumulation_steps) > 1: every generation batch of 4 prompts x 2 completions
    # is split into 2 micro-batches; with prefix_sharing="auto" ExtGRPOTrainer keeps TRL's split unless a pass is
    # packed (these short prompts save too few tokens to be worth it).
    config = config_class(
        **cpu_config_kwargs(
            output_dir, max_steps=4, gradient_accumulation_steps=2, num_generations=2, learning_rate=0.1
        )
    )
    trainer = trainer_class(
        model, digit_reward, args=config, train_dataset=toy_dataset(16), processing_class=tokenizer
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return logged, {name: tensor.detach().clone() for name, tensor in trainer.model.state_dict().items()}


def test_ext_grpo_trainer_is_bit_for_bit_trl_grpo_trainer(tmp_path):
    """TRL's defaults (loss "dapo", prefix_sharing "auto"): the same samples, the same losses, gradient norms and
    metrics step by step, and the same weights after 4 steps, to the last bit."""
    trl_steps, trl_weights = _train(GRPOTrainer, GRPOConfig, str(tmp_path / "trl"))
    ext_steps, ext_weights = _train(ExtGRPOTrainer, ExtGRPOConfig, str(tmp_path / "ext"))
    assert len(trl_steps) == len(ext_steps) == 4
    for step, (trl_logged, ext_logged) in enumerate(zip(trl_steps, ext_steps, strict=True)):
        shared = set(trl_logged) & set(ext_logged)
        assert {"loss", "grad_norm", "reward", "entropy", "completions/mean_length"} <= shared
        for key in sorted(shared - {"step_time", "epoch"}):
            same = ext_logged[key] == trl_logged[key] or (math.isnan(ext_logged[key]) and math.isnan(trl_logged[key]))
            assert same, (step, key, trl_logged[key], ext_logged[key])
    assert trl_weights.keys() == ext_weights.keys()
    moved = [name for name in trl_weights if not torch.equal(trl_weights[name], ext_weights[name])]
    assert moved == [], moved
    initial = build_tiny_model_and_tokenizer(0)[0].state_dict()
    assert any(not torch.equal(initial[name], trl_weights[name]) for name in trl_weights)  # the runs trained
