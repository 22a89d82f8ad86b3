"""RewardMonitor's rules (reward collapse, no signal, answers disappearing, judge failures and suspected injections).
``values`` are logged values."""

from __future__ import annotations

import math

from ..configs import RewardMonitorConfig
from .series import Finding, Memory, RuleResult, Steps, Values, append_window, consecutive, noise_sigma

NOISE_WINDOW = 50  # raw rewards used to estimate the reward's log-to-log noise


def reward_collapse(
    values: Values, steps: Steps, config: RewardMonitorConfig, memory: Memory | None = None
) -> RuleResult:
    """The reward rose, then lost most of its gain (or fell below where it started), by more than its noise.

    The smoothed reward is the mean of the last ``config.smoothing`` (5) values. A log counts as collapsed when the
    loss from the peak is at least ``config.min_drop_sigmas`` (6) standard errors of the smoothed reward (log-to-log
    noise from the last 50 values, see `noise_sigma`) and either the smoothed reward, having risen by at least
    ``config.min_rise`` (0.1) from its earlier low to its peak, has lost more than ``config.max_drop`` (0.5) of that
    gain, or it is below that earlier low, at least ``config.min_rise`` under the peak (variant ``"below_start"``: a
    reward that fell, e.g. flipped its sign, before it had risen by ``min_rise``). Fires at each log that ends a run
    of at least ``config.collapse_patience`` (2) collapsed logs; value: the smoothed reward. Facts: ``low``, ``peak``,
    ``streak``, ``lost_pct`` (not for ``"below_start"``).
    """
    memory = memory or {}
    recent = list(memory.get("recent", []))
    noise = list(memory.get("noise", []))
    streak = int(memory.get("streak", 0))
    low, peak, low_before_peak = memory.get("low"), memory.get("peak"), memory.get("low_before_peak")
    findings = []
    for step, reward in zip(steps, values):
        recent = append_window(recent, reward, config.smoothing)
        noise = append_window(noise, reward, NOISE_WINDOW)
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
        beyond_noise = peak - smoothed >= config.min_drop_sigmas * standard_error
        lost_gain = gain >= config.min_rise and smoothed < peak - config.max_drop * gain
        # below where it started, by a drop of min_rise at least: a reward that fell (e.g. flipped its sign) before
        # it had gained min_rise
        below_start = smoothed < low_before_peak and peak - smoothed >= config.min_rise
        collapsed_now = beyond_noise and (lost_gain or below_start)
        streak = streak + 1 if collapsed_now else 0
        if streak >= config.collapse_patience:
            facts = {"low": low_before_peak, "peak": peak, "streak": streak}
            if lost_gain:
                facts["lost_pct"] = 100 * (peak - smoothed) / gain
            findings.append(Finding("reward_collapse", step, smoothed, "" if lost_gain else "below_start", facts))
    state = {"low": low, "peak": peak, "low_before_peak": low_before_peak}
    return RuleResult(findings, {"recent": recent, "noise": noise, "streak": streak, **state})


def reward_no_signal(
    values: Values, steps: Steps, config: RewardMonitorConfig, memory: Memory | None = None
) -> RuleResult:
    """Nearly every group got identical rewards, so the advantages are 0 and nothing is learnt.

    ``values`` are ``frac_reward_zero_std``. Fires at each log that ends a run of at least
    ``config.zero_std_patience`` (3) consecutive values ``>= config.zero_std_max`` (0.9); never when
    ``zero_std_max`` is None. Facts: ``streak``.
    """
    if config.zero_std_max is None:
        return RuleResult([], dict(memory or {}))
    threshold = config.zero_std_max
    return consecutive("reward_no_signal", values, steps, lambda x: x >= threshold, config.zero_std_patience, memory)


