"""`RLMTArguments`: the RLMT format and reward-model settings as trainer-config fields, declared and documented once
for the synchronous (`RLMTConfig`) and the asynchronous (`AsyncRLMTConfig`) trainer (docs/rlmt.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ...fields import document_fields, documented
from .formats import INSTRUCT_SYSTEM_PROMPT, RLMT_FORMATS, ZERO_STOP_STRING

__all__ = ["RLMTArguments"]

_FORMAT = "Format"
_REWARD = "Reward model (used when reward_funcs is not given)"


@document_fields
@dataclass
class RLMTArguments:
    """The RLMT settings: the prompt format and its stop strings, the reward model, the paper's temperature."""

    rlmt_format: str = documented(
        "instruct",
        "'instruct' (chat models: <think> plan </think> response) or 'zero' (base models: the prefix prompt, "
        "<think> … </think> <response> … </response>, stop string </response>).",
        section=_FORMAT,
    )
    apply_rlmt_format: bool = documented(
        True, "Rewrite the datasets' prompts into the RLMT format (turn off when they already are).", section=_FORMAT
    )
    rlmt_system_prompt: str = documented(
        INSTRUCT_SYSTEM_PROMPT, "The planning instruction of the 'instruct' format.", section=_FORMAT
    )
    stop_strings: list[str] | None = documented(
        None,
        "Completions end after the first of these; None = ['</response>'] for 'zero', none for 'instruct'.",
        section=_FORMAT,
    )
    starts_in_thinking: bool = documented(
        False,
        "The policy's chat template pre-fills <think> (TRL #6966): a completion with no tag at all is then an "
        "unfinished plan, not a response.",
        section=_FORMAT,
    )
    reward_model_name_or_path: str | None = documented(
        None,
        "A sequence-classification reward model (the paper: Skywork/Skywork-Reward-Llama-3.1-8B-v0.2).",
        section=_REWARD,
    )
    reward_model_device: str | None = documented(
        None, "Reward model device; None = this process's CUDA device, else CPU.", section=_REWARD
    )
    reward_model_dtype: str | None = documented(
        None, "Reward model dtype, e.g. 'bfloat16'; None keeps the checkpoint's.", section=_REWARD
    )
    reward_model_batch_size: int = documented(8, "Conversations per reward-model forward pass.", section=_REWARD)
    reward_model_max_length: int | None = documented(
        None, "Longest reward-model input in tokens (the beginning is cut).", section=_REWARD
    )
    strict_format: bool = documented(
        True, "Malformed completions get the lowest reward instead of a score.", section=_REWARD
    )
    malformed_reward: float | None = documented(
        None,
        "Reward of a malformed completion; None = the batch's lowest score minus malformed_margin.",
        section=_REWARD,
    )
    malformed_margin: float = documented(1.0, "See malformed_reward.", section=_REWARD)
    temperature: float = documented(
        0.7, "Sampling temperature (RLMT paper: 0.7).", section="Paper defaults overriding TRL's"
    )

    def check_rlmt_arguments(self) -> None:
        """Validate the format and reward-model fields, and resolve ``stop_strings`` (None: ``['</response>']`` for
        "zero", none for "instruct"; a string: a list of one)."""
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
