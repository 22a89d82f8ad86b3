"""A `trl_ext.samples.TrainingSample` as TRL's asynchronous `RolloutSample` (`to_rollout_sample`): the one conversion of
every method's samples, whose fields the seam checks at import (`check.ROLLOUT_SAMPLE_FIELDS`)."""

from __future__ import annotations

import numpy as np

from ...samples import TrainingSample
from .check import RolloutSample
from .credit import credited_sample_metrics
from .weights import weighted_sample_metrics

__all__ = ["to_rollout_sample"]


def to_rollout_sample(sample: TrainingSample, model_version: int, *, weighted: bool = False) -> RolloutSample:
    """A `TrainingSample` as TRL's `RolloutSample`, the one conversion of every asynchronous worker: ``input_ids`` =
    the ``P`` prompt ids + the ``C`` completion ids, ``(P + C,)``; the completion mask 1 over the completion only;
    p_old = the sampler's ``(C,)`` log-probs there (0 over the prompt). Its metrics carry the token credit (0 over the
    prompt; `credited_sample_metrics`) when it has one, and with ``weighted`` its "subtree" loss weight and root
    share (`weighted_sample_metrics`), which trl-ext's collators take out."""
    num_prompt, num_completion = len(sample.prompt_ids), len(sample.completion_ids)
    metrics = dict(sample.metrics)
    if sample.token_credit is not None:
        metrics = credited_sample_metrics(metrics, np.concatenate([np.zeros(num_prompt), sample.token_credit]))
    if weighted:
        if sample.token_weight is None or sample.root_share is None:
            raise ValueError(
                "A weighted sample needs its node's weight, token count and root share (node_weight, ...)."
            )
        metrics = weighted_sample_metrics(metrics, token_weight=sample.token_weight, root_share=sample.root_share)
    return RolloutSample(
        prompt=sample.prompt,
        completion=sample.completion,
        input_ids=np.asarray([*sample.prompt_ids, *sample.completion_ids], dtype=np.int64),
        completion_mask=np.asarray([0] * num_prompt + [1] * num_completion, dtype=np.int64),
        old_log_probs=np.asarray([0.0] * num_prompt + list(sample.logprobs), dtype=np.float32),
        advantage=float(sample.advantage),
        model_version=int(model_version),
        group_id=int(sample.group_id),
        metrics=metrics,
    )