def answer_rate_collapse(
    values: Values,
    steps: Steps,
    config: RewardMonitorConfig,
    memory: Memory | None = None,
    *,
    roots: float | None = None,
) -> RuleResult:
    """The policy stops answering: its final-answer rate fell below a share of its best (RLM trainers).

    ``values`` are ``rlm/final_answer_rate``; ``roots``, when the log has it (``rlm/roots_total``), the number of root
    rollouts behind this log's value. Logs are pooled until they hold ``config.answer_min_roots`` (32) roots, and a
    pool's rate (Σ answered / Σ roots) is one observation: a synchronous trainer's generation batch of 32 roots is
    one log, an asynchronous trainer logs every optimizer step over a few groups, whose rate moves by 1/8 with each
    root of 8. A log without ``roots`` is one observation. Fires at each observation that ends a run of at least
    ``config.answer_patience`` (1) observations below ``config.answer_drop`` (0.5) times the highest so far, once
    that peak is at least ``config.answer_min_peak`` (0.2); never when ``answer_drop`` is None. A rollout without an
    answer gets reward 0, so when the rate reaches 0 every group's rewards agree and nothing trains again (a dead
    policy; benchmarks/RESULTS.md, *IPO collapse*, says how early it fired there). Facts: ``streak``, ``peak``.
    """
    memory = dict(memory or {})
    peak = float(memory.get("peak", 0.0))
    streak = int(memory.get("streak", 0))
    pooled_answers, pooled_roots = float(memory.get("pooled_answers", 0.0)), float(memory.get("pooled_roots", 0.0))
    findings = []
    for step, value in zip(steps, values):
        if config.answer_drop is None or not math.isfinite(value):
            continue
        if roots is not None and math.isfinite(roots) and roots > 0:
            pooled_answers, pooled_roots = pooled_answers + value * roots, pooled_roots + roots
            if pooled_roots < config.answer_min_roots:
                continue
            value, pooled_answers, pooled_roots = pooled_answers / pooled_roots, 0.0, 0.0
        fallen = peak >= config.answer_min_peak and value < config.answer_drop * peak
        streak = streak + 1 if fallen else 0
        if fallen and streak >= config.answer_patience:
            findings.append(Finding("answer_rate_collapse", step, value, facts={"streak": streak, "peak": peak}))
        peak = max(peak, value)
    state = {"peak": peak, "streak": streak, "pooled_answers": pooled_answers, "pooled_roots": pooled_roots}
    return RuleResult(findings, state)


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
    return consecutive("judge_failure", values, steps, lambda x: x > threshold, config.judge_patience, memory)


def judge_injection(
    values: Values,
    steps: Steps,
    config: RewardMonitorConfig,
    memory: Memory | None = None,
    *,
    text_verdicts: bool = False,
) -> RuleResult:
    """The policy is suspected of forging the judge's verdict (judge credit, rubric judge: docs/security.md).

    ``values`` are ``judge/injection_suspected`` (or the rubric judge's ``<name>/injection_suspected``): rollouts of
    the batch whose text holds a verdict-shaped JSON value or delimiter-shaped text, or whose judge reply held several
    different verdicts. Fires at each log that ends a run of at least ``config.judge_injection_patience`` (1)
    consecutive values ``> config.judge_injection_max``. With ``judge_injection_max`` None (the default: a task
    whose answers are JSON with the judge's field names would count on a healthy run) it is off, except for the logs
    where ``text_verdicts``: some verdicts of the log were read out of free text (the endpoint lacks structured
    output, or ignores it), the one channel a forgery can travel; then any suspected injection fires (threshold
    0). Facts: ``streak``, ``threshold``.
    """
    threshold = config.judge_injection_max
    if threshold is None and not text_verdicts:
        return RuleResult([], dict(memory or {}))
    threshold = 0.0 if threshold is None else threshold
    result = consecutive(
        "judge_injection", values, steps, lambda x: x > threshold, config.judge_injection_patience, memory
    )
    for finding in result.findings:
        finding.facts["threshold"] = threshold
    return result
