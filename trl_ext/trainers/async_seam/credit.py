"""Per-token advantages through TRL's asynchronous batch: what carries the judge's token credit
(docs/judge_credit.md) from a rollout sample to the loss, as ``A_t = A + c_t``.

TRL's `RolloutSample` carries one scalar ``advantage``; its packer (`packing.TreeRow.pack`) repeats it over the
sample's loss terms, so the collated ``advantages`` are already per token, ``(P, M)``. What a per-token term needs is
a way in: as for the loss weights (`weights`), the sample's ``metrics`` dict, the one per-sample value that reaches
the collator untouched. A credited sample carries one reserved key there (`credited_sample_metrics`):

- ``token credit``: ``c``, one value per position of the sample's ``input_ids`` (0 over the prompt), like
  ``old_log_probs``.

`TokenCreditCollator` (`LossWeightCollator`, so TRL's collator plus ``loss_weights``, plus this) takes it out of the
metrics before TRL logs them and adds it to TRL's collated advantages, loss term by loss term (`per_token_credit`):
TRL's packer emits a row's loss terms sample by sample, each sample's in the order of its positions ``p >= 1`` with
``completion_mask[p] = 1`` (the token at ``p``, predicted from ``p - 1``). Every loss then sees ``A + c_t``: TRL's
PPO-clip (``"dapo"``) and trl-ext's losses read the same ``advantages``. A sample without the key gets ``c = 0``
(plain outcome advantage). TRL's trainer builds its collator inside ``get_train_dataloader``; `token_credit_collator`
swaps the class in for that call only.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from trl.experimental.async_grpo import async_grpo_trainer

from .weights import LossWeightCollator

__all__ = [
    "TOKEN_CREDIT_KEY",
    "TokenCreditCollator",
    "credited_sample_metrics",
    "per_token_credit",
    "token_credit_collator",
]

TOKEN_CREDIT_KEY = "trl_ext/token_credit"  # c over the sample's input_ids positions (0 over the prompt)
_TAKEN = "trl_ext_token_credit"  # where the collator keeps it once out of the metrics


def credited_sample_metrics(metrics: Mapping[str, Any], credit: Sequence[float] | np.ndarray) -> dict[str, Any]:
    """A rollout sample's ``metrics`` with its token credit ``credit``: ``(P + C,)`` finite values, one per position
    of the sample's ``input_ids`` (0 over the prompt)."""
    values = tuple(float(value) for value in np.asarray(credit, dtype=np.float64).reshape(-1))
    if not all(math.isfinite(value) for value in values):
        raise ValueError("token credit must be finite numbers (one per input_ids position, 0 over the prompt).")
    return {**metrics, TOKEN_CREDIT_KEY: values}


def per_token_credit(
    segment_id: Tensor,
    token_index: Tensor,
    completion_masks: Sequence[Sequence[Any]],
    credits: Sequence[Sequence[Any]],
) -> Tensor:
    """The collated micro-batch's per-loss-term credit, to add to TRL's ``advantages``.

    Args:
        segment_id: ``(P, M)`` the index of each loss term's sample in its row (TRL's collated ``segment_id``).
        token_index: ``(P, M)`` TRL's collated ``token_index``: ``-1`` marks padding.
        completion_masks: ``completion_masks[r][i]``: the ``(L,)`` completion mask of sample ``i`` of row ``r``.
        credits: ``credits[r][i]``: its ``(L,)`` credit per ``input_ids`` position, or None for no credit (zeros).

    Returns:
        ``(P, M)`` float32: per loss term of sample ``i``, ``credit[p]`` for the positions ``p >= 1`` with
        ``completion_mask[p] = 1``, in order (TRL's packing order); 0 at padding.
    """
    if segment_id.shape != token_index.shape or segment_id.dim() != 2 or len(credits) != segment_id.shape[0]:
        raise ValueError(
            f"segment_id {tuple(segment_id.shape)} and token_index {tuple(token_index.shape)} must be (P, M) with P = "
            f"{len(credits)} rows of credits."
        )
    out = torch.zeros(segment_id.shape, dtype=torch.float32)
    for row, (row_masks, row_credits) in enumerate(zip(completion_masks, credits, strict=True)):
        terms = []
        for sample, (mask, credit) in enumerate(zip(row_masks, row_credits, strict=True)):
            mask = np.asarray(mask).reshape(-1)
            positions = np.flatnonzero(mask[1:]) + 1  # TRL trains position p (from p - 1) for p >= 1
            if credit is None:
                terms.append(np.zeros(len(positions)))
                continue
            credit = np.asarray(credit, dtype=np.float64).reshape(-1)
            if credit.shape != mask.shape:
                raise ValueError(
                    f"row {row} sample {sample}: {credit.size} credit values for {mask.size} input_ids positions; "
                    "give one per position (0 over the prompt), as credited_sample_metrics documents."
                )
            terms.append(credit[positions])
        values = np.concatenate(terms) if terms else np.zeros(0)
        valid = token_index[row] >= 0
        expected = torch.bincount(segment_id[row][valid], minlength=len(terms)).tolist()
        if int(valid.sum()) != len(values) or expected != [len(term) for term in terms]:
            raise ValueError(
                f"row {row}: TRL's batch has {expected} loss terms per sample, the completion masks give "
                f"{[len(term) for term in terms]}; the packing differs from what trl-ext expects (check_trl_async)."
            )
        out[row, : len(values)] = torch.as_tensor(values, dtype=torch.float32)
    return out


class TokenCreditCollator(LossWeightCollator):
    """`LossWeightCollator` (TRL's ``DataCollatorForRollout``, plus ``loss_weights``), its ``advantages`` plus the
    samples' token credit when any sample carries one (module docstring); otherwise exactly the parent's batch."""

    def torch_call(self, examples: list[Any]) -> dict[str, Any]:
        (rows,) = examples
        samples = [sample for row in rows for sample in row.samples]
        if not any(TOKEN_CREDIT_KEY in sample["metrics"] or _TAKEN in sample for sample in samples):
            return super().torch_call(examples)
        for sample in samples:  # out of the metrics before TRL logs them; once only (idempotent)
            if _TAKEN not in sample:
                metrics = dict(sample["metrics"])
                sample[_TAKEN] = metrics.pop(TOKEN_CREDIT_KEY, None)
                sample["metrics"] = metrics
        batch = super().torch_call(examples)
        credit = per_token_credit(
            batch["segment_id"],
            batch["token_index"],
            [[sample["completion_mask"] for sample in row.samples] for row in rows],
            [[sample[_TAKEN] for sample in row.samples] for row in rows],
        )
        batch["advantages"] = batch["advantages"] + credit.to(batch["advantages"].dtype)
        return batch


@contextlib.contextmanager
def token_credit_collator() -> Iterator[None]:
    """While open, TRL's ``get_train_dataloader`` builds a `TokenCreditCollator` (it names
    ``DataCollatorForRollout`` from its module); restored on exit."""
    original = async_grpo_trainer.DataCollatorForRollout
    async_grpo_trainer.DataCollatorForRollout = TokenCreditCollator
    try:
        yield
    finally:
        async_grpo_trainer.DataCollatorForRollout = original
