"""What every monitor rule shares: the rule's result (`Finding`, `RuleResult`), the series helpers, and
`episode_starts`, which turns a rule's findings into alerts (the rule contract is in `trl_ext.callbacks.rules`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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


def append_window(values: list[float], value: float, size: int) -> list[float]:
    """``values`` with ``value`` appended, keeping the last ``size``."""
    return [*values, value][-size:]


def rolling_reference(history: Sequence[float], window: int, min_history: int) -> float | None:
    """Median of the last ``window`` values of ``history``, or None with fewer than ``min_history`` of them."""
    return median(history[-window:]) if len(history) >= min_history else None


def consecutive(
    rule: str,
    values: Values,
    steps: Steps,
    abnormal: Callable[[float], bool],
    patience: int,
    memory: Mapping[str, Any] | None,
    enabled: bool = True,
    at_once: Callable[[float], bool] | None = None,
) -> RuleResult:
    """Findings where ``abnormal`` has held for ``patience`` consecutive observations, or where ``at_once`` holds
    (and ``enabled``)."""
    streak = int((memory or {}).get("streak", 0))
    findings = []
    for step, x in zip(steps, values):
        streak = streak + 1 if abnormal(x) else 0
        if enabled and (streak >= patience or (at_once is not None and at_once(x))):
            findings.append(Finding(rule, step, x, facts={"streak": streak}))
    return RuleResult(findings, {"streak": streak})


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
