"""The monitor rules as pure functions over metric series (docs/monitoring.md); their settings are the
``*MonitorConfig`` dataclasses of `trl_ext.callbacks.configs`.

Every rule has the same signature::

    rule(values: Values, steps: Steps, config, memory=None) -> RuleResult

(`clip_rate_low` and `clip_rate_stuck_zero` also take ``off_policy``: they stay silent in on-policy runs;
`stale_rollouts` also takes the mean staleness of each observation and the run's ``max_staleness``).
``values[i]`` is the i-th observation of the rule's metric and ``steps[i]`` its global step (same length,
steps increasing). The result holds the `Finding`s: one for every observation at which the rule's condition
holds (level-triggered, so a condition that persists gives one finding per observation), and ``memory``, the
JSON-serialisable summary of the series needed to continue it (streaks, rolling windows, running levels). Passing
``memory`` back with the next values gives the same findings as one call over the concatenated series, which is
how the monitors evaluate a run log by log. `episode_starts` turns findings into alerts: the first finding of
each episode of a persisting condition.

No function here reads a log, touches a trainer or logs anything; the callbacks in `trl_ext.callbacks.monitors`
collect the series, call these rules and act on the findings. This module imports neither transformers nor torch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .configs import ClipRateMonitorConfig, EntropyMonitorConfig, RewardMonitorConfig, StalenessMonitorConfig

NOISE_WINDOW = 50  # raw rewards used to estimate the reward's log-to-log noise

Memory = dict[str, Any]
Values = Sequence[float]  # the observations of one metric
Steps = Sequence[int]  # their global steps


@dataclass(frozen=True)
class Finding:
    """One observation at which a rule's condition holds.

    Attributes:
        rule: the rule's name, e.g. ``"clip_rate_high"``.
        step: the global step of the observation.
        value: the value the rule judged (smoothed or aggregated when the rule smooths).
        variant: which wording of the rule's alert applies when the rule has several conditions (e.g.
            ``"floor"`` or ``"drop"`` for ``entropy_collapse``); empty otherwise.
        facts: the numbers the alert text quotes (``streak``, ``reference``, ``baseline``, ...).
    """

    rule: str
    step: int
    value: float
    variant: str = ""
    facts: Mapping[str, Any] = field(default_factory=dict)


class RuleResult(NamedTuple):
    """What a rule returns: its findings over the given series and the memory to continue the series."""

    findings: list[Finding]
    memory: Memory


# ----------------------------------------------------------------------------------------------------------------
# Series helpers


def median(values: Sequence[float]) -> float:
    """Median of a non-empty series."""
    return float(statistics.median(values))


def noise_sigma(values: Sequence[float]) -> float:
    """Robust noise std of a series: median |successive difference| / (0.6745 · √2), insensitive to slow trends.

    0.0 for fewer than 3 values.
    """
    if len(values) < 3:
        return 0.0
    differences = [abs(b - a) for a, b in zip(values[:-1], values[1:])]
    return median(differences) / (0.6745 * math.sqrt(2.0))


def _window(values: list[float], value: float, size: int) -> list[float]:
    """``values`` with ``value`` appended, keeping the last ``size``."""
    return [*values, value][-size:]


def _rolling_reference(history: Sequence[float], window: int, min_history: int) -> float | None:
    """Median of the last ``window`` values of ``history``, or None with fewer than ``min_history`` of them."""
    return median(history[-window:]) if len(history) >= min_history else None


def _consecutive(
    rule: str,
    values: Values,
    steps: Steps,
    abnormal: Callable[[float], bool],
    patience: int,
    memory: Mapping[str, Any] | None,
    enabled: bool = True,
) -> RuleResult:
    """Findings where ``abnormal`` has held for ``patience`` consecutive observations (and ``enabled``)."""
    streak = int((memory or {}).get("streak", 0))
    findings = []
    for step, x in zip(steps, values):
        streak = streak + 1 if abnormal(x) else 0
        if enabled and streak >= patience:
            findings.append(Finding(rule, step, x, facts={"streak": streak}))
    return RuleResult(findings, {"streak": streak})


# ----------------------------------------------------------------------------------------------------------------
# ClipRateMonitor's rules. ``values`` are observations: the clip rate (or IPO masked ratio) averaged over the
# monitor's aggregate_logs consecutive logs.


def clip_rate_high(
    values: Values, steps: Steps, config: ClipRateMonitorConfig, memory: Memory | None = None
) -> RuleResult:
    """The value has been above the healthy band for a while: the trained policy is far from the sampling one.

    Fires at each observation that ends a run of at least ``config.patience`` (3) consecutive values
    ``> config.healthy_max`` (0.20). Facts: ``streak``.
    """
    return _consecutive("clip_rate_high", values, steps, lambda x: x > config.healthy_max, config.patience, memory)


def clip_rate_low(
    values: Values, steps: Steps, config: ClipRateMonitorConfig, memory: Memory | None = None, off_policy: bool = True
) -> RuleResult:
    """The value has been below the healthy band in an off-policy run: the updates barely move the policy.

    Fires at each observation that ends a run of at least ``config.patience`` (3) consecutive values
    ``< config.healthy_min`` (0.01) of which at least one is not zero (``> config.zero_atol``; all-zero runs are
    `clip_rate_stuck_zero`'s), and only when ``off_policy`` (in an on-policy run the value is legitimately 0).
    Facts: ``streak``.
    """
    streak = int((memory or {}).get("streak", 0))
    nonzero = bool((memory or {}).get("nonzero", False))
    findings = []
    for step, x in zip(steps, values):
        below = x < config.healthy_min
        streak = streak + 1 if below else 0
        nonzero = below and ((streak > 1 and nonzero) or x > config.zero_atol)
        if off_policy and streak >= config.patience and nonzero:
            findings.append(Finding("clip_rate_low", step, x, facts={"streak": streak}))
    return RuleResult(findings, {"streak": streak, "nonzero": nonzero})


def clip_rate_stuck_zero(
    values: Values, steps: Steps, config: ClipRateMonitorConfig, memory: Memory | None = None, off_policy: bool = True
) -> RuleResult:
    """The value has been exactly 0 in an off-policy run: every importance ratio is 1.

    Fires at each observation that ends a run of at least ``config.stuck_patience`` (5) consecutive values
    ``<= config.zero_atol`` (0.0), and only when ``off_policy``. Facts: ``streak``.
    """
    return _consecutive(
        "clip_rate_stuck_zero",
        values,
        steps,
        lambda x: x <= config.zero_atol,
        config.stuck_patience,
        memory,
        enabled=off_policy,
    )


def clip_rate_drop(
    values: Values, steps: Steps, config: ClipRateMonitorConfig, memory: Memory | None = None
) -> RuleResult:
    """A sudden drop from an established level: the generator and trainer changed how they score tokens.

    Fires at an observation below ``config.drop_factor`` (0.25) × the median of the previous ``config.window``
    (10) observations, when at least ``config.min_history`` (5) of them exist and that median is in the band
    (``>= config.healthy_min``). Facts: ``reference`` (the median).
    """
    history = list((memory or {}).get("history", []))
    findings = []
    for step, x in zip(steps, values):
        reference = _rolling_reference(history, config.window, config.min_history)
        if reference is not None and reference >= config.healthy_min and x < config.drop_factor * reference:
            findings.append(Finding("clip_rate_drop", step, x, facts={"reference": reference}))
        history = _window(history, x, config.window)
    return RuleResult(findings, {"history": history})


def clip_rate_jump(
    values: Values, steps: Steps, config: ClipRateMonitorConfig, memory: Memory | None = None
) -> RuleResult:
    """A step change inside the band that stays: a mismatch appeared or the learning rate changed.

    A jump starts at an observation ``>= config.jump_factor`` (3) × the median of the previous ``config.window``
    (10) observations (at least ``config.min_history`` of them, median ``>= config.healthy_min``) and
    ``<= config.healthy_max`` (a jump past the band is `clip_rate_high`'s); it lasts while the values stay in the
    band and ``>= jump_factor`` × that starting median. Fires at each observation of a jump that has lasted at
    least ``config.jump_patience`` (3) observations. Facts: ``reference`` (the starting median), ``streak``.
    """
    memory = memory or {}
    history = list(memory.get("history", []))
    jump_ref = memory.get("reference")
    streak = int(memory.get("streak", 0))
    findings = []
    for step, x in zip(steps, values):
        reference = _rolling_reference(history, config.window, config.min_history)
        established = reference is not None and reference >= config.healthy_min
        in_band = x <= config.healthy_max
        if jump_ref is not None and not (in_band and x >= config.jump_factor * jump_ref):
            jump_ref = None
        if jump_ref is None and established and in_band and x >= config.jump_factor * reference:
            jump_ref = reference
        streak = streak + 1 if jump_ref is not None else 0
        if streak >= config.jump_patience:
            findings.append(Finding("clip_rate_jump", step, x, facts={"reference": jump_ref, "streak": streak}))
        history = _window(history, x, config.window)
    return RuleResult(findings, {"history": history, "reference": jump_ref, "streak": streak})


# ----------------------------------------------------------------------------------------------------------------
# EntropyMonitor's rules. ``values`` are logged values.


def entropy_baseline(memory: Mapping[str, Any] | None, config: EntropyMonitorConfig) -> float | None:
    """The early entropy level in an `entropy_collapse` memory: median of the first ``baseline_logs`` values."""
    values = (memory or {}).get("baseline", [])
    return median(values) if len(values) >= config.baseline_logs else None


def entropy_collapse(
    values: Values, steps: Steps, config: EntropyMonitorConfig, memory: Memory | None = None
) -> RuleResult:
    """The policy's entropy collapsed: it puts almost all its mass on few tokens.

    Fires at each log where the entropy has been below ``config.entropy_floor`` (0.03 nats) for
    ``config.floor_patience`` (2) consecutive logs (variant ``"floor"``, value: the entropy), or where the median
    of the last ``config.smoothing`` (3) logs is more than ``config.max_drop`` (0.9) below the early level, the
    median of the first ``config.baseline_logs`` (5) logs (variant ``"drop"``, value: that median). A None
    threshold disables its condition. Facts: ``entropy``, ``streak``, ``baseline`` (None until known),
    ``smoothed``, ``drop_pct``.
    """
    memory = memory or {}
    baseline_values = list(memory.get("baseline", []))
    recent = list(memory.get("recent", []))
    streak = int(memory.get("floor_streak", 0))
    floor, max_drop = config.entropy_floor, config.max_drop
    findings = []
    for step, x in zip(steps, values):
        if len(baseline_values) < config.baseline_logs:
            baseline_values.append(x)
        recent = _window(recent, x, config.smoothing)
        streak = streak + 1 if floor is not None and x < floor else 0
        below_floor = floor is not None and streak >= config.floor_patience
        baseline = median(baseline_values) if len(baseline_values) >= config.baseline_logs else None
        smoothed = median(recent) if len(recent) >= config.smoothing else None
        dropped = (
            max_drop is not None
            and baseline is not None
            and smoothed is not None
            and baseline > 0
            and smoothed < (1.0 - max_drop) * baseline
        )
        if below_floor or dropped:
            facts = {"entropy": x, "streak": streak, "baseline": baseline, "smoothed": smoothed}
            if not below_floor:
                facts["drop_pct"] = 100 * (1 - smoothed / baseline)
            variant, value = ("floor", x) if below_floor else ("drop", float(smoothed))
            findings.append(Finding("entropy_collapse", step, value, variant, facts))
    return RuleResult(findings, {"baseline": baseline_values, "recent": recent, "floor_streak": streak})


def kl_spike(values: Values, steps: Steps, config: EntropyMonitorConfig, memory: Memory | None = None) -> RuleResult:
    """The KL to the reference jumped: the policy moved abruptly away from the reference model.

    Fires at each log where the KL is above ``config.kl_max`` (1.0; variant ``"max"``), or above
    ``config.kl_spike_factor`` (5) × the median of the previous ``config.kl_window`` (10) logs (at least
    ``config.kl_min_history`` = 5 of them) while also above ``config.kl_spike_min`` (0.01; variant ``"spike"``,
    which wins when both hold). A None threshold disables its condition. Facts: ``reference``, ``ratio``.
    """
    history = list((memory or {}).get("history", []))
    findings = []
    for step, kl in zip(steps, values):
        reference = _rolling_reference(history, config.kl_window, config.kl_min_history)
        above_max = config.kl_max is not None and kl > config.kl_max
        spiked = (
            config.kl_spike_factor is not None
            and reference is not None
            and kl > config.kl_spike_min
            and kl > config.kl_spike_factor * reference
        )
        if above_max or spiked:
            facts = {"reference": reference, "ratio": None if reference is None else kl / max(reference, 1e-12)}
            findings.append(Finding("kl_spike", step, kl, "spike" if spiked else "max", facts))
        history = _window(history, kl, config.kl_window)
    return RuleResult(findings, {"history": history})


# ----------------------------------------------------------------------------------------------------------------
# RewardMonitor's rules. ``values`` are logged values.


def reward_collapse(
    values: Values, steps: Steps, config: RewardMonitorConfig, memory: Memory | None = None
) -> RuleResult:
    """The reward rose, then lost most of its gain, by more than its noise.

    The smoothed reward is the mean of the last ``config.smoothing`` (5) values. Once it has risen by at least
    ``config.min_rise`` (0.1) from its earlier low to its peak, a log counts as collapsed when the smoothed reward
    has lost more than ``config.max_drop`` (0.5) of that gain and the loss from the peak is at least
    ``config.min_drop_sigmas`` (6) standard errors of the smoothed reward (log-to-log noise from the last 50
    values, see `noise_sigma`). Fires at each log that ends a run of at least ``config.collapse_patience`` (3)
    collapsed logs; value: the smoothed reward. Facts: ``low``, ``peak``, ``streak``, ``lost_pct``.
    """
    memory = memory or {}
    recent = list(memory.get("recent", []))
    noise = list(memory.get("noise", []))
    streak = int(memory.get("streak", 0))
    low, peak, low_before_peak = memory.get("low"), memory.get("peak"), memory.get("low_before_peak")
    findings = []
    for step, reward in zip(steps, values):
        recent = _window(recent, reward, config.smoothing)
        noise = _window(noise, reward, NOISE_WINDOW)
        if len(recent) < config.smoothing:
            continue
        smoothed = sum(recent) / len(recent)
        if peak is None:
            low = peak = low_before_peak = smoothed
        else:
            low = min(low, smoothed)
            if smoothed > peak:
                peak, low_before_peak = smoothed, low
        gain = peak - low_before_peak
        standard_error = noise_sigma(noise) / math.sqrt(config.smoothing)
        collapsed_now = (
            gain >= config.min_rise
            and smoothed < peak - config.max_drop * gain
            and peak - smoothed >= config.min_drop_sigmas * standard_error
        )
        streak = streak + 1 if collapsed_now else 0
        if streak >= config.collapse_patience:
            facts = {
                "low": low_before_peak,
                "peak": peak,
                "streak": streak,
                "lost_pct": 100 * (peak - smoothed) / gain,
            }
            findings.append(Finding("reward_collapse", step, smoothed, facts=facts))
    state = {"low": low, "peak": peak, "low_before_peak": low_before_peak}
    return RuleResult(findings, {"recent": recent, "noise": noise, "streak": streak, **state})


def reward_no_signal(
    values: Values, steps: Steps, config: RewardMonitorConfig, memory: Memory | None = None
) -> RuleResult:
    """Nearly every group got identical rewards, so the advantages are 0 and nothing is learnt.

    ``values`` are ``frac_reward_zero_std``. Fires at each log that ends a run of at least
    ``config.zero_std_patience`` (5) consecutive values ``>= config.zero_std_max`` (0.9); never when
    ``zero_std_max`` is None. Facts: ``streak``.
    """
    if config.zero_std_max is None:
        return RuleResult([], dict(memory or {}))
    threshold = config.zero_std_max
    return _consecutive("reward_no_signal", values, steps, lambda x: x >= threshold, config.zero_std_patience, memory)


def judge_failure(
    values: Values, steps: Steps, config: RewardMonitorConfig, memory: Memory | None = None
) -> RuleResult:
    """The LLM judge fails on many rollouts, which then get no token credit (judge credit runs).

    ``values`` are ``judge/failure_ratio``. Fires at each log that ends a run of at least ``config.judge_patience``
    (2) consecutive values ``> config.judge_failure_max`` (0.2); never when ``judge_failure_max`` is None.
    Facts: ``streak``.
    """
    if config.judge_failure_max is None:
        return RuleResult([], dict(memory or {}))
    threshold = config.judge_failure_max
    return _consecutive("judge_failure", values, steps, lambda x: x > threshold, config.judge_patience, memory)


def judge_injection(
    values: Values, steps: Steps, config: RewardMonitorConfig, memory: Memory | None = None
) -> RuleResult:
    """The policy is suspected of forging the judge's verdict (judge credit, rubric judge: docs/security.md).

    ``values`` are ``judge/injection_suspected`` (or the rubric judge's ``<name>/injection_suspected``): rollouts of
    the batch whose text holds a verdict-shaped JSON value or delimiter-shaped text, or whose judge reply was
    refused for holding several different verdicts. Fires at each log that ends a run of at least
    ``config.judge_injection_patience`` (1) consecutive values ``> config.judge_injection_max``; never when
    ``judge_injection_max`` is None (the default: a task whose answers are JSON with the judge's field names would
    count on a healthy run). Facts: ``streak``.
    """
    if config.judge_injection_max is None:
        return RuleResult([], dict(memory or {}))
    threshold = config.judge_injection_max
    return _consecutive(
        "judge_injection", values, steps, lambda x: x > threshold, config.judge_injection_patience, memory
    )


# ----------------------------------------------------------------------------------------------------------------
# StalenessMonitor's rules (asynchronous runs: TRL's AsyncGRPOTrainer). ``values`` are per-log shares computed by
# `dropped_share` and `wait_share` from TRL's logged metrics.

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
    return _consecutive("trainer_starved", values, steps, lambda x: x > threshold, config.starved_patience, memory)


# ----------------------------------------------------------------------------------------------------------------
# From findings to alerts


def episode_starts(
    findings: Sequence[Finding],
    steps: Sequence[int],
    *,
    rearm_after: int = 3,
    start_step: int = 0,
    memory: Memory | None = None,
) -> RuleResult:
    """The findings that raise an alert: the first of each episode of one rule's persisting condition.

    ``steps`` are all the observations the rule judged (increasing), ``findings`` the rule's findings over them.
    An episode starts at a finding when the rule is not already in one and ``step >= start_step`` (earlier
    findings are swallowed: the episode does not start, so the first finding at or after ``start_step`` fires);
    it ends once ``rearm_after`` consecutive observations have no finding. Memory: ``active``, ``clear`` (the
    observations without a finding since the last one).
    """
    active = bool((memory or {}).get("active", False))
    clear = int((memory or {}).get("clear", 0))
    by_step = {finding.step: finding for finding in findings}
    starts = []
    for step in steps:
        finding = by_step.get(step)
        if finding is None:
            clear += 1
            if clear >= rearm_after:
                active = False
            continue
        clear = 0
        if not active and step >= start_step:
            active = True
            starts.append(finding)
    return RuleResult(starts, {"active": active, "clear": clear})
