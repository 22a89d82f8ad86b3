"""Trainers: thin subclasses of TRL's GRPOTrainer/GRPOConfig that wire trl-ext's pure modules in."""

from .ext_grpo import ExtGRPOConfig, ExtGRPOTrainer
from .judge_credit import JudgeCreditConfig, JudgeCreditTrainer
from .rlmt import RLMTConfig, RLMTTrainer
from .stepwise_rlm import StepwiseRLMConfig, StepwiseRLMTrainer

__all__ = [
    "ExtGRPOConfig",
    "ExtGRPOTrainer",
    "JudgeCreditConfig",
    "JudgeCreditTrainer",
    "RLMTConfig",
    "RLMTTrainer",
    "StepwiseRLMConfig",
    "StepwiseRLMTrainer",
]
