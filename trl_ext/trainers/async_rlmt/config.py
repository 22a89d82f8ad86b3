"""`AsyncRLMTConfig`: `ExtAsyncGRPOConfig` plus the RLMT format and reward-model fields of `RLMTConfig`, under the
same names and with the same meaning (docs/rlmt.md, docs/async.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ...fields import document_fields, mirror_field
from ..ext_async_grpo_config import ExtAsyncGRPOConfig
from ..rlmt_config import RLMTConfig, check_rlmt_fields

__all__ = ["AsyncRLMTConfig", "RLMT_FIELDS"]

# The RLMTConfig fields AsyncRLMTConfig takes, same name, same meaning. RLMTConfig's ``beta`` has no counterpart:
# TRL's asynchronous trainer has no reference model and no KL term.
RLMT_FIELDS = (
    "rlmt_format",
    "apply_rlmt_format",
    "rlmt_system_prompt",
    "stop_strings",
    "starts_in_thinking",
    "reward_model_name_or_path",
    "reward_model_device",
    "reward_model_dtype",
    "reward_model_batch_size",
    "reward_model_max_length",
    "strict_format",
    "malformed_reward",
    "malformed_margin",
    "temperature",
    "scale_rewards",
)
_FORMAT = "Format"
_REWARD = "Reward model (used when reward_funcs is not given)"


def _rlmt(name: str, section: str, **options):
    return mirror_field(RLMTConfig, name, "RLMT", section=section, **options)


@document_fields
@dataclass
class AsyncRLMTConfig(ExtAsyncGRPOConfig):
    r"""
    Configuration for [`AsyncRLMTTrainer`]: every field of [`ExtAsyncGRPOConfig`] (TRL's asynchronous trainer and
    ``loss_type``/``ipo_*``) and the RLMT fields of `RLMTConfig` (``rlmt_format``, ``stop_strings``,
    ``reward_model_*``, ``strict_format``, ``malformed_*``, ``temperature`` 0.7, ``scale_rewards``), same names, same
    meaning.

    Sampling follows TRL's async settings (``max_completion_length``, ``temperature``, ``top_p``, ``top_k``,
    ``min_p``, ``repetition_penalty``) against ``vllm_server_base_url``; the stop strings go to the server as the
    sampling ``stop`` and every completion is also cut after the token completing its first stop string.
    """

    rlmt_format: str = _rlmt("rlmt_format", _FORMAT)
    apply_rlmt_format: bool = _rlmt("apply_rlmt_format", _FORMAT)
    rlmt_system_prompt: str = _rlmt("rlmt_system_prompt", _FORMAT)
    stop_strings: list[str] | None = _rlmt("stop_strings", _FORMAT)
    starts_in_thinking: bool = _rlmt("starts_in_thinking", _FORMAT)
    reward_model_name_or_path: str | None = _rlmt("reward_model_name_or_path", _REWARD)
    reward_model_device: str | None = _rlmt("reward_model_device", _REWARD)
    reward_model_dtype: str | None = _rlmt("reward_model_dtype", _REWARD)
    reward_model_batch_size: int = _rlmt("reward_model_batch_size", _REWARD)
    reward_model_max_length: int | None = _rlmt("reward_model_max_length", _REWARD)
    strict_format: bool = _rlmt("strict_format", _REWARD)
    malformed_reward: float | None = _rlmt("malformed_reward", _REWARD)
    malformed_margin: float = _rlmt("malformed_margin", _REWARD)
    temperature: float = _rlmt("temperature", "Paper defaults overriding AsyncGRPOConfig's")
    scale_rewards: str = _rlmt(
        "scale_rewards",
        "Group advantage",
        note="The rollout worker scores one group at a time, so 'batch' is not available here.",
    )

    def __post_init__(self):
        check_rlmt_fields(self)
        if isinstance(self.scale_rewards, bool):  # GRPOConfig's spellings: True = 'group', False = 'none'
            self.scale_rewards = "group" if self.scale_rewards else "none"
        if self.scale_rewards not in ("group", "none"):
            raise ValueError(
                f"scale_rewards={self.scale_rewards!r}: the asynchronous rollout worker scores one group at a time; "
                "set 'group' (divide by the group's std) or 'none' (Dr. GRPO)."
            )
        super().__post_init__()
