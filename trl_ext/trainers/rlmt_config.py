"""`RLMTConfig`: the RLMT format and the reward model, on top of `ExtGRPOConfig` (docs/rlmt.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..rewards.rlmt import INSTRUCT_SYSTEM_PROMPT, RLMT_FORMATS, ZERO_STOP_STRING
from .ext_grpo_config import ExtGRPOConfig


@dataclass
class RLMTConfig(ExtGRPOConfig):
    r"""
    Configuration for [`RLMTTrainer`]: every field of [`ExtGRPOConfig`] (and so of `trl.GRPOConfig`), the RLMT
    format and the reward model. Defaults follow the paper where it sets them (temperature 0.7, KL β 0.001, group
    size 8, learning rate 1e-6); its prompt/response lengths were 1024/4096 tokens (set ``max_completion_length``).

    Parameters:
        > Format

        rlmt_format (`str`, *optional*, defaults to `"instruct"`):
            `"instruct"` (chat models: `<think> plan </think> response`) or `"zero"` (base models: the prefix prompt,
            `<think> … </think> <response> … </response>`, stop string `</response>`).
        apply_rlmt_format (`bool`, *optional*, defaults to `True`):
            Rewrite the datasets' prompts into the format (turn off when they already are).
        rlmt_system_prompt (`str`, *optional*, defaults to `INSTRUCT_SYSTEM_PROMPT`):
            The planning instruction of the `"instruct"` format.
        stop_strings (`list[str]` or `None`, *optional*, defaults to `None`):
            Completions end after the first of these; `None` = `["</response>"]` for `"zero"`, none for
            `"instruct"`.
        starts_in_thinking (`bool`, *optional*, defaults to `False`):
            The policy's chat template pre-fills `<think>` (TRL #6966): a completion with no tag at all is then an
            unfinished plan, not a response.

        > Reward model (used when `reward_funcs` is not given)

        reward_model_name_or_path (`str` or `None`, *optional*, defaults to `None`):
            A sequence-classification reward model (the paper: `Skywork/Skywork-Reward-Llama-3.1-8B-v0.2`).
        reward_model_device (`str` or `None`, *optional*, defaults to `None`):
            Its device; `None` = this process's CUDA device, else CPU.
        reward_model_dtype (`str` or `None`, *optional*, defaults to `None`):
            Its dtype, e.g. `"bfloat16"`; `None` keeps the checkpoint's.
        reward_model_batch_size (`int`, *optional*, defaults to `8`):
            Conversations per reward-model forward pass.
        reward_model_max_length (`int` or `None`, *optional*, defaults to `None`):
            Longest reward-model input in tokens (the beginning is cut).
        strict_format (`bool`, *optional*, defaults to `True`):
            Malformed completions get the lowest reward instead of a score.
        malformed_reward (`float` or `None`, *optional*, defaults to `None`):
            That lowest reward; `None` = the batch's lowest score minus `malformed_margin`.
        malformed_margin (`float`, *optional*, defaults to `1.0`):
            See `malformed_reward`.
    """

    rlmt_format: str = field(
        default="instruct",
        metadata={
            "help": "'instruct' (chat models, <think> … </think> response) or 'zero' (base models, prefix prompt)."
        },
    )
    apply_rlmt_format: bool = field(
        default=True, metadata={"help": "Rewrite the datasets' prompts into the RLMT format."}
    )
    rlmt_system_prompt: str = field(
        default=INSTRUCT_SYSTEM_PROMPT, metadata={"help": "The planning instruction of the 'instruct' format."}
    )
    stop_strings: list[str] | None = field(
        default=None,
        metadata={"help": "Completions end after the first of these; None = ['</response>'] for 'zero', else none."},
    )
    starts_in_thinking: bool = field(
        default=False,
        metadata={"help": "The policy's chat template pre-fills <think> (TRL #6966); a tagless completion is a plan."},
    )
    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Sequence-classification reward model used when reward_funcs is not given."},
    )
    reward_model_device: str | None = field(
        default=None, metadata={"help": "Reward model device; None = this process's CUDA device, else CPU."}
    )
    reward_model_dtype: str | None = field(
        default=None, metadata={"help": "Reward model dtype, e.g. 'bfloat16'; None keeps the checkpoint's."}
    )
    reward_model_batch_size: int = field(default=8, metadata={"help": "Conversations per reward-model forward."})
    reward_model_max_length: int | None = field(
        default=None, metadata={"help": "Longest reward-model input in tokens (the beginning is cut)."}
    )
    strict_format: bool = field(
        default=True, metadata={"help": "Malformed completions get the lowest reward instead of a score."}
    )
    malformed_reward: float | None = field(
        default=None,
        metadata={"help": "Reward of a malformed completion; None = batch's lowest score minus malformed_margin."},
    )
    malformed_margin: float = field(default=1.0, metadata={"help": "See malformed_reward."})

    # Paper defaults (docs/rlmt.md) overriding GRPOConfig's.
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature (RLMT paper: 0.7)."})
    beta: float = field(default=0.001, metadata={"help": "KL coefficient (RLMT paper: 0.001)."})

    def __post_init__(self):
        if self.rlmt_format not in RLMT_FORMATS:
            raise ValueError(
                f"rlmt_format={self.rlmt_format!r}: use 'instruct' (chat models) or 'zero' (base models)."
            )
        if self.reward_model_batch_size < 1:
            raise ValueError(f"reward_model_batch_size={self.reward_model_batch_size} must be >= 1.")
        if self.stop_strings is None:
            self.stop_strings = [ZERO_STOP_STRING] if self.rlmt_format == "zero" else []
        elif isinstance(self.stop_strings, str):
            self.stop_strings = [self.stop_strings]
        super().__post_init__()  # parses dict fields given as JSON strings (generation_kwargs) among others
        if self.use_vllm and self.stop_strings:
            # vLLM stops sampling at the stop string; RLMTTrainer cuts every completion after it anyway.
            generation_kwargs = dict(self.generation_kwargs or {})
            generation_kwargs.setdefault("stop", list(self.stop_strings))
            self.generation_kwargs = generation_kwargs
