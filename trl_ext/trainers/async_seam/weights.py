"""Per-token loss weights through TRL's asynchronous batch: what carries the stepwise RLM's ``W(v)/n_v`` weights
(docs/stepwise_rlm.md) from a rollout sample to the loss.

TRL's `RolloutSample` and its collator carry one scalar ``advantage`` per sample and no weight. The one per-sample
value that reaches the collator untouched is the sample's ``metrics`` dict (``RolloutQueueDataset`` yields
``sample.metrics`` as is; the collator averages its keys into the logged metrics). So a weighted sample carries two
reserved keys there (`weighted_sample_metrics`):

- ``token weight`` ``W(v) / n_v``: the weight of each of its loss tokens;
- ``root share``: the part of one root rollout the sample stands for (a tree's samples share 1 between them).

The same road carries each sample's policy version (`VersionTaggedQueue` writes it into the metrics as it leaves the
buffer): `LossWeightCollator` adds ``sample_versions``, per loss token the version that sampled it, so the loss can
be watched by version lag (``ipo/masked_ratio/lag_<k>``).

`LossWeightCollator` (TRL's ``DataCollatorForRollout`` plus those keys) takes both out of the metrics before TRL logs
them and adds ``loss_weights``: per loss token, ``token weight × T / R`` with ``T`` the micro-batch's loss tokens
and ``R`` its root shares, all rows (`per_token_loss_weights`). TRL's normaliser divides a summed loss by
``T / ranks × accumulation steps`` and DDP averages the ranks, so a micro-batch's loss is
``Σ_t W(v)/n_v · ℓ_t / (R × accumulation steps)``: for whole trees, the mean over roots of ``L_subtree(root)``.
TRL's trainer builds its collator inside ``get_train_dataloader``; `loss_weight_collator` swaps the class in for that
call only. `fold_loss_weights` serves TRL's own PPO-clip loss, which takes no weights: ``w·A`` in place of ``A`` is
exact for it (``min(ρ·wA, clip(ρ)·wA) = w·min(ρA, clip(ρ)A)`` for ``w >= 0``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from trl.experimental.async_grpo import async_grpo_trainer

from ...losses import folded_advantages

__all__ = [
    "LOSS_WEIGHTS_KEY",
    "MODEL_VERSION_KEY",
    "ROOT_SHARE_KEY",
    "SAMPLE_VERSIONS_KEY",
    "TOKEN_WEIGHT_KEY",
    "LossWeightCollator",
    "VersionTaggedQueue",
    "fold_loss_weights",
    "loss_weight_collator",
    "per_token_loss_weights",
    "per_token_sample_values",
    "stale_token_mask",
    "weighted_sample_metrics",
    "without_tokens",
]

TOKEN_WEIGHT_KEY = "trl_ext/token_weight"  # W(v) / n_v of each loss token of the sample
ROOT_SHARE_KEY = "trl_ext/root_share"  # the part of its root rollout the sample stands for
MODEL_VERSION_KEY = "trl_ext/model_version"  # the policy version that sampled the sample (`VersionTaggedQueue`)
LOSS_WEIGHTS_KEY = "loss_weights"  # the collated batch's (ranks, M) per-token weights
SAMPLE_VERSIONS_KEY = "sample_versions"  # the collated batch's (ranks, M) per-token policy versions (-1: padding)


class VersionTaggedQueue:
    """The rollout buffer as TRL's ``RolloutQueueDataset`` reads it (``get``, ``qsize``), each sample leaving with its
    ``model_version`` copied into its ``metrics`` (`MODEL_VERSION_KEY`): the one per-sample value TRL passes on."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def get(self, *args: Any, **kwargs: Any) -> Any:
        sample = self.inner.get(*args, **kwargs)
        sample.metrics = {**(sample.metrics or {}), MODEL_VERSION_KEY: float(sample.model_version)}
        return sample

    def qsize(self) -> int:
        return self.inner.qsize()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def weighted_sample_metrics(metrics: Mapping[str, float], token_weight: float, root_share: float) -> dict[str, float]:
    """A rollout sample's ``metrics`` with its loss weight: ``token_weight`` (``W(v)/n_v``, >= 0) for each of its
    loss tokens and ``root_share`` (> 0) of one root rollout."""
    if not (math.isfinite(token_weight) and token_weight >= 0):
        raise ValueError(f"token_weight must be a finite number >= 0, got {token_weight}.")
    if not (math.isfinite(root_share) and root_share > 0):
        raise ValueError(f"root_share must be a finite number > 0, got {root_share}.")
    return {**metrics, TOKEN_WEIGHT_KEY: float(token_weight), ROOT_SHARE_KEY: float(root_share)}


