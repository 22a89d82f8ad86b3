"""`StepwiseRLMConfig`: the RLM scaffold and REPL sandbox settings, on top of `ExtGRPOConfig`
(docs/stepwise_rlm.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..losses import LOSSES, get_loss
from ..rlm import RLMScaffoldConfig
from ..rlm.sandbox import SandboxArguments
from ..rlm.scaffold import ScaffoldArguments
from .ext_grpo_config import ExtGRPOConfig

# Deprecated alias: the losses normalised by the window's token count, where the "subtree" weights are exact (the
# registry `trl_ext.losses.LOSSES` is the home: `normalization == "tokens"`).
TOKEN_SUM_LOSS_TYPES = tuple(name for name, spec in LOSSES.items() if spec.normalization == "tokens")


@dataclass
class StepwiseRLMConfig(ScaffoldArguments, SandboxArguments, ExtGRPOConfig):
    r"""
    Configuration for [`StepwiseRLMTrainer`]: every field of [`ExtGRPOConfig`] plus the RLM scaffold.

    Parameters:
        > RLM scaffold (docs/rlm_scaffold.md)

        max_turns, max_depth, max_children, max_total_children, max_llm_queries, max_prompt_tokens, max_batch_size,
        max_batch_wait_s, rlm_helpers, rlm_system_prompt, rlm_first_user_prompt, rlm_user_prompt, ...: every
        setting of `trl_ext.rlm.RLMScaffoldConfig` (`trl_ext.rlm.scaffold.ScaffoldArguments`): limits under their
        own names, prompt templates as ``rlm_<template>`` (None keeps the built-in one). ``max_prompt_tokens=None``
        caps every turn's prompt at the model's positions minus ``max_completion_length`` (a node whose prompt
        outgrows it ends with "prompt_too_long", counted in ``rlm/prompt_too_long``); TRL's ``max_prompt_length``
        does not apply.

        > REPL sandbox (docs/security.md)

        repl_isolation, repl_network, repl_timeout_s, repl_memory_mb, repl_max_processes, repl_cpus, repl_disk_mb,
        ...: every field of `trl_ext.rlm.SandboxLimits` as ``repl_<name>``. The default isolation is the strongest
        the host allows (``"auto"``); ``repl_isolation="strict"`` refuses to start without Linux namespaces.

        > Training samples (docs/stepwise_rlm.md)

        train_children (`bool`, defaults to `True`): train the child nodes' turns too (False: root turns only).
        child_sampling (`str`, defaults to `"all"`): `"all"` children with 1/k weights, or `"one"` uniformly drawn
            child per parent (weight 1, unbiased, cheaper, noisier).
        rlm_loss_normalization (`str`, defaults to `"subtree"`): `"subtree"` = the 1/k_g loss of docs/stepwise_rlm.md exactly (needs a loss
            normalised by the batch's token count: `dapo`, `cispo`, `vespo` or `ipo`); `"token"` = every turn an
            ordinary row under the loss type's own normalisation (for `dapo`/`ipo`: the plain token mean).

        > Data

        context_column (`str`, defaults to `"context"`): dataset column holding each task's REPL `context`.
        save_rollout_trees (`bool`, defaults to `True`): write every tree as JSON lines under
            `output_dir/rlm_trees/` (the completions table links to them).
    """

    train_children: bool = field(default=True, metadata={"help": "Train the turns of child RLMs, not only roots'."})
    child_sampling: str = field(
        default="all", metadata={"help": "'all' children with 1/k weights, or 'one' drawn child per parent."}
    )
    rlm_loss_normalization: str = field(
        default="subtree",
        metadata={
            "help": "'subtree' (1/k_g weighting, docs/stepwise_rlm.md) or 'token' (plain token mean over all actions)."
        },
    )
    context_column: str = field(default="context", metadata={"help": "Dataset column with each task's context."})
    save_rollout_trees: bool = field(
        default=True, metadata={"help": "Write each rollout tree as JSON lines under output_dir/rlm_trees/."}
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
                f"loss_type={self.loss_type!r}: set loss_type to one of {list(TOKEN_SUM_LOSS_TYPES)}, or "
                "rlm_loss_normalization='token'."
            )
        self.scaffold_config()  # validates the scaffold limits now, with the scaffold's own messages

    def scaffold_config(self) -> RLMScaffoldConfig:
        """The `RLMScaffoldConfig` of these settings, with the ``repl_<name>`` sandbox limits."""
        return ScaffoldArguments.scaffold_config(self, self.sandbox_limits())
