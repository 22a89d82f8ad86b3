"""The monitors' settings: `ClipRateMonitorConfig`, `EntropyMonitorConfig`, `RewardMonitorConfig`,
`StalenessMonitorConfig` (docs/monitoring.md).

Each is a frozen dataclass whose fields carry their default and help text (`trl_ext.fields.documented`) and whose
``__post_init__`` validates them: every error names the config, the setting, the bad value and a valid example
(`check_int`, `check_float`, also used for the monitors' own arguments). This module imports neither transformers
nor torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..fields import documented

__all__ = [
    "ClipRateMonitorConfig",
    "EntropyMonitorConfig",
    "RewardMonitorConfig",
    "StalenessMonitorConfig",
    "check_float",
    "check_int",
    "is_number",
]

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

    def _at_most(self, name: str, limit: str) -> None:
        """The int setting ``name`` must not exceed the int setting ``limit`` (a history inside its window)."""
        value, limit_value = getattr(self, name), getattr(self, limit)
        if value > limit_value:
            raise ValueError(
                f"{type(self).__name__}: {name}={value!r} cannot exceed {limit}={limit_value!r}; "
                f"pass e.g. {name}={limit_value}."
            )

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
    """Settings of `ClipRateMonitor`: the healthy band of the loss's trust-region metric (TRL's clip rate, the IPO
    masked ratio: `trl_ext.losses.LossSpec.trust_region_metric`) and the step-change rules.

    Band rules: ``healthy_min``, ``healthy_max``, ``saturated_max``, ``patience``, ``stuck_patience``, ``zero_atol``.
    Step-change rules: ``drop_factor``, ``jump_factor``, ``jump_patience``, ``window``, ``min_history``.
    Wiring: ``metric``, ``expect_nonzero``, ``aggregate_logs``.
    """

    metric: str | None = documented(
        None,
        "Logged key to watch; None picks the trust-region metric of the run's loss (LossSpec.trust_region_metric), "
        "else the first in the log of the registered losses' metrics (trl_ext.losses.trust_region_metrics; those of "
        "the losses trl-ext computes first), and keeps it.",
    )
    healthy_min: float = documented(0.01, "Lower edge of the healthy band (fraction).")
    healthy_max: float = documented(0.20, "Upper edge of the healthy band (fraction).")
    saturated_max: float | None = documented(
        0.40, "clip_rate_high fires at once above this (fraction; the trust region saturated); None disables it."
    )
    patience: int = documented(
        3, "Consecutive observations outside the band before clip_rate_high / clip_rate_low fire."
    )
    stuck_patience: int = documented(5, "Consecutive exact zeros before clip_rate_stuck_zero fires.")
    zero_atol: float = documented(0.0, "Values <= this count as exactly 0.")
    drop_factor: float = documented(
        0.25, "clip_rate_drop fires when a value is below drop_factor x the rolling median."
    )
    jump_factor: float = documented(3.0, "clip_rate_jump counts values >= jump_factor x the rolling median.")
    jump_patience: int = documented(3, "Consecutive jumped observations before clip_rate_jump fires.")
    window: int = documented(10, "Observations in the rolling median.")
    min_history: int = documented(5, "Observations needed before the drop/jump rules run.")
    expect_nonzero: bool | None = documented(
        None,
        "Whether the run is off-policy (non-zero values expected; the low and stuck-at-0 rules run "
        "only then); None infers it from the training arguments at train begin.",
    )
    aggregate_logs: int | None = documented(
        None,
        "Logs averaged into one observation; None = two logs when a generation cycle spans several optimizer steps "
        "(its first, on-policy log is then averaged with an off-policy one), else one.",
    )

    def __post_init__(self) -> None:
        owner = type(self).__name__
        self._key("metric", "clip_ratio/region_mean", allow_none=True)
        healthy_min = self._float("healthy_min", 0.01, low=0.0, high=1.0, high_inclusive=False)
        healthy_max = self._float("healthy_max", 0.2, low=0.0, high=1.0, low_inclusive=False)
        saturated_max = self._float("saturated_max", 0.4, low=0.0, high=1.0, allow_none=True)
        if saturated_max is not None and saturated_max < healthy_max:
            raise ValueError(
                f"{owner}: saturated_max={saturated_max!r} must be at least healthy_max={healthy_max!r}; "
                "pass e.g. saturated_max=0.4 (or None to disable it)."
            )
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
        self._at_most("min_history", "window")
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
    KL: ``kl_max``, ``kl_max_patience``, ``kl_spike_factor``, ``kl_spike_min``, ``kl_window``, ``kl_min_history``.
    Wiring: ``entropy_metric``, ``kl_metric``.
    """

    entropy_floor: float | None = documented(
        0.03, "Absolute floor in nats (mean per-token entropy); None disables it."
    )
    floor_patience: int = documented(2, "Consecutive logs below the floor before the alert.")
    max_drop: float | None = documented(
        0.9,
        "Relative drop from the early level that counts as collapse (0.9 = entropy fell to a tenth); "
        "None disables it.",
    )
    baseline_logs: int = documented(5, "Logs that define the early level (their median).")
    smoothing: int = documented(3, "Logs in the median compared with the early level.")
    kl_max: float | None = documented(1.0, "Absolute KL threshold (nats per token); None disables it.")
    kl_max_patience: int | None = documented(
        None,
        "Consecutive logs above kl_max before it fires; None: one more than the logs of a generation cycle (read "
        "from the training arguments; 2 without them), so that one batch's outlier KL is not enough.",
    )
    kl_spike_factor: float | None = documented(
        5.0, "Multiple of the largest recent KL (kl_window logs) that counts as a spike; None disables it."
    )
    kl_spike_min: float = documented(
        0.01, "Relative KL spikes below this KL are ignored (KL grows from 0 early in training)."
    )
    kl_window: int = documented(10, "Previous logs whose largest KL a spike is compared with.")
    kl_min_history: int = documented(5, "Logs needed before the relative KL rule runs.")
    entropy_metric: str = documented("entropy", "Logged key of the mean token entropy.")
    kl_metric: str = documented("kl", "Logged key of the KL to the reference (beta > 0).")

    def __post_init__(self) -> None:
        self._float("entropy_floor", 0.03, low=0.0, allow_none=True)
        self._int("floor_patience", 1, 2)
        self._float("max_drop", 0.9, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False, allow_none=True)
        self._int("baseline_logs", 1, 5)
        self._int("smoothing", 1, 3)
        self._float("kl_max", 1.0, low=0.0, low_inclusive=False, allow_none=True)
        if self.kl_max_patience is not None:
            self._int("kl_max_patience", 1, 3)
        self._float("kl_spike_factor", 5.0, low=1.0, low_inclusive=False, allow_none=True)
        self._float("kl_spike_min", 0.01, low=0.0)
        self._int("kl_window", 1, 10)
        self._int("kl_min_history", 1, 5)
        self._at_most("kl_min_history", "kl_window")
        self._key("entropy_metric", "entropy")
        self._key("kl_metric", "kl")


