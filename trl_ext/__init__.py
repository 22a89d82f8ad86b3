"""trl-ext: stepwise RLM training, token-span judge credit, the IPO masking loss and monitors for TRL.

Importing ``trl_ext`` is cheap; the trainer classes (which import TRL, ~7 s) load on first access.
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it; resolved lazily so `trl-ext --version` and the pure math stay fast.
_LAZY = {
    "ExtAsyncGRPOConfig": "trl_ext.trainers",
    "ExtAsyncGRPOTrainer": "trl_ext.trainers",
    "AsyncStepwiseRLMConfig": "trl_ext.trainers",
    "AsyncJudgeCreditConfig": "trl_ext.trainers",
    "AsyncJudgeCreditTrainer": "trl_ext.trainers",
    "AsyncRLMTConfig": "trl_ext.trainers",
    "AsyncRLMTTrainer": "trl_ext.trainers",
    "AsyncStepwiseRLMTrainer": "trl_ext.trainers",
    "ExtGRPOConfig": "trl_ext.trainers",
    "ExtGRPOTrainer": "trl_ext.trainers",
    "ipo_keep_mask": "trl_ext.losses",
    "ipo_loss": "trl_ext.losses",
    "LossSpec": "trl_ext.losses",
    "register_loss": "trl_ext.losses",
    "ClipRateMonitor": "trl_ext.callbacks",
    "EntropyMonitor": "trl_ext.callbacks",
    "RewardMonitor": "trl_ext.callbacks",
    "default_monitors": "trl_ext.callbacks",
    "add_monitors": "trl_ext.callbacks",
    "plot_run": "trl_ext.callbacks",
    "JudgeCreditConfig": "trl_ext.trainers",
    "JudgeCreditTrainer": "trl_ext.trainers",
    "StepwiseRLMConfig": "trl_ext.trainers",
    "StepwiseRLMTrainer": "trl_ext.trainers",
    "insert_markers": "trl_ext.judge",
    "span_credit": "trl_ext.judge",
    "cap_credit": "trl_ext.judge",
    "RLMTConfig": "trl_ext.trainers",
    "RLMTTrainer": "trl_ext.trainers",
    "RubricJudgeReward": "trl_ext.rewards",
    "RubricJudgeConfig": "trl_ext.rewards",
    "CharSpanF1Reward": "trl_ext.rewards",
    "char_span_f1": "trl_ext.rewards",
    "RewardModelScorer": "trl_ext.rewards",
    "ServedRewardModelScorer": "trl_ext.rewards",
    "split_thinking": "trl_ext.rewards",
    "build_dpo_pairs": "trl_ext.rewards",
    "split_cold_start": "trl_ext.sft",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trl_ext' has no attribute {name!r}")
