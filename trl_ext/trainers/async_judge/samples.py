"""Pure functions from one judged rollout to TRL's asynchronous training sample (docs/judge_credit.md).

A rollout is a prompt's token ids, its sampled completion (token ids and the sampler's log-probs), the group advantage
``A`` of its reward, and the judge's verdict. `trl_ext.judge.credit.rollout_credit` turns the verdict's spans into the
capped per-token credit ``cap_λ(c)`` (`trl_ext.judge.credit`: `span_credit`, then `cap_credit` over the tokens the
judge read); `judged_sample` builds the `RolloutSample` whose advantage is ``A`` and whose metrics carry ``cap_λ(c)``
over its ``input_ids`` (`trl_ext.trainers.async_seam.credited_sample_metrics`), so the loss sees ``A_t = A +
cap_λ(c)_t``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..async_seam import RolloutSample, credited_sample_metrics
from ..async_worker import rollout_sample

__all__ = ["judged_sample"]


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