def per_token_loss_weights(
    segment_id: Tensor, token_index: Tensor, token_weights: Sequence[Sequence[float]], num_roots: float
) -> Tensor:
    """The collated micro-batch's per-token loss weights ``token weight × T / R``.

    Args:
        segment_id: ``(P, M)`` the index of each loss token's sample in its row (TRL's collated ``segment_id``).
        token_index: ``(P, M)`` TRL's collated ``token_index``: ``-1`` marks padding.
        token_weights: ``token_weights[r][i]``: the token weight of sample ``i`` of row ``r``.
        num_roots: ``R``, the root shares of the micro-batch's samples, all rows (> 0).

    Returns:
        ``(P, M)`` float32 weights, 0 at padding; ``T`` is the number of loss tokens (non-padding entries).
    """
    if not num_roots > 0:
        raise ValueError(f"num_roots must be > 0, got {num_roots}.")
    num_tokens = float((token_index >= 0).sum())
    return per_token_sample_values(segment_id, token_index, token_weights, fill=0.0) * (num_tokens / num_roots)


def per_token_sample_values(
    segment_id: Tensor, token_index: Tensor, values: Sequence[Sequence[float]], fill: float
) -> Tensor:
    """Each loss token's sample's value: ``values[r][segment_id[r, t]]``, ``fill`` at padding.

    Args:
        segment_id: ``(P, M)`` the index of each loss token's sample in its row (TRL's collated ``segment_id``).
        token_index: ``(P, M)`` TRL's collated ``token_index``: ``-1`` marks padding.
        values: ``values[r][i]``: the value of sample ``i`` of row ``r`` (``P`` rows).

    Returns:
        ``(P, M)`` float32.
    """
    if segment_id.shape != token_index.shape or segment_id.dim() != 2 or len(values) != segment_id.shape[0]:
        raise ValueError(
            f"segment_id {tuple(segment_id.shape)} and token_index {tuple(token_index.shape)} must be (P, M) with P = "
            f"{len(values)} rows of sample values."
        )
    valid = token_index >= 0
    out = torch.full(segment_id.shape, float(fill), dtype=torch.float32)
    for row, row_values in enumerate(values):
        if not row_values:
            continue
        table = torch.tensor(list(row_values), dtype=torch.float32)
        out[row] = torch.where(valid[row], table[segment_id[row].clamp(0, len(table) - 1)], out[row])
    return out


class LossWeightCollator(async_grpo_trainer.DataCollatorForRollout):
    """TRL's ``DataCollatorForRollout``, plus ``loss_weights`` when the samples carry loss weights (module docstring).

    Samples without the reserved keys are collated exactly as TRL does; a micro-batch mixing weighted and unweighted
    samples is an error (a weight of the missing ones would be a guess).
    """

    def torch_call(self, examples: list[Any]) -> dict[str, Any]:
        (rows,) = examples
        samples = [sample for row in rows for sample in row.samples]
        for sample in samples:  # the policy version, out of the metrics before TRL logs them (once: idempotent)
            if MODEL_VERSION_KEY in sample["metrics"]:
                metrics = dict(sample["metrics"])
                sample["trl_ext_model_version"] = metrics.pop(MODEL_VERSION_KEY)
                sample["metrics"] = metrics
        batch = self._weighted_call(examples, rows, samples)
        if samples and all("trl_ext_model_version" in sample for sample in samples):
            versions = [[sample["trl_ext_model_version"] for sample in row.samples] for row in rows]
            batch[SAMPLE_VERSIONS_KEY] = per_token_sample_values(
                batch["segment_id"], batch["token_index"], versions, fill=-1.0
            )
        return batch

    def _weighted_call(self, examples: list[Any], rows: list[Any], samples: list[dict[str, Any]]) -> dict[str, Any]:
        weighted = [TOKEN_WEIGHT_KEY in sample["metrics"] or "trl_ext_token_weight" in sample for sample in samples]
        if not any(weighted):
            return super().torch_call(examples)
        if not all(weighted):
            raise ValueError(
                f"{weighted.count(False)} of {len(samples)} rollout samples of a micro-batch carry no loss weight: a "
                "rollout worker feeding a weighted trainer must give every sample one (weighted_sample_metrics)."
            )
        for sample in samples:  # out of the metrics before TRL logs them; once only (idempotent)
            if "trl_ext_token_weight" not in sample:
                metrics = dict(sample["metrics"])
                sample["trl_ext_token_weight"] = metrics.pop(TOKEN_WEIGHT_KEY)
                sample["trl_ext_root_share"] = metrics.pop(ROOT_SHARE_KEY)
                sample["metrics"] = metrics
        batch = super().torch_call(examples)
        token_weights = [[sample["trl_ext_token_weight"] for sample in row.samples] for row in rows]
        num_roots = sum(sample["trl_ext_root_share"] for sample in samples)
        batch[LOSS_WEIGHTS_KEY] = per_token_loss_weights(
            batch["segment_id"], batch["token_index"], token_weights, num_roots
        )
        return batch


