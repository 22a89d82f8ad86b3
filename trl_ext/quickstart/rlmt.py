"""The RLMT miniature (``--method rlmt``): `RLMTTrainer` on a few instruction prompts, scored by the tiny reward
model (`trl_ext.testing.build_tiny_reward_model`) with a lenient format check for the untrained policy. It shows the
trainer, the monitors and the outputs working end to end; it is not expected to learn anything in a few steps.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .report import QuickstartResult, history_mean
from .settings import QuickstartSettings, miniature_run_kwargs
from .training import save_miniature_run, train_miniature


def run_rlmt(
    output: Path, settings: QuickstartSettings, fast: bool, progress: bool, say: Callable[[str], None]
) -> QuickstartResult:
    """The RLMT miniature in ``output``; ``say`` gets one line per stage."""
    from datasets import Dataset

    from trl_ext.callbacks import default_monitors
    from trl_ext.rewards import RewardModelScorer
    from trl_ext.run_info import config_summary
    from trl_ext.testing import build_tiny_model_and_tokenizer, build_tiny_reward_model
    from trl_ext.trainers import RLMTConfig, RLMTTrainer

    policy, tokenizer = build_tiny_model_and_tokenizer(settings.seed, initializer_range=0.5)
    reward_model, rm_tokenizer = build_tiny_reward_model(settings.seed + 1, initializer_range=0.5)
    scorer = RewardModelScorer(reward_model, rm_tokenizer, format="instruct", strict=False)
    prompts = ["Say hello.", "Name a colour.", "Count to five.", "What is 2 + 3?", "Say yes or no.", "Greet me."]
    dataset = Dataset.from_dict({"prompt": [prompts[i % len(prompts)] for i in range(48)]})
    say("[1/2] tiny policy and tiny reward model (scores the response only; lenient format for the untrained policy)")
    config = RLMTConfig(
        **miniature_run_kwargs(output, settings, fast, progress),
        max_completion_length=24,
        loss_type="ipo",
        strict_format=False,
    )
    monitors = default_monitors()
    say(
        f"[2/2] RLMTTrainer: {config.max_steps} steps, instruct format, IPO loss, LoRA, β = {config.beta}, "
        "default monitors"
    )
    trainer = train_miniature(RLMTTrainer, policy, scorer, config, dataset, tokenizer, monitors)
    result = save_miniature_run("rlmt", trainer, monitors, output, settings, fast, say)
    history = trainer.state.log_history
    result.extra = {
        "base_model": "trl_ext.testing.build_tiny_model_and_tokenizer (in memory, not on disk)",
        "reward_model": "trl_ext.testing.build_tiny_reward_model (in memory)",
        "config": config_summary(config),
        "malformed_ratio_mean": history_mean(history, "reward_model/malformed_ratio"),
    }
    return result
