"""Pure functions from one judged rollout to TRL's asynchronous training sample (docs/judge_credit.md).

A rollout is a prompt's token ids, its sampled completion (token ids and the sampler's log-probs), the group
advantage ``A`` of its reward, and the judge's verdict. `rollout_credit` turns the verdict's spans into the capped
per-token credit ``cap_λ(c)`` (`trl_ext.judge.credit`: `span_credit`, then `cap_credit` over the tokens the judge
read); `judged_sample` builds the `RolloutSample` whose advantage is ``A`` and whose metrics carry ``cap_λ(c)`` over
its ``input_ids`` (`trl_ext.trainers.async_seam.credited_sample_metrics`), so the loss sees ``A_t = A + cap_λ(c)_t``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ...judge.credit import SpanLike, cap_credit, span_credit
from ..async_seam import RolloutSample, credited_sample_metrics
from ..async_worker import rollout_sample

__all__ = ["judged_sample", "rollout_credit"]


def rollout_credit(
    spans: Iterable[SpanLike],
    num_tokens: int,
    judged_tokens: int,
    label_scores: Mapping[str, float],
    lam: float,
) -> np.ndarray:
    """``cap_λ(c)`` of one rollout: its spans' credit (`span_credit`), capped by λ (`cap_credit`).

    Args:
        spans: the judge's validated spans (token indices into the completion); none for a failed verdict.
        num_tokens: ``C``, the completion's sampled tokens (a trailing EOS included).
        judged_tokens: the first tokens the judge read (the completion without its trailing EOS / pad); the cap's
            mean ``|c|`` runs over them, and the tokens after them get no credit.
        label_scores: label -> score.
        lam: λ >= 0.

    Returns:
        ``(C,)`` float32 credit; zeros when there are no spans.
    """
    if not 0 <= judged_tokens <= num_tokens:
        raise ValueError(f"judged_tokens={judged_tokens} must be in [0, num_tokens={num_tokens}].")
    credit = span_credit(spans, num_tokens, label_scores).unsqueeze(0)
    judged = torch.zeros_like(credit)
    judged[0, :judged_tokens] = 1.0
    return cap_credit(credit, judged, lam)[0].numpy()


def judged_sample(
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    logprobs: Sequence[float],
    *,
    advantage: float,
    credit: Sequence[float] | np.ndarray,
    model_version: int,
    group_id: int,
    metrics: Mapping[str, float],
    prompt: Any = None,
    completion: Any = None,
) -> RolloutSample:
    """The `RolloutSample` of one judged rollout: ``(P + C,)`` input ids, completion mask and log-probs (0 over the
    prompt), the outcome advantage ``A`` and, in its metrics, the ``(C,)`` credit padded with 0 over the prompt."""
    num_prompt, num_completion = len(prompt_ids), len(completion_ids)
    if not num_prompt:
        raise ValueError("A rollout needs its prompt ids: TRL trains a token from the one before it.")
    if len(logprobs) != num_completion or len(credit) != num_completion:
        raise ValueError(
            f"{num_completion} completion tokens, {len(logprobs)} log-probs and {len(credit)} credit values: give one "
            "of each per sampled token."
        )
    return rollout_sample(
        prompt_ids,
        completion_ids,
        logprobs,
        advantage=advantage,
        model_version=model_version,
        group_id=group_id,
        metrics=credited_sample_metrics(metrics, np.concatenate([np.zeros(num_prompt), np.asarray(credit)])),
        prompt=prompt,
        completion=completion,
    )
