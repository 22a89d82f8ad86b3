"""`RLMTArguments`: the RLMT format and reward-model settings as trainer-config fields, declared and documented once
for the synchronous (`RLMTConfig`) and the asynchronous (`AsyncRLMTConfig`) trainer (docs/rlmt.md), and what both
trainers build from them: the dataset in the RLMT format (`rlmt_dataset`), the reward model's scorer
(`reward_model_scorer`), the refusal of a bare reward model (`refuse_bare_reward_models`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...fields import document_fields, documented
from .formats import (
    INSTRUCT_SYSTEM_PROMPT,
    ORIGINAL_PROMPT_COLUMN,
    RLMT_FORMATS,
    ZERO_STOP_STRING,
    rlmt_format_dataset,
)
from .scorers import RewardModelScorer

__all__ = ["RLMTArguments", "refuse_bare_reward_models"]

# RewardModelScorer's loading settings, each the config's reward_model_<name> field, and its format settings, each
# the config's field of the same name.
_SCORER_LOADING = ("device", "dtype", "batch_size", "max_length")
_SCORER_FORMAT_SETTINGS = ("malformed_reward", "malformed_margin", "starts_in_thinking")

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

    def rlmt_dataset(self, dataset: Any) -> Any:
        """``dataset`` with its prompts rewritten into the RLMT format (`rlmt_format_dataset`), the user's prompt kept
        in ``rlmt_original_prompt`` (what the reward model sees)."""
        return rlmt_format_dataset(
            dataset,
            self.rlmt_format,
            system_prompt=self.rlmt_system_prompt,
            original_prompt_column=ORIGINAL_PROMPT_COLUMN,
        )

    def reward_model_scorer(self, trainer_name: str) -> Any:
        """The `RewardModelScorer` of ``reward_model_name_or_path``, loaded with the ``reward_model_<name>`` settings
        and scoring in this format and strictness; a ValueError naming ``trainer_name`` and the fix without one."""
        if self.reward_model_name_or_path is None:
            raise ValueError(
                f"{trainer_name} has no reward: set {type(self).__name__}(reward_model_name_or_path=...) or pass "
                "reward_funcs (e.g. a RewardModelScorer or ServedRewardModelScorer)."
            )
        return RewardModelScorer(
            self.reward_model_name_or_path,
            format=self.rlmt_format,
            strict=self.strict_format,
            system_prompt=self.rlmt_system_prompt,
            **{name: getattr(self, name) for name in _SCORER_FORMAT_SETTINGS},
            **{name: getattr(self, f"reward_model_{name}") for name in _SCORER_LOADING},
        )


def refuse_bare_reward_models(reward_funcs: Any, trainer_name: str, rlmt_format: str) -> None:
    """A TypeError, with the fix, for a reward model (a Hub id or a module) among ``reward_funcs``: TRL would score the
    whole completion, plan included, where RLMT scores the response only."""
    for func in reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]:
        if isinstance(func, (str, torch.nn.Module)):
            raise TypeError(
                f"{trainer_name} does not take a reward model directly: it would score the whole completion, plan "
                f"included. Wrap it: reward_funcs=RewardModelScorer(model, tokenizer, format={rlmt_format!r})."
            )
