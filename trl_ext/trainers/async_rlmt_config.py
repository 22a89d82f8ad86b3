"""`AsyncRLMTConfig`: `AsyncMethodConfig` plus the RLMT format and reward-model settings of `RLMTConfig`
(`trl_ext.rewards.rlmt.arguments.RLMTArguments`, declared once for both; docs/rlmt.md, docs/async.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ..fields import document_fields
from ..rewards.rlmt.arguments import RLMTArguments
from .ext_async_grpo_config import AsyncMethodConfig

__all__ = ["AsyncRLMTConfig"]


@document_fields
@dataclass
class AsyncRLMTConfig(RLMTArguments, AsyncMethodConfig):
    r"""
    Configuration for [`AsyncRLMTTrainer`]: every field of [`ExtAsyncGRPOConfig`] (TRL's asynchronous trainer and
    ``loss_type``/``ipo_*``), ``scale_rewards`` and ``reward_weights`` (`AsyncMethodConfig`) and the RLMT settings of
    `RLMTConfig` (`trl_ext.rewards.rlmt.arguments.RLMTArguments`: ``rlmt_format``, ``stop_strings``,
    ``reward_model_*``, ``strict_format``, ``malformed_*``, ``temperature`` 0.7), the same fields. `RLMTConfig`'s
    ``beta`` has no counterpart: TRL's asynchronous trainer has no reference model and no KL term.

    Sampling follows TRL's async settings (``max_completion_length``, ``temperature``, ``top_p``, ``top_k``,
    ``min_p``, ``repetition_penalty``) against ``vllm_server_base_url``; the stop strings go to the server as the
    sampling ``stop`` and every completion is also cut after the token completing its first stop string.
    """

    def __post_init__(self):
        self.check_rlmt_arguments()
        super().__post_init__()
