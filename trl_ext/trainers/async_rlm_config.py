"""`AsyncStepwiseRLMConfig`: `AsyncMethodConfig` plus the stepwise RLM settings of `StepwiseRLMConfig`
(`trl_ext.rlm.arguments.StepwiseArguments`, declared once for both; docs/stepwise_rlm.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ..fields import document_fields
from ..rlm.arguments import StepwiseArguments
from .ext_async_grpo_config import AsyncMethodConfig

__all__ = ["AsyncStepwiseRLMConfig"]


@document_fields
@dataclass
class AsyncStepwiseRLMConfig(StepwiseArguments, AsyncMethodConfig):
    r"""
    Configuration for [`AsyncStepwiseRLMTrainer`]: every field of [`ExtAsyncGRPOConfig`] (TRL's asynchronous
    trainer and ``loss_type``/``ipo_*``), ``scale_rewards`` and ``reward_weights`` (`AsyncMethodConfig`), and the
    stepwise RLM settings of `StepwiseRLMConfig` (`trl_ext.rlm.arguments.StepwiseArguments`: the RLM scaffold, the
    REPL sandbox ``repl_<name>``, ``train_children``, ``child_sampling``, ``rlm_loss_normalization``,
    ``context_column``, ``save_rollout_trees``), the same fields.

    Sampling follows TRL's async settings (``max_completion_length``, ``temperature``, ``top_p``, ``top_k``,
    ``min_p``, ``repetition_penalty``) against ``vllm_server_base_url``. ``max_prompt_tokens=None`` caps every turn's
    prompt at the model's positions minus ``max_completion_length``, as `StepwiseRLMConfig` does.
    """

    def __post_init__(self):
        super().__post_init__()
        self.check_stepwise_arguments()
