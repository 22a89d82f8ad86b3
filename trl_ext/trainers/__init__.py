"""Trainers: thin subclasses of TRL's GRPOTrainer/GRPOConfig that wire trl-ext's pure modules in."""

from .ext_grpo import ExtGRPOConfig, ExtGRPOTrainer
from .rlmt import RLMTConfig, RLMTTrainer

__all__ = ["ExtGRPOConfig", "ExtGRPOTrainer", "RLMTConfig", "RLMTTrainer"]
