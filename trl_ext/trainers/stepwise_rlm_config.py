"""`StepwiseRLMConfig`: `ExtGRPOConfig` plus the stepwise RLM settings (`trl_ext.rlm.arguments.StepwiseArguments`:
the RLM scaffold, the REPL sandbox, the training samples; docs/stepwise_rlm.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ..fields import document_fields
from ..rlm.arguments import StepwiseArguments
from .ext_grpo_config import ExtGRPOConfig


@document_fields
@dataclass
class StepwiseRLMConfig(StepwiseArguments, ExtGRPOConfig):
    r"""
    Configuration for [`StepwiseRLMTrainer`]: every field of [`ExtGRPOConfig`] plus the stepwise RLM settings of
    `trl_ext.rlm.arguments.StepwiseArguments` (shared with `AsyncStepwiseRLMConfig`).

    The scaffold settings (docs/rlm_scaffold.md) are every setting of `trl_ext.rlm.RLMScaffoldConfig`
    (`trl_ext.rlm.scaffold.ScaffoldArguments`): limits under their own names (``max_turns``, ``max_depth``,
    ``max_children``, ``max_prompt_tokens``, ...), prompt templates as ``rlm_<template>`` (None keeps the built-in
    one) and ``rlm_helpers``. ``max_prompt_tokens=None`` caps every turn's prompt at the model's positions minus
    ``max_completion_length`` (a node whose prompt outgrows it ends with "prompt_too_long", counted in
    ``rlm/prompt_too_long_total``); TRL's ``max_prompt_length`` does not apply. The REPL sandbox (docs/security.md) is
    every field of `trl_ext.rlm.SandboxLimits` as ``repl_<name>``; the default isolation is the strongest the host
    allows (``"auto"``), ``repl_isolation="strict"`` refuses to start without Linux namespaces.
    """

    def __post_init__(self):
        super().__post_init__()
        if self.max_prompt_length is not None:
            raise ValueError(
                f"max_prompt_length={self.max_prompt_length} does not apply to StepwiseRLMConfig, whose engine builds "
                "a new prompt every turn: set max_prompt_tokens (the cap on every turn's prompt) instead."
            )
        self.check_stepwise_arguments()