@dataclass(frozen=True)
class RewardMonitorConfig(_Config):
    """Settings of `RewardMonitor`: reward collapse after a rise, no learning signal, judge failures.

    Collapse: ``smoothing``, ``min_rise``, ``max_drop``, ``collapse_patience``, ``min_drop_sigmas``.
    Signal: ``zero_std_max``, ``zero_std_patience``. Answers (RLM): ``answer_drop``, ``answer_min_peak``,
    ``answer_patience``, ``answer_min_roots``. Judge: ``judge_failure_max``, ``judge_patience``,
    ``judge_injection_max``, ``judge_injection_patience``.
    Wiring: ``reward_metric``, ``zero_std_metric``, ``answer_rate_metric``, ``answer_roots_metric``,
    ``judge_failure_metric``, ``judge_injection_metric``.
    """

    smoothing: int = documented(5, "Logs in the moving average of the reward.")
    min_rise: float = documented(
        0.1,
        "Gain (in reward units) the smoothed reward must make before a collapse can be called; set it "
        "to your reward's scale (0.1 suits rewards in [0, 1]).",
    )
    max_drop: float = documented(0.5, "Fraction of the gain that must be lost (0.5 = half of it).")
    collapse_patience: int = documented(2, "Consecutive logs below the collapse threshold before the alert.")
    min_drop_sigmas: float = documented(
        6.0,
        "The loss from the peak must also be at least this many standard errors of the smoothed "
        "reward (0 disables the noise guard).",
    )
    zero_std_max: float | None = documented(
        0.9, "frac_reward_zero_std at or above this is 'no signal'; None disables the rule."
    )
    zero_std_patience: int = documented(
        3, "Consecutive logs before reward_no_signal (logs that carry the metric: one per generation in TRL)."
    )
    answer_drop: float | None = documented(
        0.5,
        "A final-answer rate (RLM trainers) below this share of its peak so far fires answer_rate_collapse; None "
        "disables the rule.",
    )
    answer_min_peak: float = documented(0.2, "The peak final-answer rate must reach this before the rule can fire.")
    answer_patience: int = documented(1, "Consecutive observations before answer_rate_collapse.")
    answer_min_roots: int = documented(
        32,
        "Logs are pooled until they hold this many root rollouts (answer_roots_metric), and each pool is one "
        "observation of the final-answer rate: a rate over a few groups moves by chance alone (an asynchronous "
        "trainer logs every optimizer step). A log without the roots count is one observation.",
    )
    judge_failure_max: float | None = documented(
        0.2, "Judge failure ratio above this fires judge_failure; None disables the rule."
    )
    judge_patience: int = documented(2, "Consecutive logs before judge_failure.")
    judge_injection_max: float | None = documented(
        None,
        "Suspected judge injections per log above this fire judge_injection (0: any); None (the default) turns the "
        "rule on (at 0) only for the logs where the judge's verdicts came as free text (judge/text_verdicts > 0: no "
        "structured output), since a task whose answers are JSON with the judge's field names would fire it on a "
        "healthy run.",
    )
    judge_injection_patience: int = documented(1, "Consecutive logs before judge_injection.")
    reward_metric: str = documented("reward", "Logged key of the mean reward.")
    zero_std_metric: str = documented(
        "frac_reward_zero_std", "Logged key of the fraction of groups whose rewards all agree."
    )
    answer_rate_metric: str = documented(
        "rlm/final_answer_rate", "Logged key of the share of root rollouts that gave a final answer (RLM trainers)."
    )
    answer_roots_metric: str = documented(
        "rlm/roots_total", "Logged key of the number of root rollouts behind that share (RLM trainers)."
    )
    judge_failure_metric: str = documented(
        "judge/failure_ratio", "Logged key of the judge's failure ratio (judge credit)."
    )
    judge_injection_metric: str = documented(
        "judge/injection_suspected",
        "Logged key of the suspected judge injections (judge credit; rubric judge: '<name>/injection_suspected', "
        "e.g. 'rubric_judge/injection_suspected').",
    )

    def __post_init__(self) -> None:
        self._int("smoothing", 1, 5)
        self._float("min_rise", 0.1, low=0.0, low_inclusive=False)
        self._float("max_drop", 0.5, low=0.0, high=1.0, low_inclusive=False)
        self._int("collapse_patience", 1, 2)
        self._float("min_drop_sigmas", 6.0, low=0.0)
        self._float("zero_std_max", 0.9, low=0.0, high=1.0, low_inclusive=False, allow_none=True)
        self._int("zero_std_patience", 1, 3)
        self._float("answer_drop", 0.5, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False, allow_none=True)
        self._float("answer_min_peak", 0.2, low=0.0, high=1.0, low_inclusive=False)
        self._int("answer_patience", 1, 1)
        self._int("answer_min_roots", 1, 32)
        self._float("judge_failure_max", 0.2, low=0.0, high=1.0, high_inclusive=False, allow_none=True)
        self._int("judge_patience", 1, 2)
        self._float("judge_injection_max", 0.0, low=0.0, allow_none=True)
        self._int("judge_injection_patience", 1, 1)
        self._key("reward_metric", "reward")
        self._key("zero_std_metric", "frac_reward_zero_std")
        self._key("answer_rate_metric", "rlm/final_answer_rate")
        self._key("answer_roots_metric", "rlm/roots_total")
        self._key("judge_failure_metric", "judge/failure_ratio")
        self._key("judge_injection_metric", "judge/injection_suspected")


