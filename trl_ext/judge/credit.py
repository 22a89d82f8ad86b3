"""Token credit from judge spans, and the per-rollout λ cap (docs/judge_credit.md).

Source: "Dear diary, I judged rollouts: how your RL judge affects your model's reasoning" (blog, 2026). A judge marks
token spans with labels; each label has a score; a token's credit is ``score × confidence`` summed over the spans
covering it and clipped to [-1, 1]. The per-token advantage is ``A_t = A + c_t`` with ``A`` the Dr. GRPO outcome
advantage. So that the judge *nudges* rather than overrides the verifier, each rollout's credit is scaled down when
its mean ``|c_t|`` over completion tokens exceeds λ (λ = 0.25 ≈ 6 % of total advantage mass in the source).

Pure functions of tensors; metrics are returned, not logged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import torch
from torch import Tensor

# Label -> score. `verified_correction = +1.00` is the source's; the others are trl-ext defaults (docs/judge_credit.md).
DEFAULT_LABEL_SCORES: dict[str, float] = {
    "verified_correction": 1.00,
    "key_progress": 0.50,
    "original_error": -1.00,
    "dependent_error": -0.50,
    "wasteful_loop": -0.25,
}


class SpanLike(Protocol):
    start: int
    end: int
    label: str
    confidence: float


def span_credit(spans: Iterable[SpanLike], length: int, label_scores: Mapping[str, float]) -> Tensor:
    """Per-token credit of one rollout: ``c_t = clip(Σ_{spans ∋ t} score(label) × confidence, -1, 1)``.

    Args:
        spans: validated spans (`trl_ext.judge.spans.Span` or anything with ``start``, ``end`` (exclusive),
            ``label``, ``confidence``); tokens no span covers get 0.
        length: number of token positions T of the output (e.g. the padded completion length).
        label_scores: label -> score table.

    Returns:
        Float tensor of shape (T,), values in [-1, 1].
    """
    if length < 0:
        raise ValueError(f"length={length} must be >= 0 (the number of completion positions).")
    credit = torch.zeros(length, dtype=torch.float32)
    for span in spans:
        if not 0 <= span.start < span.end <= length:
            raise ValueError(
                f"Span [{span.start}, {span.end}) is not inside [0, {length}); validate spans with "
                "`trl_ext.judge.validate_spans` before computing credit."
            )
        if span.label not in label_scores:
            raise ValueError(f"Span label {span.label!r} is not in label_scores {sorted(label_scores)}; add it there.")
        credit[span.start : span.end] += float(label_scores[span.label]) * float(span.confidence)
    return credit.clamp_(-1.0, 1.0)


def cap_credit(credit: Tensor, mask: Tensor, lam: float) -> Tensor:
    """Per-rollout λ cap: rows whose mean ``|c|`` over mask tokens exceeds ``lam`` are scaled by ``lam / mean|c|``.

    Rows at or below ``lam`` are unchanged; signs are kept; tokens outside the mask are set to 0. A row with no mask
    tokens is all zeros.

    Args:
        credit: (B, T) token credit.
        mask: (B, T) completion mask (bool or 0/1); the mean is over its nonzero positions.
        lam: λ >= 0 (``float("inf")`` disables the cap).

    Returns:
        (B, T) capped credit, same dtype as ``credit``; every row satisfies ``mean_{mask}|c| <= lam``.
    """
    if credit.shape != mask.shape or credit.dim() != 2:
        raise ValueError(f"credit {tuple(credit.shape)} and mask {tuple(mask.shape)} must both be (B, T).")
    if not lam >= 0:
        raise ValueError(f"lam={lam} must be >= 0 (0 removes the judge's credit, inf disables the cap).")
    keep = mask.to(torch.bool)
    credit = torch.where(keep, credit, torch.zeros_like(credit))
    tokens = keep.sum(dim=1).clamp(min=1).to(credit.dtype)
    mean_abs = credit.abs().sum(dim=1) / tokens  # (B,)
    scale = torch.where(mean_abs > lam, lam / mean_abs.clamp(min=torch.finfo(credit.dtype).tiny), 1.0)
    return credit * scale.unsqueeze(1)


def rollout_credit(
    spans: Iterable[SpanLike],
    num_tokens: int,
    judged_tokens: int,
    label_scores: Mapping[str, float],
    lam: float,
    trained: Tensor | None = None,
) -> Tensor:
    """``cap_λ(c)`` of one rollout, the one definition both trainers use: its spans' credit (`span_credit`), capped
    by λ (`cap_credit`) over the tokens the judge read.

    Args:
        spans: the judge's validated spans (token indices into the completion); none for a failed verdict.
        num_tokens: ``C``, the completion's tokens (a trailing EOS included).
        judged_tokens: the first tokens the judge read (the completion without its trailing EOS / pad); the cap's
            mean ``|c|`` runs over them, and the tokens after them get no credit.
        label_scores: label -> score.
        lam: λ >= 0.
        trained: ``(C,)`` the tokens the loss trains (0/1 or bool), when some are left out: no credit there, and
            the mean runs over the trained tokens the judge read. None: every token.

    Returns:
        ``(C,)`` float32 credit; zeros when there are no spans.
    """
    if not 0 <= judged_tokens <= num_tokens:
        raise ValueError(f"judged_tokens={judged_tokens} must be in [0, num_tokens={num_tokens}].")
    credit = span_credit(spans, num_tokens, label_scores).unsqueeze(0)
    judged = torch.zeros_like(credit)
    judged[0, :judged_tokens] = 1.0
    if trained is not None:
        judged = judged * trained.to(judged.dtype).reshape(1, num_tokens)
    return cap_credit(credit, judged, lam)[0]


def per_token_advantages(advantages: Tensor, credit: Tensor) -> Tensor:
    """``A_t = A + c_t``: (B,) outcome advantages broadcast over (B, T) credit."""
    if advantages.dim() != 1 or advantages.shape[0] != credit.shape[0]:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be (B,) with B = credit rows {credit.shape[0]}.")
    return advantages.unsqueeze(1).to(credit.dtype) + credit


def judge_share(advantages: Tensor, credit: Tensor, mask: Tensor) -> float:
    """The judge's share of advantage mass: ``mean|c| / (mean|A| + mean|c|)`` over mask tokens.

    Args:
        advantages: (B,) outcome advantages (each counted once per mask token of its row).
        credit: (B, T) capped credit.
        mask: (B, T) completion mask.

    Returns:
        A float in [0, 1]; 0 when both are zero.
    """
    keep = mask.to(torch.bool)
    tokens = keep.sum().clamp(min=1)
    mean_credit = (credit.abs() * keep).sum() / tokens
    mean_outcome = (advantages.abs().unsqueeze(1) * keep).sum() / tokens
    total = mean_credit + mean_outcome
    return float(mean_credit / total) if total > 0 else 0.0
