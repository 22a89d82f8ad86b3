"""StalenessMonitor's rules (asynchronous runs: TRL's AsyncGRPOTrainer). ``values`` are per-log shares computed by
`dropped_share` and `wait_share` from TRL's logged metrics."""

from __future__ import annotations

from collections.abc import Sequence

from ..configs import StalenessMonitorConfig
from .series import Finding, Memory, RuleResult, Steps, Values, consecutive

_PINNED_ATOL = 1e-9  # a mean of integer staleness values at the limit, up to float rounding


def dropped_share(dropped: float, samples_per_step: float, steps: int) -> float | None:
    """The share of the rollouts that reached the trainer in one log window that were dropped as stale.

    TRL's async trainer drops a sample more than ``max_staleness`` policy versions old when it takes it from the
    rollout queue; ``sample/dropped_stale_total`` counts them, summed over the log's window (the key is absent
    from a log in which none was dropped: pass 0), and ``batch/samples_per_step`` is the number of samples trained
    per optimizer step, averaged over the window.

    Args:
        dropped: samples dropped as stale in the window (>= 0).
        samples_per_step: samples trained per optimizer step, mean over the window (>= 0).
        steps: optimizer steps in the window (the global step minus that of the previous log).

    Returns:
        ``dropped / (dropped + samples_per_step * steps)`` in [0, 1]; None when nothing reached the trainer or
        ``steps < 1`` (the rule is then idle for this log).
    """
    if steps < 1:
        return None
    total = dropped + samples_per_step * steps
    return dropped / total if total > 0 else None


def wait_share(rollout_wait_s: float, step_s: float) -> float | None:
    """The share of an optimizer step the trainer spent waiting for rollouts: ``perf/rollout_wait_s / perf/step_s``
    (both means over the log's window); None when ``step_s <= 0`` (rule idle)."""
    return rollout_wait_s / step_s if step_s > 0 else None


def stale_rollouts(
    values: Values,
    steps: Steps,
    config: StalenessMonitorConfig,
    memory: Memory | None = None,
    staleness_mean: Sequence[float | None] | None = None,
    max_staleness: int | None = None,
) -> RuleResult:
    """Stale rollouts dominate: the trainer throws away much of what the worker generates, or trains only at the
    staleness limit while throwing the rest away.

    ``values`` are dropped shares (`dropped_share`), ``staleness_mean[i]`` the mean staleness of the samples
    trained in log i (None when not logged). A log is stale-dominated when its share is above
    ``config.max_dropped_share`` (0.5; variant ``"dropped"``, value: the share), or, with ``config.watch_pinned``
    and ``max_staleness >= 1``, when its mean staleness equals ``max_staleness`` (every trained sample at the
    limit) while its share is above 0 (variant ``"pinned"``, value: the mean staleness; ``"dropped"`` wins when
    both hold). A mean at the limit without drops is not counted: a pipeline one version behind
    (``max_staleness=1``) or a generation-bound run with TRL's automatic ``max_inflight_tasks`` runs there by
    design. Fires at each log that ends a run of at least ``config.stale_patience`` (3) stale-dominated logs.
    Facts: ``streak``, ``dropped_share``, ``staleness_mean``, ``max_staleness``.
    """
    means = list(staleness_mean) if staleness_mean is not None else [None] * len(values)
    if len(means) != len(values):
        raise ValueError(
            f"stale_rollouts: staleness_mean has {len(means)} values for {len(values)} dropped shares; pass one "
            "per observation (None where it was not logged)."
        )
    limit = config.max_dropped_share
    pinned_on = config.watch_pinned and max_staleness is not None and max_staleness >= 1
    streak = int((memory or {}).get("streak", 0))
    findings = []
    for step, share, mean in zip(steps, values, means):
        dropped = limit is not None and share > limit
        pinned = pinned_on and mean is not None and mean >= max_staleness - _PINNED_ATOL and share > 0
        streak = streak + 1 if dropped or pinned else 0
        if streak >= config.stale_patience and (dropped or pinned):
            variant, value = ("dropped", share) if dropped else ("pinned", float(mean))
            facts = {"streak": streak, "dropped_share": share, "staleness_mean": mean, "max_staleness": max_staleness}
            findings.append(Finding("stale_rollouts", step, value, variant, facts))
    return RuleResult(findings, {"streak": streak})


def trainer_starved(
    values: Values, steps: Steps, config: StalenessMonitorConfig, memory: Memory | None = None
) -> RuleResult:
    """The rollout worker starves the trainer: it waits for rollouts most of every step.

    ``values`` are wait shares (`wait_share`). Fires at each log that ends a run of at least
    ``config.starved_patience`` (5) consecutive values ``> config.max_wait_share`` (0.9); never when
    ``max_wait_share`` is None. Facts: ``streak``.
    """
    if config.max_wait_share is None:
        return RuleResult([], dict(memory or {}))
    threshold = config.max_wait_share
    return consecutive("trainer_starved", values, steps, lambda x: x > threshold, config.starved_patience, memory)