@dataclass(frozen=True)
class StalenessMonitorConfig(_Config):
    """Settings of `StalenessMonitor`: the rollout pipeline of an asynchronous run (TRL's `AsyncGRPOTrainer`).

    Stale rollouts: ``max_dropped_share``, ``watch_pinned``, ``stale_patience``, ``max_staleness``.
    Starved trainer: ``max_wait_share``, ``starved_patience``.
    Wiring: ``dropped_metric``, ``samples_metric``, ``staleness_metric``, ``wait_metric``, ``step_time_metric``.
    """

    max_dropped_share: float | None = documented(
        0.5,
        "A log counts as stale-dominated when more than this share of the rollouts that reached the trainer were "
        "dropped as stale (0.5 = more dropped than trained); None disables the condition.",
    )
    watch_pinned: bool = documented(
        True,
        "Also count a log as stale-dominated when every sample trained in it was exactly max_staleness policy "
        "versions old (mean staleness at the limit) while others were dropped as stale in the same log.",
    )
    stale_patience: int = documented(3, "Consecutive stale-dominated logs before stale_rollouts fires.")
    max_staleness: int | None = documented(
        None,
        "The run's max_staleness (the pinned condition compares the mean staleness with it); None reads it from "
        "the training arguments at train begin.",
    )
    max_wait_share: float | None = documented(
        0.9,
        "trainer_starved counts a log when the trainer waited for rollouts more than this share of its step time "
        "(perf/rollout_wait_s / perf/step_s); None disables the rule.",
    )
    starved_patience: int = documented(5, "Consecutive starved logs before trainer_starved fires.")
    dropped_metric: str = documented(
        "sample/dropped_stale_total", "Logged key of the samples dropped as stale in the log's window (a count)."
    )
    samples_metric: str = documented(
        "batch/samples_per_step", "Logged key of the samples trained per optimizer step (mean over the window)."
    )
    staleness_metric: str = documented(
        "sample/staleness_mean", "Logged key of the mean staleness, in policy versions, of the samples trained."
    )
    wait_metric: str = documented(
        "perf/rollout_wait_s", "Logged key of the seconds per step the trainer waited for rollouts."
    )
    step_time_metric: str = documented("perf/step_s", "Logged key of the seconds per optimizer step.")

    def __post_init__(self) -> None:
        owner = type(self).__name__
        self._float("max_dropped_share", 0.5, low=0.0, high=1.0, high_inclusive=False, allow_none=True)
        if not isinstance(self.watch_pinned, bool):
            raise TypeError(f"{owner}: watch_pinned={self.watch_pinned!r} must be True or False.")
        self._int("stale_patience", 1, 3)
        if self.max_staleness is not None:
            self._int("max_staleness", 0, 4)
        self._float("max_wait_share", 0.9, low=0.0, high=1.0, high_inclusive=False, allow_none=True)
        self._int("starved_patience", 1, 5)
        self._key("dropped_metric", "sample/dropped_stale_total")
        self._key("samples_metric", "batch/samples_per_step")
        self._key("staleness_metric", "sample/staleness_mean")
        self._key("wait_metric", "perf/rollout_wait_s")
        self._key("step_time_metric", "perf/step_s")