@contextlib.contextmanager
def loss_weight_collator() -> Iterator[None]:
    """While open, TRL's ``get_train_dataloader`` builds a `LossWeightCollator` (it names ``DataCollatorForRollout``
    from its module); restored on exit."""
    original = async_grpo_trainer.DataCollatorForRollout
    if issubclass(original, LossWeightCollator):  # a method's collator (a subclass) is in place already
        yield
        return
    async_grpo_trainer.DataCollatorForRollout = LossWeightCollator
    try:
        yield
    finally:
        async_grpo_trainer.DataCollatorForRollout = original


def fold_loss_weights(inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """``inputs`` for TRL's PPO-clip loss, which takes no weights: ``advantages × loss_weights`` in place of the
    advantages (exact for weights >= 0, see the module docstring); ``inputs`` itself when it has no weights."""
    if LOSS_WEIGHTS_KEY not in inputs:
        return inputs
    folded = {key: value for key, value in inputs.items() if key != LOSS_WEIGHTS_KEY}
    folded["advantages"] = folded_advantages(inputs["advantages"], inputs[LOSS_WEIGHTS_KEY])
    return folded


def stale_token_mask(inputs: Mapping[str, Tensor], model_version: int, max_staleness: int) -> Tensor | None:
    """``(P, M)`` True at each loss token sampled more than ``max_staleness`` versions before ``model_version`` (the
    policy being trained); None when the batch carries no ``sample_versions``."""
    versions = inputs.get(SAMPLE_VERSIONS_KEY)
    if versions is None:
        return None
    return (inputs["token_index"] >= 0) & (model_version - versions.round() > max_staleness)


def without_tokens(inputs: dict[str, Tensor], drop: Tensor, dropped_total: float) -> dict[str, Tensor]:
    """``inputs`` with the loss tokens ``drop`` trained on by no loss: their weight 0 in ``loss_weights`` (all ones
    where the batch had none), and TRL's token count ``global_n_tokens`` less ``dropped_total`` (the dropped tokens of
    all ranks), so the normaliser counts the tokens trained.

    Every loss weighs a token's whole loss by its weight (TRL's PPO-clip through `fold_loss_weights`), so a weight 0
    removes the token exactly. A weighted batch's other weights (``token weight × T / R``) keep their scale: the
    micro-batch's loss is then divided by the fewer tokens, as if its roots had shrunk in proportion.

    Args:
        inputs: a collated micro-batch (``token_index``, ``global_n_tokens``, optionally ``loss_weights``).
        drop: ``(P, M)`` True at the loss tokens to drop.
        dropped_total: how many tokens ``drop`` marks on all ranks together.
    """
    selected = inputs["token_index"] >= 0
    weights = inputs.get(LOSS_WEIGHTS_KEY)
    if weights is None:
        weights = selected.to(torch.float32)
    out = dict(inputs)
    out[LOSS_WEIGHTS_KEY] = torch.where(drop, torch.zeros_like(weights), weights)
    out["global_n_tokens"] = (inputs["global_n_tokens"] - dropped_total).clamp(min=0)
    return out
