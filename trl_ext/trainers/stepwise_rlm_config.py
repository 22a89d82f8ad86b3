"""`StepwiseRLMConfig`: the RLM scaffold and REPL sandbox settings, on top of `ExtGRPOConfig`
(docs/stepwise_rlm.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ..fields import document_fields, documented
from ..losses import LOSSES, get_loss
from ..rlm import RLMScaffoldConfig
from ..rlm.sandbox import SandboxArguments
from ..rlm.scaffold import ScaffoldArguments
from .ext_grpo_config import ExtGRPOConfig


@document_fields
@dataclass
class StepwiseRLMConfig(ScaffoldArguments, SandboxArguments, ExtGRPOConfig):
    r"""
    Configuration for [`StepwiseRLMTrainer`]: every field of [`ExtGRPOConfig`] plus the RLM scaffold.

    The scaffold settings (docs/rlm_scaffold.md) are every setting of `trl_ext.rlm.RLMScaffoldConfig`
    (`trl_ext.rlm.scaffold.ScaffoldArguments`): limits under their own names (``max_turns``, ``max_depth``,
    ``max_children``, ``max_prompt_tokens``, ...), prompt templates as ``rlm_<template>`` (None keeps the built-in
    one) and ``rlm_helpers``. ``max_prompt_tokens=None`` caps every turn's prompt at the model's positions minus
    ``max_completion_length`` (a node whose prompt outgrows it ends with "prompt_too_long", counted in
    ``rlm/prompt_too_long_total``); TRL's ``max_prompt_length`` does not apply. The REPL sandbox (docs/security.md) is
    every field of `trl_ext.rlm.SandboxLimits` as ``repl_<name>``; the default isolation is the strongest the host
    allows (``"auto"``), ``repl_isolation="strict"`` refuses to start without Linux namespaces.
    """

    train_children: bool = documented(
        True,
        "Train the child nodes' turns too (False: root turns only).",
        section="Training samples (docs/stepwise_rlm.md)",
    )
    child_sampling: str = documented(
        "all",
        "'all' children with 1/k weights, or 'one' uniformly drawn child per parent (weight 1, unbiased, cheaper, "
        "noisier).",
        section="Training samples (docs/stepwise_rlm.md)",
    )
    rlm_loss_normalization: str = documented(
        "subtree",
        "'subtree' = the 1/k_g loss of docs/stepwise_rlm.md exactly (needs a loss normalised by the batch's token "
        "count, e.g. dapo or ipo); 'token' = every turn an ordinary row under the loss type's own normalisation "
        "(for dapo/ipo: the plain token mean).",
        section="Training samples (docs/stepwise_rlm.md)",
    )
    context_column: str = documented("context", "Dataset column holding each task's REPL `context`.", section="Data")
    save_rollout_trees: bool = documented(
        True,
        "Write every rollout tree as JSON lines under output_dir/rlm_trees/ (the completions table links to them).",
        section="Data",
    )

    def __post_init__(self):
        super().__post_init__()
        if self.max_prompt_length is not None:
            raise ValueError(
                f"max_prompt_length={self.max_prompt_length} does not apply to StepwiseRLMConfig, whose engine builds "
                "a new prompt every turn: set max_prompt_tokens (the cap on every turn's prompt) instead."
            )
        if self.child_sampling not in ("all", "one"):
            raise ValueError(f"child_sampling={self.child_sampling!r}: set 'all' (1/k weights) or 'one'.")
        if self.rlm_loss_normalization not in ("subtree", "token"):
            raise ValueError(f"rlm_loss_normalization={self.rlm_loss_normalization!r}: set 'subtree' or 'token'.")
        if self.rlm_loss_normalization == "subtree" and get_loss(self.loss_type).normalization != "tokens":
            raise ValueError(
                f"rlm_loss_normalization='subtree' needs a loss normalised by the batch's token count, not "
                f"loss_type={self.loss_type!r}: set loss_type to one of "
                f"{[name for name, spec in LOSSES.items() if spec.normalization == 'tokens']}, or "
                "rlm_loss_normalization='token'."
            )
        self.scaffold_config()  # validates the scaffold limits now, with the scaffold's own messages

    def scaffold_config(self) -> RLMScaffoldConfig:
        """The `RLMScaffoldConfig` of these settings, with the ``repl_<name>`` sandbox limits."""
        return ScaffoldArguments.scaffold_config(self, self.sandbox_limits())
