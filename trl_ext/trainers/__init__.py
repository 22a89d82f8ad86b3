"""Trainers: thin subclasses of TRL's GRPOTrainer/GRPOConfig that wire trl-ext's pure modules in."""

from .ext_grpo import ExtGRPOTrainer
from .ext_grpo_config import ExtGRPOConfig
from .judge_credit import JudgeCreditTrainer
from .judge_credit_config import JudgeCreditConfig
from .rlmt import RLMTTrainer
from .rlmt_config import RLMTConfig
from .stepwise_rlm import StepwiseRLMTrainer
from .stepwise_rlm_config import StepwiseRLMConfig

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
