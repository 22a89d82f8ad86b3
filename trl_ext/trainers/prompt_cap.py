"""The prompt cap: how many prompt tokens a trainer keeps (`prompt_cap`) and the cut itself (`cap_prompt_ids`).

TRL 1.16 has no prompt cap; `ExtGRPOTrainer.limit_prompt_ids` applies these to the tokenized prompts before
generation and logs ``prompts/truncated_ratio``.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["cap_prompt_ids", "prompt_cap"]


def prompt_cap(max_prompt_length: int | None, model: Any, args: Any) -> int | None:
    """The prompt cap in tokens: ``max_prompt_length``, else the model's positions minus ``max_completion_length``.

    None when neither is known. An explicit cap that, with the completion, overflows the model's positions is kept
    but warned about (the model may extrapolate, e.g. with RoPE scaling; usually it is a mistake).
    """
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config  # vision-language models keep positions there
    positions = getattr(config, "max_position_embeddings", None)
    completion = getattr(args, "max_completion_length", None) or 0
    if max_prompt_length is None:
        if not positions:
            return None
        if positions <= completion:
            raise ValueError(
                f"max_completion_length={completion} leaves no room for a prompt in the model's {positions} positions: "
                "lower max_completion_length."
            )
        return positions - completion
    if positions and max_prompt_length + completion > positions:
        logger.warning(
            "max_prompt_length=%d + max_completion_length=%d is more than the model's %d positions.",
            max_prompt_length,
            completion,
            positions,
        )
    return max_prompt_length


def cap_prompt_ids(prompt_ids: list[list[int]], cap: int) -> tuple[list[list[int]], list[int]]:
    """``(capped, long)``: each prompt cut from the left to its last ``cap`` ids (``cap >= 1``), and the indices of
    those cut."""
    if cap < 1:
        raise ValueError(f"A prompt cap of {cap} tokens would leave no prompt: the cap must be >= 1.")
    long = [index for index, ids in enumerate(prompt_ids) if len(ids) > cap]
    return [ids[-cap:] if len(ids) > cap else ids for ids in prompt_ids], long
