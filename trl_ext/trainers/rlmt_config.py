"""`RLMTConfig`: `ExtGRPOConfig` plus the RLMT format and reward-model settings
(`trl_ext.rewards.rlmt.arguments.RLMTArguments`; docs/rlmt.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ..fields import document_fields, documented
from ..rewards.rlmt.arguments import RLMTArguments
from .ext_grpo_config import ExtGRPOConfig


@document_fields
@dataclass
class RLMTConfig(RLMTArguments, ExtGRPOConfig):
    r"""
    Configuration for [`RLMTTrainer`]: every field of [`ExtGRPOConfig`] (and so of `trl.GRPOConfig`) and the RLMT
    settings of `trl_ext.rewards.rlmt.arguments.RLMTArguments` (shared with `AsyncRLMTConfig`). Defaults follow the
    paper where it sets them (temperature 0.7, KL β 0.001, group size 8, learning rate 1e-6); its prompt/response
    lengths were 1024/4096 tokens (set ``max_completion_length``).
    """

    beta: float = documented(0.001, "KL coefficient (RLMT paper: 0.001).", section="Paper defaults overriding TRL's")

    def __post_init__(self):
        self.check_rlmt_arguments()
        super().__post_init__()  # parses dict fields given as JSON strings (generation_kwargs) among others
        if self.use_vllm and self.stop_strings:
            # vLLM stops sampling at the stop string; RLMTTrainer cuts every completion after it anyway.
            generation_kwargs = dict(self.generation_kwargs or {})
            generation_kwargs.setdefault("stop", list(self.stop_strings))
            self.generation_kwargs = generation_kwargs
