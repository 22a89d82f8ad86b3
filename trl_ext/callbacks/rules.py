"""The monitor rules as pure functions over metric series, and their threshold settings (docs/monitoring.md).

Every rule has the same signature::

    rule(values: Sequence[float], steps: Sequence[int], config, memory=None) -> RuleResult

(`clip_rate_low` and `clip_rate_stuck_zero` also take ``off_policy``: they stay silent in on-policy runs).
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

# The keys `ClipRateMonitor` watches, in the order it picks the first one present.
CLIP_METRICS = ("ipo/masked_ratio", "clip_ratio/region_mean")
NOISE_WINDOW = 50  # raw rewards used to estimate the reward's log-to-log noise

Memory = dict[str, Any]


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
# Validation helpers: every error names the owner, the setting, the bad value and a valid example.


def is_number(value: Any) -> bool:
    """True for an int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(owner: str, name: str, value: Any, minimum: int, example: int) -> int:
    """``value`` as an int >= ``minimum``, or a TypeError/ValueError naming the setting and an example."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{owner}: {name}={value!r} must be an int >= {minimum}; pass e.g. {name}={example}.")
    if value < minimum:
        raise ValueError(f"{owner}: {name}={value!r} must be >= {minimum}; pass e.g. {name}={example}.")
    return value


def check_float(
    owner: str,
    name: str,
    value: Any,
    example: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    allow_none: bool = False,
) -> float | None:
    """``value`` as a finite float inside the bounds (None allowed with ``allow_none``), or a TypeError/ValueError."""
    if value is None and allow_none:
        return None
    none_hint = " (or None to disable the check)" if allow_none else ""
    if not is_number(value) or not math.isfinite(value):
        raise TypeError(f"{owner}: {name}={value!r} must be a finite number{none_hint}; pass e.g. {name}={example}.")
    too_low = low is not None and (value < low if low_inclusive else value <= low)
    too_high = high is not None and (value > high if high_inclusive else value >= high)
    if too_low or too_high:
        lo = "" if low is None else f"{'>=' if low_inclusive else '>'} {low}"
        hi = "" if high is None else f"{'<=' if high_inclusive else '<'} {high}"
        bounds = " and ".join(b for b in (lo, hi) if b)
        raise ValueError(f"{owner}: {name}={value!r} must be {bounds}{none_hint}; pass e.g. {name}={example}.")
    return float(value)


class _Config:
    """Validation for the monitor configs (frozen dataclasses): each check names the config, the field, the bad value
    and a valid example; floats are stored as float."""

    def _int(self, name: str, minimum: int, example: int) -> int:
        return check_int(type(self).__name__, name, getattr(self, name), minimum, example)

    def _float(self, name: str, example: float, **bounds: Any) -> float | None:
        value = check_float(type(self).__name__, name, getattr(self, name), example, **bounds)
        object.__setattr__(self, name, value)
        return value

    def _key(self, name: str, example: str, allow_none: bool = False) -> None:
        value = getattr(self, name)
        if (value is None and allow_none) or (isinstance(value, str) and value):
            return
        none_hint = ", or None" if allow_none else ""
        raise TypeError(
            f"{type(self).__name__}: {name}={value!r} must be a logged key such as {example!r}{none_hint}."
        )


# ----------------------------------------------------------------------------------------------------------------
# Settings, one config per monitor


@dataclass(frozen=True)
class ClipRateMonitorConfig(_Config):
    """Settings of `ClipRateMonitor`: the healthy band of the clip rate / IPO masked ratio and the step-change rules.

    Band rules: ``healthy_min``, ``healthy_max``, ``patience``, ``stuck_patience``, ``zero_atol``.
    Step-change rules: ``drop_factor``, ``jump_factor``, ``jump_patience``, ``window``, ``min_history``.
    Wiring: ``metric``, ``expect_nonzero``, ``aggregate_logs``.
    """

    metric: str | None = field(
        default=None,
        metadata={
            "help": "Logged key to watch; None picks the first present of 'ipo/masked_ratio', "
            "'clip_ratio/region_mean' and keeps it."
        },
    )
    healthy_min: float = field(default=0.01, metadata={"help": "Lower edge of the healthy band (fraction)."})
    healthy_max: float = field(default=0.20, metadata={"help": "Upper edge of the healthy band (fraction)."})
    patience: int = field(
        default=3,
        metadata={"help": "Consecutive observations outside the band before clip_rate_high / clip_rate_low fire."},
    )
    stuck_patience: int = field(
        default=5, metadata={"help": "Consecutive exact zeros before clip_rate_stuck_zero fires."}
    )
    zero_atol: float = field(default=0.0, metadata={"help": "Values <= this count as exactly 0."})
    drop_factor: float = field(
        default=0.25,
        metadata={"help": "clip_rate_drop fires when a value is below drop_factor x the rolling median."},
    )
    jump_factor: float = field(
        default=3.0, metadata={"help": "clip_rate_jump counts values >= jump_factor x the rolling median."}
    )
    jump_patience: int = field(
        default=3, metadata={"help": "Consecutive jumped observations before clip_rate_jump fires."}
    )
    window: int = field(default=10, metadata={"help": "Observations in the rolling median."})
    min_history: int = field(default=5, metadata={"help": "Observations needed before the drop/jump rules run."})
    expect_nonzero: bool | None = field(
        default=None,
        metadata={
            "help": "Whether the run is off-policy (non-zero values expected; the low and stuck-at-0 rules run "
            "only then); None infers it from the training arguments at train begin."
        },
    )
    aggregate_logs: int | None = field(
        default=None,
        metadata={
            "help": "Logs averaged into one observation; None = one generation cycle, inferred from the arguments."
        },
    )

    def __post_init__(self) -> None:
        owner = type(self).__name__
        self._key("metric", "clip_ratio/region_mean", allow_none=True)
        healthy_min = self._float("healthy_min", 0.01, low=0.0, high=1.0, high_inclusive=False)
        healthy_max = self._float("healthy_max", 0.2, low=0.0, high=1.0, low_inclusive=False)
        if healthy_min >= healthy_max:
            raise ValueError(
                f"{owner}: healthy_min={self.healthy_min!r} must be below healthy_max={self.healthy_max!r}; "
                "pass e.g. healthy_min=0.01, healthy_max=0.2."
            )
        self._int("patience", 1, 3)
        self._int("stuck_patience", 1, 5)
        self._float("zero_atol", 0.0, low=0.0, high=healthy_min)
        self._float("drop_factor", 0.25, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        self._float("jump_factor", 3.0, low=1.0, low_inclusive=False)
        self._int("jump_patience", 1, 3)
        self._int("window", 1, 10)
        self._int("min_history", 1, 5)
        if self.min_history > self.window:
            raise ValueError(
                f"{owner}: min_history={self.min_history!r} cannot exceed window={self.window!r}; "
                f"pass e.g. min_history={self.window}."
            )
        if self.expect_nonzero is not None and not isinstance(self.expect_nonzero, bool):
            raise TypeError(
                f"{owner}: expect_nonzero={self.expect_nonzero!r} must be True, False or None (infer from args)."
            )
        if self.aggregate_logs is not None:
            self._int("aggregate_logs", 1, 1)


@dataclass(frozen=True)
class EntropyMonitorConfig(_Config):
    """Settings of `EntropyMonitor`: entropy collapse (absolute floor, relative drop) and KL spikes.

    Entropy: ``entropy_floor``, ``floor_patience``, ``max_drop``, ``baseline_logs``, ``smoothing``.
    KL: ``kl_max``, ``kl_spike_factor``, ``kl_spike_min``, ``kl_window``, ``kl_min_history``.
    Wiring: ``entropy_metric``, ``kl_metric``.
    """

    entropy_floor: float | None = field(
        default=0.03, metadata={"help": "Absolute floor in nats (mean per-token entropy); None disables it."}
    )
    floor_patience: int = field(default=2, metadata={"help": "Consecutive logs below the floor before the alert."})
    max_drop: float | None = field(
        default=0.9,
        metadata={
            "help": "Relative drop from the early level that counts as collapse (0.9 = entropy fell to a tenth); "
            "None disables it."
        },
    )
    baseline_logs: int = field(default=5, metadata={"help": "Logs that define the early level (their median)."})
    smoothing: int = field(default=3, metadata={"help": "Logs in the median compared with the early level."})
    kl_max: float | None = field(
        default=1.0, metadata={"help": "Absolute KL threshold (nats per token); None disables it."}
    )
    kl_spike_factor: float | None = field(
        default=5.0, metadata={"help": "Multiple of the KL rolling median that counts as a spike; None disables it."}
    )
    kl_spike_min: float = field(
        default=0.01,
        metadata={"help": "Relative KL spikes below this KL are ignored (KL grows from 0 early in training)."},
    )
    kl_window: int = field(default=10, metadata={"help": "Logs in the KL rolling median."})
    kl_min_history: int = field(default=5, metadata={"help": "Logs needed before the relative KL rule runs."})
    entropy_metric: str = field(default="entropy", metadata={"help": "Logged key of the mean token entropy."})
    kl_metric: str = field(default="kl", metadata={"help": "Logged key of the KL to the reference (beta > 0)."})

    def __post_init__(self) -> None:
        self._float("entropy_floor", 0.03, low=0.0, allow_none=True)
        self._int("floor_patience", 1, 2)
        self._float("max_drop", 0.9, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False, allow_none=True)
        self._int("baseline_logs", 1, 5)
        self._int("smoothing", 1, 3)
        self._float("kl_max", 1.0, low=0.0, low_inclusive=False, allow_none=True)
        self._float("kl_spike_factor", 5.0, low=1.0, low_inclusive=False, allow_none=True)
        self._float("kl_spike_min", 0.01, low=0.0)
        self._int("kl_window", 1, 10)
        self._int("kl_min_history", 1, 5)
        if self.kl_min_history > self.kl_window:
            raise ValueError(
                f"{type(self).__name__}: kl_min_history={self.kl_min_history!r} cannot exceed "
                f"kl_window={self.kl_window!r}; pass e.g. kl_min_history={self.kl_window}."
            )
        self._key("entropy_metric", "entropy")
        self._key("kl_metric", "kl")


@dataclass(frozen=True)
class RewardMonitorConfig(_Config):
    """Settings of `RewardMonitor`: reward collapse after a rise, no learning signal, judge failures.

    Collapse: ``smoothing``, ``min_rise``, ``max_drop``, ``collapse_patience``, ``min_drop_sigmas``.
    Signal: ``zero_std_max``, ``zero_std_patience``. Judge: ``judge_failure_max``, ``judge_patience``.
    Wiring: ``reward_metric``, ``zero_std_metric``, ``judge_failure_metric``.
    """

    smoothing: int = field(default=5, metadata={"help": "Logs in the moving average of the reward."})
    min_rise: float = field(
        default=0.1,
        metadata={
            "help": "Gain (in reward units) the smoothed reward must make before a collapse can be called; set it "
            "to your reward's scale (0.1 suits rewards in [0, 1])."
        },
    )
    max_drop: float = field(
        default=0.5, metadata={"help": "Fraction of the gain that must be lost (0.5 = half of it)."}
    )
    collapse_patience: int = field(
        default=3, metadata={"help": "Consecutive logs below the collapse threshold before the alert."}
    )
    min_drop_sigmas: float = field(
        default=6.0,
        metadata={
            "help": "The loss from the peak must also be at least this many standard errors of the smoothed "
            "reward (0 disables the noise guard)."
        },
    )
    zero_std_max: float | None = field(
        default=0.9,
        metadata={"help": "frac_reward_zero_std at or above this is 'no signal'; None disables the rule."},
    )
    zero_std_patience: int = field(default=5, metadata={"help": "Consecutive logs before reward_no_signal."})
    judge_failure_max: float | None = field(
        default=0.2,
        metadata={"help": "Judge failure ratio above this fires judge_failure; None disables the rule."},
    )
    judge_patience: int = field(default=2, metadata={"help": "Consecutive logs before judge_failure."})
    reward_metric: str = field(default="reward", metadata={"help": "Logged key of the mean reward."})
    zero_std_metric: str = field(
        default="frac_reward_zero_std",
        metadata={"help": "Logged key of the fraction of groups whose rewards all agree."},
    )
    judge_failure_metric: str = field(
        default="judge/failure_ratio", metadata={"help": "Logged key of the judge's failure ratio (judge credit)."}
    )

    def __post_init__(self) -> None:
        self._int("smoothing", 1, 5)
        self._float("min_rise", 0.1, low=0.0, low_inclusive=False)
        self._float("max_drop", 0.5, low=0.0, high=1.0, low_inclusive=False)
        self._int("collapse_patience", 1, 3)
        self._float("min_drop_sigmas", 6.0, low=0.0)
        self._float("zero_std_max", 0.9, low=0.0, high=1.0, low_inclusive=False, allow_none=True)
        self._int("zero_std_patience", 1, 5)
        self._float("judge_failure_max", 0.2, low=0.0, high=1.0, high_inclusive=False, allow_none=True)
        self._int("judge_patience", 1, 2)
        self._key("reward_metric", "reward")
        self._key("zero_std_metric", "frac_reward_zero_std")
        self._key("judge_failure_metric", "judge/failure_ratio")


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
    values: Sequence[float],
    steps: Sequence[int],
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
    values: Sequence[float], steps: Sequence[int], config: ClipRateMonitorConfig, memory: Memory | None = None
) -> RuleResult:
    """The value has been above the healthy band for a while: the trained policy is far from the sampling one.

    Fires at each observation that ends a run of at least ``config.patience`` (3) consecutive values
    ``> config.healthy_max`` (0.20). Facts: ``streak``.
    """
    return _consecutive("clip_rate_high", values, steps, lambda x: x > config.healthy_max, config.patience, memory)


def clip_rate_low(
    values: Sequence[float],
    steps: Sequence[int],
    config: ClipRateMonitorConfig,
    memory: Memory | None = None,
    *,
    off_policy: bool = True,
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
    values: Sequence[float],
    steps: Sequence[int],
    config: ClipRateMonitorConfig,
    memory: Memory | None = None,
    *,
    off_policy: bool = True,
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
    values: Sequence[float], steps: Sequence[int], config: ClipRateMonitorConfig, memory: Memory | None = None
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
    values: Sequence[float], steps: Sequence[int], config: ClipRateMonitorConfig, memory: Memory | None = None
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
    values: Sequence[float], steps: Sequence[int], config: EntropyMonitorConfig, memory: Memory | None = None
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


def kl_spike(
    values: Sequence[float], steps: Sequence[int], config: EntropyMonitorConfig, memory: Memory | None = None
) -> RuleResult:
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
    values: Sequence[float], steps: Sequence[int], config: RewardMonitorConfig, memory: Memory | None = None
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
    values: Sequence[float], steps: Sequence[int], config: RewardMonitorConfig, memory: Memory | None = None
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
    values: Sequence[float], steps: Sequence[int], config: RewardMonitorConfig, memory: Memory | None = None
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
