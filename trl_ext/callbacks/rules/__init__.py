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

The rules live one monitor a module: `clip_rate` (`ClipRateMonitor`), `entropy` (`EntropyMonitor`), `reward`
(`RewardMonitor`), `staleness` (`StalenessMonitor`); `series` holds what they share (`Finding`, `RuleResult`, the
series helpers) and `episode_starts`. This package re-exports every rule and helper by name.

No function here reads a log, touches a trainer or logs anything; the callbacks in `trl_ext.callbacks.monitors`
collect the series, call these rules and act on the findings. This package imports neither transformers nor torch.
"""

from .clip_rate import clip_rate_drop, clip_rate_high, clip_rate_jump, clip_rate_low, clip_rate_stuck_zero
from .entropy import entropy_baseline, entropy_collapse, kl_spike
from .reward import (
    NOISE_WINDOW,
    answer_rate_collapse,
    judge_failure,
    judge_injection,
    reward_collapse,
    reward_no_signal,
)
from .series import Finding, Memory, RuleResult, Steps, Values, episode_starts, median, noise_sigma
from .staleness import dropped_share, stale_rollouts, trainer_starved, wait_share

__all__ = [
    "NOISE_WINDOW",
    "Finding",
    "Memory",
    "RuleResult",
    "Steps",
    "Values",
    "clip_rate_drop",
    "clip_rate_high",
    "clip_rate_jump",
    "clip_rate_low",
    "clip_rate_stuck_zero",
    "dropped_share",
    "entropy_baseline",
    "entropy_collapse",
    "episode_starts",
    "judge_failure",
    "judge_injection",
    "answer_rate_collapse",
    "kl_spike",
    "median",
    "noise_sigma",
    "reward_collapse",
    "reward_no_signal",
    "stale_rollouts",
    "trainer_starved",
    "wait_share",
]
