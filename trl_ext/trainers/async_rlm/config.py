"""`AsyncStepwiseRLMConfig`: `ExtAsyncGRPOConfig` plus the RLM scaffold, the REPL sandbox and the stepwise fields,
under the names (and meaning) of `StepwiseRLMConfig` (docs/stepwise_rlm.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ...fields import document_fields, mirror_field
from ...rlm import RLMScaffoldConfig
from ...rlm.sandbox import SandboxArguments
from ...rlm.scaffold import ScaffoldArguments
from ..ext_async_grpo_config import ExtAsyncGRPOConfig
from ..stepwise_rlm_config import StepwiseRLMConfig

__all__ = ["AsyncStepwiseRLMConfig"]

_SECTION = "Training samples (docs/stepwise_rlm.md)"


def _stepwise(name: str, **options):
    return mirror_field(StepwiseRLMConfig, name, "Stepwise RLM", section=_SECTION, **options)


@document_fields
@dataclass
class AsyncStepwiseRLMConfig(ScaffoldArguments, SandboxArguments, ExtAsyncGRPOConfig):
    r"""
    Configuration for [`AsyncStepwiseRLMTrainer`]: every field of [`ExtAsyncGRPOConfig`] (TRL's asynchronous
    trainer and ``loss_type``/``ipo_*``), the RLM scaffold (`trl_ext.rlm.scaffold.ScaffoldArguments`: ``max_turns``,
    ``max_depth``, ``max_children``, ``max_prompt_tokens``, ``rlm_<template>``, ...), the REPL sandbox
    (``repl_<name>``) and the stepwise fields of `StepwiseRLMConfig` (``train_children``, ``child_sampling``,
    ``rlm_loss_normalization``, ``context_column``, ``scale_rewards``, ``reward_weights``, ``save_rollout_trees``), same
    names, same meaning.

    Sampling follows TRL's async settings (``max_completion_length``, ``temperature``, ``top_p``, ``top_k``,
    ``min_p``, ``repetition_penalty``) against ``vllm_server_base_url``. ``max_prompt_tokens=None`` caps every turn's
    prompt at the model's positions minus ``max_completion_length``, as `StepwiseRLMConfig` does.
    """

    train_children: bool = _stepwise("train_children")
    child_sampling: str = _stepwise("child_sampling")
    rlm_loss_normalization: str = _stepwise("rlm_loss_normalization")
    context_column: str = mirror_field(StepwiseRLMConfig, "context_column", "Stepwise RLM", section="Data")
    scale_rewards: str = mirror_field(
        StepwiseRLMConfig,
        "scale_rewards",
        "Group advantage",
        note="The rollout worker scores one group at a time, so 'batch' is not available here.",
        section=_SECTION,
    )
    reward_weights: list[float] | None = mirror_field(StepwiseRLMConfig, "reward_weights", "Rewards", section=_SECTION)
    save_rollout_trees: bool = mirror_field(
        StepwiseRLMConfig,
        "save_rollout_trees",
        "Stepwise RLM",
        note="Here: one file per rollout-worker run, rlm_trees/train-v<policy version>-run<run>.jsonl, and no "
        "completions table (docs/async.md).",
        section="Data",
    )

    def __post_init__(self):
        super().__post_init__()
        if self.child_sampling not in ("all", "one"):
            raise ValueError(f"child_sampling={self.child_sampling!r}: set 'all' (1/k weights) or 'one'.")
        if self.rlm_loss_normalization not in ("subtree", "token"):
            raise ValueError(f"rlm_loss_normalization={self.rlm_loss_normalization!r}: set 'subtree' or 'token'.")
        if self.scale_rewards not in ("group", "none"):
            raise ValueError(
                f"scale_rewards={self.scale_rewards!r}: the asynchronous rollout worker scores one group at a time; "
                "set 'group' (divide by the group's std) or 'none' (Dr. GRPO)."
            )
        self.scaffold_config()  # validates the scaffold limits now, with the scaffold's own messages

    def scaffold_config(self) -> RLMScaffoldConfig:
        """The `RLMScaffoldConfig` of these settings, with the ``repl_<name>`` sandbox limits."""
        return ScaffoldArguments.scaffold_config(self, self.sandbox_limits())
