"""Trainers: thin subclasses of TRL's GRPOTrainer/GRPOConfig that wire trl-ext's pure modules in.

The asynchronous trainers (`ExtAsyncGRPOTrainer`, `AsyncStepwiseRLMTrainer`, `AsyncJudgeCreditTrainer`,
`AsyncRLMTTrainer` and their configs, on TRL's experimental `AsyncGRPOTrainer`, and `LocalPolicy`, their in-process
sampler) load on first access: importing `trl.experimental` warns that its APIs may change.
"""

from importlib import import_module
from typing import Any

from .ext_grpo import ExtGRPOTrainer
from .ext_grpo_config import ExtGRPOConfig
from .judge_credit import JudgeCreditTrainer
from .judge_credit_config import JudgeCreditConfig
from .rlmt import RLMTTrainer
from .rlmt_config import RLMTConfig
from .stepwise_rlm import StepwiseRLMTrainer
from .stepwise_rlm_config import StepwiseRLMConfig

# public name -> module, imported on first access
_LAZY = {
    "AsyncJudgeCreditConfig": "trl_ext.trainers.async_judge",
    "AsyncJudgeCreditTrainer": "trl_ext.trainers.async_judge",
    "AsyncRLMTConfig": "trl_ext.trainers.async_rlmt",
    "AsyncRLMTTrainer": "trl_ext.trainers.async_rlmt",
    "AsyncStepwiseRLMConfig": "trl_ext.trainers.async_rlm",
    "AsyncStepwiseRLMTrainer": "trl_ext.trainers.async_rlm",
    "ExtAsyncGRPOConfig": "trl_ext.trainers.ext_async_grpo_config",
    "ExtAsyncGRPOTrainer": "trl_ext.trainers.ext_async_grpo",
    "LocalPolicy": "trl_ext.serving.local_policy",
}

__all__ = [
    "AsyncJudgeCreditConfig",
    "AsyncJudgeCreditTrainer",
    "AsyncRLMTConfig",
    "AsyncRLMTTrainer",
    "AsyncStepwiseRLMConfig",
    "AsyncStepwiseRLMTrainer",
    "ExtAsyncGRPOConfig",
    "ExtAsyncGRPOTrainer",
    "ExtGRPOConfig",
    "ExtGRPOTrainer",
    "JudgeCreditConfig",
    "JudgeCreditTrainer",
    "LocalPolicy",
    "RLMTConfig",
    "RLMTTrainer",
    "StepwiseRLMConfig",
    "StepwiseRLMTrainer",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trl_ext.trainers' has no attribute {name!r}")
