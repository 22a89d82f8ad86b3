"""The scored batch: what `process_scored_batch` receives and returns (`ScoredBatch`), its checks and its padding.

Pure functions of the batch and of row counts: `check_scored_batch` (the invariants TRL's shuffle and split rely
on), `padding_rows` (how many rows to add so that every rank holds the same multiple of the micro-batch count),
`pad_batch` (adds them as zero-loss copies of real rows) and `loss_mask`.
"""

from __future__ import annotations

from typing import Any, TypedDict

import torch

__all__ = ["ZEROED_ON_PADDING", "ScoredBatch", "check_scored_batch", "loss_mask", "pad_batch", "padding_rows"]


class ScoredBatch(TypedDict, total=False):
    """This rank's scored generation batch of B rows (T completion tokens, P prompt tokens), as a dict.

    TRL builds it (rewards and group advantages are final, computed over all ranks); `process_scored_batch` may
    change it and return any number N of rows, where every value is an N-row tensor, a 0-dim tensor, a length-N list
    or None. Rows are then padded (zero loss) so that N is a multiple of ``steps_per_generation`` and equal on every
    rank, and ``num_items_in_batch`` is recomputed. Log-prob tensors must describe the rows they go with: recompute
    them when a row's prompt is not a token-exact prefix of the old one.

    Image fields come per row, as TRL's ``split_pixel_values_by_grid`` gives them: ``pixel_values`` (and
    ``image_grid_thw``, ``image_sizes``, ... where the model's layout is flat over images) is a length-B list of each
    row's tensor, ``num_images`` a length-B list; they are joined back after the padding, as TRL keeps them.
    """

    prompt_ids: torch.Tensor  # (B, P) left-padded (the first value: TRL reads the row count from it)
    prompt_mask: torch.Tensor  # (B, P)
    completion_ids: torch.Tensor  # (B, T) right-padded
    completion_mask: torch.Tensor  # (B, T)
    # (B,) group advantages, or (B, T) per-token ones aligned with completion_ids
    advantages: torch.Tensor
    # (B, T) >= 0, optional: multiplies each token's policy loss (folded into the advantages for TRL's loss types,
    # exact for their policy term, which is linear in the advantage; trl-ext's registered losses such as "ipo"
    # weight each token's whole loss, their tau penalty included; the beta*KL term stays unweighted)
    loss_weights: torch.Tensor
    rewards: torch.Tensor  # (B,) this rank's weighted total reward (added by trl-ext; NaN where unscorable)
    num_items_in_batch: torch.Tensor  # 0-dim: loss tokens over all ranks (recomputed after the hook)
    old_per_token_logps: torch.Tensor  # (B, T), optional
    ref_per_token_logps: torch.Tensor  # (B, T), optional
    sampling_per_token_logps: torch.Tensor  # (B, T), optional: the sampler's (vLLM's) log-probs
    importance_sampling_ratio: torch.Tensor  # (B, T) or (B, 1), optional
    tool_mask: torch.Tensor  # (B, T), optional: 0 on tool-output tokens (not trained)
    prefix_group: torch.Tensor  # (B,) integer: rows of one group share a prompt prefix (shared-prefix packing)
    is_padding_row: torch.Tensor  # (B,) bool: set by the padding


# Per-row values that must be zero on a padding row so that it carries no loss and no advantage.
ZEROED_ON_PADDING = ("completion_mask", "advantages", "loss_weights", "rewards")


def _is_shared(value: Any) -> bool:
    """A batch value that is not per row: None or a 0-dim tensor."""
    return value is None or (isinstance(value, torch.Tensor) and value.dim() == 0)


def check_scored_batch(batch: dict[str, Any]) -> int:
    """Check the invariants TRL's shuffle and split rely on (see `ScoredBatch`); return the row count N."""
    missing = [key for key in ("prompt_ids", "completion_ids", "advantages") if key not in batch]
    if missing:
        raise ValueError(
            f"The batch must keep {missing} (TRL's loss reads 'prompt_ids', 'completion_ids' and 'advantages')."
        )
    first_key, first = next((key, value) for key, value in batch.items() if value is not None)
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise ValueError(
            f"The first batch value that is not None ({first_key!r}) is not a row-indexed tensor; TRL reads the row "
            "count from it: put a row-indexed tensor (e.g. 'prompt_ids') first."
        )
    num_rows = batch["prompt_ids"].shape[0]
    for key, value in batch.items():
        if not _is_shared(value) and len(value) != num_rows:
            raise ValueError(
                f"batch[{key!r}] has {len(value)} rows but 'prompt_ids' has {num_rows}: every value must be an "
                "N-row tensor, a 0-dim tensor, a length-N list or None."
            )
    completion_shape = batch["completion_ids"].shape
    advantages = batch["advantages"]
    if advantages.shape not in ((num_rows,), completion_shape):
        raise ValueError(
            f"advantages must be (N,) or (N, T) = {tuple(completion_shape)} (aligned with completion_ids); got "
            f"{tuple(advantages.shape)}."
        )
    weights = batch.get("loss_weights")
    if weights is not None:
        if weights.shape != completion_shape:
            raise ValueError(
                f"loss_weights must be (N, T) = {tuple(completion_shape)} like completion_ids; got "
                f"{tuple(weights.shape)}."
            )
        if not torch.isfinite(weights).all() or (weights < 0).any():
            raise ValueError("loss_weights must be finite and >= 0 (a weight multiplies a token's policy loss).")
    return num_rows


def padding_rows(num_rows: int, max_rows: int, num_micro_batches: int) -> int:
    """How many rows a rank holding ``num_rows`` adds so that every rank holds the same multiple of
    ``num_micro_batches`` (TRL splits the batch into that many equal micro-batches and would drop the rest).

    Args:
        num_rows: this rank's rows.
        max_rows: the most rows any rank holds.
        num_micro_batches: ``steps_per_generation`` in training, 1 in evaluation.
    """
    target = -(-max_rows // num_micro_batches) * num_micro_batches  # max_rows rounded up to a multiple
    if target > num_rows and num_rows == 0:
        raise ValueError(
            "process_scored_batch returned 0 rows on this rank: return at least one row (rows are padded by copying "
            "real rows with their loss masked)."
        )
    return target - num_rows


def pad_batch(batch: dict[str, Any], num_rows: int, num_padding: int) -> dict[str, Any]:
    """Append ``num_padding`` copies of the ``num_rows`` real rows (cyclically) with their loss masked out.

    Copies of real rows, not blank rows: a row whose attention mask is all zeros gives NaN log-probs, and
    NaN × 0 is NaN in the loss sum. The values of `ZEROED_ON_PADDING` are zero on the copies.
    """
    source = torch.arange(num_padding) % num_rows
    padded: dict[str, Any] = {}
    for key, value in batch.items():
        if _is_shared(value):
            padded[key] = value
        elif isinstance(value, torch.Tensor):
            extra = value[source.to(value.device)].clone()
            if key in ZEROED_ON_PADDING:
                extra.zero_()
            padded[key] = torch.cat([value, extra])
        else:
            padded[key] = list(value) + [value[i] for i in source.tolist()]
    return padded


def loss_mask(batch: dict[str, Any]) -> torch.Tensor:
    """``(B, T)`` the tokens the loss counts: ``completion_mask``, times ``tool_mask`` where there is one."""
    mask = batch["completion_mask"]
    return mask if batch.get("tool_mask") is None else mask * batch["tool_mask"]
