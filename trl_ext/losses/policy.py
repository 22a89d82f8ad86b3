"""Pure tensor functions of the policy losses (docs/ipo_loss.md): the IPO loss and its keep mask, TRL's asynchronous
PPO-clip loss and its clip flags, the importance-sampling ratio and the sampler/trainer mismatch, and the per-token
statistics the asynchronous trainer logs (`policy_stat_sums`, `version_lags`).

The IPO loss comes from prime-rl (PrimeIntellect-ai/prime-rl, ``src/prime_rl/trainer/rl/loss.py``). Instead of
clipping the importance ratio ρ = p / p_old around 1 (PPO), it drops every token whose *probability* moved by more
than ε since sampling, ``|p − p_old| > ε``: a trust region in probability space. The mask does not depend on the
sign of the advantage. The kept tokens' ratio is capped at C with a stop-gradient, so its value never exceeds C and
its gradient is bounded by C times the gradient of log p (the cap comes from the judge blog's runs; prime-rl has
none).

`ppo_clip_loss` is TRL's asynchronous PPO-clip loss (``AsyncGRPOTrainer``'s ``loss_type="dapo"``) and
`ppo_clip_flags` the tokens its clipping acts on (TRL's ``clip_ratio/*``), so the asynchronous trainer can compute
TRL's loss itself and log its clip rate by version lag.

Shapes: ``B`` rows (completions), ``T`` completion tokens. Log-probabilities are natural logs of the probability of
the sampled token. No trainer state is read here; metrics are returned, not logged.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "folded_advantages",
    "importance_sampling_ratio",
    "ipo_keep_mask",
    "ipo_loss",
    "policy_stat_sums",
    "ppo_clip_flags",
    "ppo_clip_loss",
    "sampling_mismatch",
    "version_lags",
]


def ipo_keep_mask(logps: Tensor, old_logps: Tensor, threshold: float = 0.3) -> Tensor:
    """Tokens inside IPO's probability-difference trust region.

    Args:
        logps: ``(B, T)`` log p of the sampled tokens under the current policy.
        old_logps: ``(B, T)`` log p_old of the same tokens under the sampling policy.
        threshold: ε, the largest allowed ``|p − p_old|`` (a probability, so in ``(0, 1]``).

    Returns:
        ``(B, T)`` bool tensor, True where ``|exp(logps) − exp(old_logps)| <= threshold``. Non-finite inputs (NaN)
        give False; ``old_logps = -inf`` means p_old = 0. Independent of the advantage sign.
    """
    if logps.shape != old_logps.shape:
        raise ValueError(
            f"logps {tuple(logps.shape)} and old_logps {tuple(old_logps.shape)} must have the same shape."
        )
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0 (a probability difference), got {threshold}.")
    return (logps.detach().exp() - old_logps.detach().exp()).abs() <= threshold


def _as_token_advantages(advantages: Tensor, shape: torch.Size) -> Tensor:
    """Broadcast ``(B,)``, ``(B, 1)`` or ``(B, T)`` advantages to ``(B, T)``."""
    batch, length = shape
    if advantages.dim() == 1 and advantages.shape[0] == batch:
        return advantages.unsqueeze(1).expand(batch, length)
    if advantages.dim() == 2 and advantages.shape[0] == batch and advantages.shape[1] in (1, length):
        return advantages.expand(batch, length)
    raise ValueError(
        f"advantages must have shape (B,), (B, 1) or (B, T) = ({batch},), ({batch}, 1) or ({batch}, {length}); "
        f"got {tuple(advantages.shape)}."
    )


def ipo_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    threshold: float = 0.3,
    ratio_cap: float = 8.0,
    ratio_band: float | None = 0.2,
    kl_tau: float = 0.0,
    normalizer: float | Tensor | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """IPO masking loss (docs/ipo_loss.md): ``Σ over loss tokens of w·(−keep·A·ρ̂ + τ·(log ρ)²) / normalizer``.

    With ρ = p / p_old, ``keep = |p − p_old| <= threshold`` and, with a ``ratio_band`` δ, not beyond ``1 ± δ`` in
    the direction of its advantage (``ρ < 1 − δ`` with A < 0, ``ρ > 1 + δ`` with A > 0: the token already moved as
    far as its advantage asks, PPO-clip's region), and the capped ratio ``ρ̂ = ρ · stopgrad(min(1, C/ρ))``:
    ρ̂ equals min(ρ, C) in value and its gradient is ``min(ρ, C) · ∇log p``, so a capped token's gradient is
    bounded by C. ρ̂ is computed in log space, so a p_old that underflows to 0 gives a finite capped value.

    Why the band: the probability-difference region alone never stops pushing down a token with p_old <= ε (its
    |p − p_old| stays <= ε down to p = 0), and lets any token fall to ρ = 1 − ε / p_old <= 0.7 before it stops; in
    the off-policy passes those tokens carry the net gradient, and on the quickstart's RLM task IPO without the band
    drove the final answers of negative-advantage rollouts to 0 and the policy to a dead state on 3 of 3 seeds
    (docs/ipo_loss.md, *Why the ratio band*).

    Args:
        logps: ``(B, T)`` log p of the sampled tokens under the current policy (carries the gradient).
        old_logps: ``(B, T)`` log p_old under the sampling policy (the inference engine's logprobs when present).
            Values at positions outside ``mask`` are ignored, ``-inf``/NaN included; a NaN inside ``mask``
            (a token the engine could not score) makes that token count as masked out.
        advantages: ``(B,)`` per-rollout or ``(B, T)`` per-token advantages A.
        mask: ``(B, T)`` loss tokens (bool or 0/1); padding and prompt positions are 0.
        threshold: ε of the keep mask (default 0.3).
        ratio_cap: C, the largest value of the ratio (default 8.0, must be > 1).
        ratio_band: δ of the ratio band (default 0.2, in (0, 1)); None: the probability-difference region alone.
        kl_tau: τ, weight of the ``(log ρ)²`` penalty (default 0).
        normalizer: the summed per-token loss is divided by this; default: the number of loss tokens in ``mask``.
            A trainer passes the token count of its whole accumulation window, as TRL's ``dapo`` loss does.
        weights: ``(B, T)`` per-token weights ``w >= 0`` multiplying each token's whole loss (policy term and τ
            penalty), e.g. the stepwise ``W(v)/n_v`` weights; default 1.

    Returns:
        ``(loss, metrics)``: a 0-dim loss, and 0-dim metrics over the loss tokens: ``masked_ratio`` (fraction
        dropped by the trust region, the band included), ``band_ratio`` (fraction dropped by the band alone, in the
        probability region), ``capped_ratio`` (fraction kept with a ratio above the cap), ``ratio_mean``
        (mean uncapped ρ over the scorable loss tokens), ``num_tokens`` (number of loss tokens).
    """
    if logps.dim() != 2 or logps.shape != old_logps.shape or logps.shape != mask.shape:
        raise ValueError(
            f"logps, old_logps and mask must all be (B, T); got {tuple(logps.shape)}, {tuple(old_logps.shape)} "
            f"and {tuple(mask.shape)}."
        )
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0 (a probability difference), got {threshold}.")
    if not ratio_cap > 1.0:
        raise ValueError(f"ratio_cap must be > 1 (the ratio of an unchanged token is 1), got {ratio_cap}.")
    if kl_tau < 0:
        raise ValueError(f"kl_tau must be >= 0, got {kl_tau}.")
    if ratio_band is not None and not 0.0 < ratio_band < 1.0:
        raise ValueError(f"ratio_band must be in (0, 1) or None, got {ratio_band}.")
    token_advantages = _as_token_advantages(advantages, logps.shape)
    advantage_sign = token_advantages.detach().sign()
    if weights is not None:
        if weights.shape != logps.shape:
            raise ValueError(f"weights must be (B, T) = {tuple(logps.shape)} like logps; got {tuple(weights.shape)}.")
        # The policy term's weight on the advantage, the τ term's below: w·(−keep·A·ρ̂ + τ·(log ρ)²).
        token_advantages = token_advantages * weights
    token_advantages = token_advantages.to(logps.dtype)

    loss_tokens = mask.bool()
    # `where`, not multiplication: garbage old log-probs at padding (-inf, NaN) must not reach exp/backward.
    scorable = loss_tokens & torch.isfinite(old_logps) & torch.isfinite(logps.detach())
    zeros = torch.zeros_like(logps)
    safe_logps = torch.where(scorable, logps, zeros)
    safe_old_logps = torch.where(scorable, old_logps.to(logps.dtype), zeros)

    log_ratio = safe_logps - safe_old_logps
    in_region = ipo_keep_mask(safe_logps, safe_old_logps, threshold) & scorable
    keep = in_region
    if ratio_band is not None:  # beyond 1 ± δ in the direction of its advantage: moved as far as it is asked
        moved = log_ratio.detach()
        beyond = ((advantage_sign < 0) & (moved < math.log1p(-ratio_band))) | (
            (advantage_sign > 0) & (moved > math.log1p(ratio_band))
        )
        keep = in_region & ~beyond
    # ρ̂ = ρ · stopgrad(min(1, C/ρ)) in log space: value min(log ρ, log C), gradient ∇log ρ. Written as
    # stopgrad(value) + (x − stopgrad(x)) so the value is exactly min(log ρ, log C) (x − x is exactly 0).
    log_cap = math.log(ratio_cap)
    capped_log_ratio = log_ratio.detach().clamp(max=log_cap) + (log_ratio - log_ratio.detach())
    capped_ratio_value = capped_log_ratio.exp()

    per_token_loss = -keep.to(logps.dtype) * token_advantages * capped_ratio_value
    if kl_tau:
        penalty = kl_tau * log_ratio.pow(2)
        per_token_loss = per_token_loss + (penalty if weights is None else penalty * weights.to(logps.dtype))
    per_token_loss = torch.where(scorable, per_token_loss, zeros)

    num_tokens = loss_tokens.sum()
    denominator = num_tokens.clamp(min=1).to(logps.dtype) if normalizer is None else normalizer
    loss = per_token_loss.sum() / denominator

    with torch.no_grad():
        count = num_tokens.clamp(min=1).to(torch.float32)
        is_capped = keep & (log_ratio > log_cap)
        metrics = {
            "masked_ratio": (loss_tokens & ~keep).sum().to(torch.float32) / count,
            "band_ratio": (in_region & ~keep).sum().to(torch.float32) / count,
            "capped_ratio": is_capped.sum().to(torch.float32) / count,
            "ratio_mean": torch.where(scorable, log_ratio.exp(), zeros).sum().to(torch.float32)
            / scorable.sum().clamp(min=1).to(torch.float32),
            "num_tokens": num_tokens.to(torch.float32),
        }
    return loss, metrics


def ppo_clip_flags(ratio: Tensor, advantages: Tensor, *, epsilon_low: float, epsilon_high: float) -> dict[str, Tensor]:
    """The tokens PPO-clip's trust region acts on: TRL's ``clip_ratio/low_mean``, ``high_mean`` and ``region_mean``.

    Args:
        ratio: ``(...)`` ρ = p / p_old of each token (any shape; ``(M,)`` in the asynchronous trainer).
        advantages: the advantage of each token, ``ratio``'s shape.
        epsilon_low, epsilon_high: ε_low and ε_high of the clip range ``[1 − ε_low, 1 + ε_high]``.

    Returns:
        bool tensors of ``ratio``'s shape, without gradient: ``low`` (ρ < 1 − ε_low and A < 0), ``high``
        (ρ > 1 + ε_high and A > 0) and ``region`` (either): where the clipped term is the smaller one and its gradient
        is 0. A token with A = 0 is never counted.
    """
    if ratio.shape != advantages.shape:
        raise ValueError(f"ratio {tuple(ratio.shape)} and advantages {tuple(advantages.shape)} must have one shape.")
    with torch.no_grad():
        low = (ratio < 1 - epsilon_low) & (advantages < 0)
        high = (ratio > 1 + epsilon_high) & (advantages > 0)
        return {"low": low, "high": high, "region": low | high}


def ppo_clip_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """TRL's asynchronous PPO-clip loss (``AsyncGRPOTrainer.compute_loss``, ``loss_type="dapo"``), op for op:
    ``Σ_t −min(ρ_t·A_t, clip(ρ_t, 1 − ε_low, 1 + ε_high)·A_t) / normalizer`` with ρ = exp(log p − log p_old).

    Args:
        logps: ``(M,)`` log p of the loss tokens under the current policy (carries the gradient). Any shape works if
            the three tensors share it; TRL's asynchronous batch gives the flat ``(M,)`` selection, no padding.
        old_logps: ``(M,)`` log p_old: the sampler's log-probs.
        advantages: ``(M,)`` each token's advantage (per-sample loss weights folded in as ``w·A``: exact for w >= 0).
        epsilon_low, epsilon_high: the clip range ``[1 − ε_low, 1 + ε_high]`` (TRL's ``epsilon`` and
            ``epsilon_high``).
        normalizer: the summed loss is divided by it; default the number of tokens (at least 1). TRL divides by the
            loss tokens per rank and then, outside this function, by the accumulation steps.

    Returns:
        ``(loss, flags)``: the 0-dim loss and `ppo_clip_flags` of ρ (``low``, ``high``, ``region``: ``(M,)`` bool).
    """
    if logps.shape != old_logps.shape or logps.shape != advantages.shape:
        raise ValueError(
            f"logps, old_logps and advantages must have one shape; got {tuple(logps.shape)}, "
            f"{tuple(old_logps.shape)} and {tuple(advantages.shape)}."
        )
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(ratio * advantages, clipped * advantages)
    denominator = max(logps.numel(), 1) if normalizer is None else normalizer
    loss = per_token_loss.sum() / denominator
    return loss, ppo_clip_flags(ratio, advantages, epsilon_low=epsilon_low, epsilon_high=epsilon_high)


def importance_sampling_ratio(
    old_logps: Tensor,
    sampling_logps: Tensor,
    mask: Tensor,
    *,
    mode: str = "token_truncate",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> Tensor:
    """TRL's vLLM importance-sampling correction ``π_old / π_sampler``, for rows a trainer built itself.

    Same definition as `trl.GRPOTrainer` (``vllm_importance_sampling_mode``): token modes give ``(B, T)``
    ratios, sequence modes one ``(B, 1)`` ratio from the summed log difference; ``*_truncate`` clamps to
    ``[clip_min, clip_max]``, ``*_mask`` zeroes ratios outside it. NaN sampling log-probs (tokens the engine could
    not score) and positions outside ``mask`` get a log difference of 0 (no correction).
    """
    modes = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    if mode not in modes:
        raise ValueError(f"mode must be one of {modes}, got {mode!r}.")
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = diff.exp()
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        return ratio.clamp(min=low, max=high)
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def sampling_mismatch(old_logps: Tensor, sampling_logps: Tensor, mask: Tensor, is_ratio: Tensor) -> dict[str, Tensor]:
    """How far the sampler's log-probs are from the trained policy's, over the tokens that are trained.

    The statistics TRL logs as ``sampling/sampling_logp_difference/{mean,max}`` and
    ``sampling/importance_sampling_ratio/{min,mean,max}``, for rows a trainer built itself.

    Args:
        old_logps, sampling_logps: ``(B, T)`` log-probs of the policy before the update and of the sampler.
        mask: ``(B, T)`` tokens that count (completion mask times tool mask).
        is_ratio: `importance_sampling_ratio`'s output, ``(B, T)`` (token modes) or ``(B, 1)`` (sequence modes).

    Returns:
        0-dim tensors ``logp_diff_mean``, ``logp_diff_max`` (|old - sampling| over masked tokens, NaN sampling
        log-probs left out) and ``is_ratio_min``, ``is_ratio_mean``, ``is_ratio_max`` (over masked tokens, or over
        rows for sequence modes); 0 where nothing is counted.
    """
    keep = mask.bool()
    delta = (old_logps - sampling_logps).abs()
    delta = delta[keep & ~torch.isnan(delta)]
    ratios = is_ratio.flatten() if is_ratio.size(-1) == 1 else is_ratio[keep]
    zero = old_logps.new_zeros(())

    def stat(values: Tensor, reduce) -> Tensor:
        return reduce(values) if values.numel() else zero

    return {
        "logp_diff_mean": stat(delta, torch.mean),
        "logp_diff_max": stat(delta, torch.max),
        "is_ratio_min": stat(ratios, torch.min),
        "is_ratio_mean": stat(ratios, torch.mean),
        "is_ratio_max": stat(ratios, torch.max),
    }


def policy_stat_sums(logps: Tensor, old_logps: Tensor, entropy: Tensor) -> dict[str, Tensor]:
    """The sums behind TRL's async ``ratio``, ``kl`` and ``entropy`` metrics, over ``M`` loss tokens.

    Args:
        logps, old_logps, entropy: ``(M,)`` current log-probs, the sampler's log-probs, the policy's entropy.

    Returns:
        0-dim sums: ``ratio`` (ρ = p / p_old), ``kl`` (the k3 estimate ``(ρ − 1) − log ρ``), ``entropy``, and
        ``count`` (M); divide each by the count summed over ranks.
    """
    with torch.no_grad():
        log_ratio = logps.detach() - old_logps
        ratio = log_ratio.exp()
        return {
            "ratio": ratio.sum(),
            "kl": ((ratio - 1) - log_ratio).sum(),
            "entropy": entropy.detach().sum(),
            "count": torch.tensor(float(logps.numel()), device=logps.device),
        }


def version_lags(sample_versions: Tensor, model_version: int, max_lag: int) -> Tensor:
    """Each token's version lag: ``model_version - sample_versions``, clamped to ``[0, max_lag]``.

    Args:
        sample_versions: ``(M,)`` the policy version that sampled each token (float, as collated).
        model_version: the version of the policy being trained.
        max_lag: the largest lag reported (older tokens count as ``max_lag``).

    Returns:
        ``(M,)`` int64 lags.
    """
    return (model_version - sample_versions.round().long()).clamp(0, max_lag)


def folded_advantages(advantages: Tensor, weights: Tensor) -> Tensor:
    """The advantages times per-token loss weights, for a loss whose policy term is linear in the advantage (TRL's
    own: PPO-clip and its variants), which then weighs each token's policy loss by its weight exactly (for weights
    >= 0: the clipping's min/max picks the same branch).

    Args:
        advantages: ``(B,)`` one per row, or ``(B, T)`` per token (packed rows: ``(P, M)``).
        weights: ``(B, T)`` >= 0.

    Returns:
        ``(B, T)`` in the advantages' dtype.
    """
    if advantages.dim() == weights.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    return advantages * weights.to(advantages.dtype)
