"""Pure steps from one group's sampled completions to TRL's asynchronous training samples (docs/rlmt.md).

- `cut_at_stop`: a completion cut after the token that completes its first stop string, with its log-probs;
- `scored_advantages`: the group advantage of rewards where some completions could not be scored (NaN);
- `completion_sample`: one `RolloutSample` (prompt ids + completion ids, the completion mask, p_old).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ...rewards.rlmt import stop_token_cut
from ..async_rlm.samples import group_advantages
from ..async_seam import RolloutSample
from ..async_worker import rollout_sample

__all__ = ["completion_sample", "cut_at_stop", "scored_advantages"]


def cut_at_stop(
    token_ids: Sequence[int], logprobs: Sequence[float], tokenizer: Any, stop_strings: Sequence[str]
) -> tuple[list[int], list[float], bool]:
    """A completion ending with the token that completes its first stop string (`stop_token_cut`).

    Args:
        token_ids: ``(C,)`` the sampled completion.
        logprobs: ``(C,)`` the sampler's log-prob of each token.
        tokenizer: decodes the completion to find the stop strings.
        stop_strings: e.g. ``["</response>"]``; none: nothing is cut.

    Returns:
        ``(ids, logprobs, cut)``: the first ``K <= C`` tokens and their log-probs, and whether ``K < C`` (tokens were
        sampled past the stop: they are neither scored nor trained).
    """
    if len(token_ids) != len(logprobs):
        raise ValueError(
            f"{len(token_ids)} completion tokens but {len(logprobs)} log-probs: the sampler must return one log-prob "
            "per sampled token."
        )
    keep = stop_token_cut(token_ids, tokenizer, stop_strings) if stop_strings else None
    if keep is None or keep >= len(token_ids):
        return list(token_ids), [float(value) for value in logprobs], False
    return list(token_ids[:keep]), [float(value) for value in logprobs[:keep]], True


def scored_advantages(rewards: Sequence[float], scale_rewards: str = "group") -> list[float]:
    """The group advantage of ``G`` rewards, NaN marking a completion no reward function could score.

    Args:
        rewards: ``(G,)`` summed rewards, NaN where every reward function returned None.
        scale_rewards: ``"group"`` or ``"none"`` (`trl_ext.trainers.async_rlm.group_advantages`, GRPOTrainer's).

    Returns:
        ``(G,)`` advantages: those of the scored completions computed among themselves, 0 for the unscored ones
        (they teach nothing, as in TRL's asynchronous worker).
    """
    scored = [index for index, reward in enumerate(rewards) if not math.isnan(reward)]
    advantages = [0.0] * len(rewards)
    if scored:
        for index, value in zip(scored, group_advantages([rewards[i] for i in scored], scale_rewards), strict=True):
            advantages[index] = value
    return advantages


def completion_sample(
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    logprobs: Sequence[float],
    *,
    advantage: float,
    model_version: int,
    group_id: int,
    metrics: Mapping[str, float],
    prompt: Any = None,
    completion: Any = None,
) -> RolloutSample:
    """One `RolloutSample`: ``input_ids`` = the ``P`` prompt ids + the ``C`` completion ids, ``(P + C,)``; the
    completion mask 1 over the completion only; p_old = the sampler's log-probs there (0 over the prompt)."""
    if not prompt_ids:
        raise ValueError("A completion sample needs its prompt ids (the policy's context).")
    if len(completion_ids) != len(logprobs):
        raise ValueError(f"{len(completion_ids)} completion tokens but {len(logprobs)} log-probs.")
    return rollout_sample(
        prompt_ids,
        completion_ids,
        logprobs,
        advantage=advantage,
        model_version=model_version,
        group_id=group_id,
        metrics=metrics,
        prompt=prompt,
        completion=completion,
    )
