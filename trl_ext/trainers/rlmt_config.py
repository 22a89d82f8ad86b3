"""`RLMTConfig`: the RLMT format and the reward model, on top of `ExtGRPOConfig` (docs/rlmt.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..fields import document_fields, documented
from ..rewards.rlmt import INSTRUCT_SYSTEM_PROMPT, RLMT_FORMATS, ZERO_STOP_STRING
from .ext_grpo_config import ExtGRPOConfig


@document_fields
@dataclass
class RLMTConfig(ExtGRPOConfig):
    r"""
    Configuration for [`RLMTTrainer`]: every field of [`ExtGRPOConfig`] (and so of `trl.GRPOConfig`), the RLMT
    format and the reward model. Defaults follow the paper where it sets them (temperature 0.7, KL β 0.001, group
    size 8, learning rate 1e-6); its prompt/response lengths were 1024/4096 tokens (set ``max_completion_length``).
    """

    rlmt_format: str = documented(
        "instruct",
        "'instruct' (chat models: <think> plan </think> response) or 'zero' (base models: the prefix prompt, "
        "<think> … </think> <response> … </response>, stop string </response>).",
        section="Format",
    )
    apply_rlmt_format: bool = documented(
        True, "Rewrite the datasets' prompts into the RLMT format (turn off when they already are).", section="Format"
    )
    rlmt_system_prompt: str = documented(
        INSTRUCT_SYSTEM_PROMPT, "The planning instruction of the 'instruct' format.", section="Format"
    )
    stop_strings: list[str] | None = documented(
        None,
        "Completions end after the first of these; None = ['</response>'] for 'zero', none for 'instruct'.",
        section="Format",
    )
    starts_in_thinking: bool = documented(
        False,
        "The policy's chat template pre-fills <think> (TRL #6966): a completion with no tag at all is then an "
        "unfinished plan, not a response.",
        section="Format",
    )
    reward_model_name_or_path: str | None = documented(
        None,
        "A sequence-classification reward model (the paper: Skywork/Skywork-Reward-Llama-3.1-8B-v0.2).",
        section="Reward model (used when reward_funcs is not given)",
    )
    reward_model_device: str | None = documented(
        None,
        "Reward model device; None = this process's CUDA device, else CPU.",
        section="Reward model (used when reward_funcs is not given)",
    )
    reward_model_dtype: str | None = documented(
        None,
        "Reward model dtype, e.g. 'bfloat16'; None keeps the checkpoint's.",
        section="Reward model (used when reward_funcs is not given)",
    )
    reward_model_batch_size: int = documented(
        8, "Conversations per reward-model forward pass.", section="Reward model (used when reward_funcs is not given)"
    )
    reward_model_max_length: int | None = documented(
        None,
        "Longest reward-model input in tokens (the beginning is cut).",
        section="Reward model (used when reward_funcs is not given)",
    )
    strict_format: bool = documented(
        True,
        "Malformed completions get the lowest reward instead of a score.",
        section="Reward model (used when reward_funcs is not given)",
    )
    malformed_reward: float | None = documented(
        None,
        "Reward of a malformed completion; None = the batch's lowest score minus malformed_margin.",
        section="Reward model (used when reward_funcs is not given)",
    )
    malformed_margin: float = documented(
        1.0, "See malformed_reward.", section="Reward model (used when reward_funcs is not given)"
    )
    temperature: float = documented(
        0.7, "Sampling temperature (RLMT paper: 0.7).", section="Paper defaults overriding GRPOConfig's"
    )
    beta: float = documented(
        0.001, "KL coefficient (RLMT paper: 0.001).", section="Paper defaults overriding GRPOConfig's"
    )

    def __post_init__(self):
        check_rlmt_fields(self)
        super().__post_init__()  # parses dict fields given as JSON strings (generation_kwargs) among others
        if self.use_vllm and self.stop_strings:
            # vLLM stops sampling at the stop string; RLMTTrainer cuts every completion after it anyway.
            generation_kwargs = dict(self.generation_kwargs or {})
            generation_kwargs.setdefault("stop", list(self.stop_strings))
            self.generation_kwargs = generation_kwargs


def check_rlmt_fields(config: Any) -> None:
    """Validate the RLMT format and reward-model fields of `RLMTConfig` or `AsyncRLMTConfig`, and resolve
    ``stop_strings`` (None: ``['</response>']`` for "zero", none for "instruct"; a string: a list of one)."""
    if config.rlmt_format not in RLMT_FORMATS:
        raise ValueError(f"rlmt_format={config.rlmt_format!r}: use 'instruct' (chat models) or 'zero' (base models).")
    if config.reward_model_batch_size < 1:
        raise ValueError(f"reward_model_batch_size={config.reward_model_batch_size} must be >= 1.")
    if config.stop_strings is None:
        config.stop_strings = [ZERO_STOP_STRING] if config.rlmt_format == "zero" else []
    elif isinstance(config.stop_strings, str):
        config.stop_strings = [config.stop_strings]
