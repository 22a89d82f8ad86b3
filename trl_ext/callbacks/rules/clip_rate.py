"""ClipRateMonitor's rules. ``values`` are observations: the clip rate (or IPO masked ratio) averaged over the
monitor's aggregate_logs consecutive logs."""

from __future__ import annotations

from ..configs import ClipRateMonitorConfig
from .series import Finding, Memory, RuleResult, Steps, Values, append_window, consecutive, rolling_reference


def clip_rate_high(
    values: Values, steps: Steps, config: ClipRateMonitorConfig, memory: Memory | None = None
) -> RuleResult:
    """The value has been above the healthy band for a while, or is far above it: the trained policy is far from
    the sampling one.

    Fires at each observation that ends a run of at least ``config.patience`` (3) consecutive values
    ``> config.healthy_max`` (0.20), and at once at an observation ``> config.saturated_max`` (0.40: the trust region
    acts on nearly half of the tokens). Facts: ``streak``.
    """
    saturated = config.saturated_max
    return consecutive(
        "clip_rate_high",
        values,
        steps,
        lambda x: x > config.healthy_max,
        config.patience,
        memory,
        at_once=None if saturated is None else lambda x: x > saturated,
    )


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
    return consecutive(
        "clip_rate_stuck_zero",
        values,
        steps,
        lambda x: x <= config.zero_atol,
        config.stuck_patience,
        memory,
        enabled=off_policy,
    )


def clip_rate_drop(
    values: Values, steps: Steps, config: ClipRateMonitorConfig, memory: Memory | None = None, floor: bool = True
) -> RuleResult:
    """A sudden drop from an established level: the generator and trainer changed how they score tokens.

    Fires at an observation below ``config.drop_factor`` (0.25) × the median of the previous ``config.window``
    (10) observations, when at least ``config.min_history`` (5) of them exist and that median is in the band
    (``>= config.healthy_min``), and only on a metric with a ``floor`` (`trl_ext.losses.LossSpec.
    trust_region_floor`: not IPO's masked ratio, whose healthy state is 0, and which a healthy judge-credit run took
    from 1-3 % to 0 within two steps). Facts: ``reference`` (the median).
    """
    history = list((memory or {}).get("history", []))
    findings = []
    for step, x in zip(steps, values):
        reference = rolling_reference(history, config.window, config.min_history)
        dropped = reference is not None and reference >= config.healthy_min and x < config.drop_factor * reference
        if floor and dropped:
            findings.append(Finding("clip_rate_drop", step, x, facts={"reference": reference}))
        history = append_window(history, x, config.window)
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
        reference = rolling_reference(history, config.window, config.min_history)
        established = reference is not None and reference >= config.healthy_min
        in_band = x <= config.healthy_max
        if jump_ref is not None and not (in_band and x >= config.jump_factor * jump_ref):
            jump_ref = None
        if jump_ref is None and established and in_band and x >= config.jump_factor * reference:
            jump_ref = reference
        streak = streak + 1 if jump_ref is not None else 0
        if streak >= config.jump_patience:
            findings.append(Finding("clip_rate_jump", step, x, facts={"reference": jump_ref, "streak": streak}))
        history = append_window(history, x, config.window)
    return RuleResult(findings, {"history": history, "reference": jump_ref, "streak": streak})
