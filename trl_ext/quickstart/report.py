"""What a quickstart run produced (`QuickstartResult`) and what it leaves in the output directory about itself
(`quickstart_run_info`: its ``trl_ext_run.json``, read by ``trl-ext push``); `result_from_history` reads a result
from a trainer's log history and monitors.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trl_ext.methods import METHODS
from trl_ext.run_info import RunInfo, trust_region_summary_key

from .evaluation import EvalResult
from .settings import QuickstartSettings


@dataclass
class QuickstartResult:
    """What a quickstart run produced; `to_dict` is what ``trl_ext_run.json`` holds (with the settings)."""

    method: str
    output_dir: Path
    seed: int
    fast: bool
    wall_time_s: float
    train_steps: int
    adapter_dir: Path
    plot_file: Path | None
    reward_first: float | None
    reward_last: float | None
    train_rewards: list[float]
    trust_region_metric: str | None  # the loss's trust-region metric found in the log (`trl_ext.losses`)
    trust_region_mean: float | None
    trust_region_max: float | None
    alerts: dict[str, int]
    alert_log: list[dict[str, Any]]
    before: EvalResult | None = None
    after: EvalResult | None = None
    stage_times_s: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("output_dir", "adapter_dir", "plot_file"):
            data[key] = None if data[key] is None else str(data[key])
        return data


def quickstart_run_info(result: QuickstartResult, settings: QuickstartSettings) -> RunInfo:
    """The run file of a quickstart run (``trl_ext_run.json``, `trl_ext.run_info.RunInfo`, read by ``trl-ext push``);
    ``extra`` holds the settings (``settings``) and the whole `QuickstartResult` (``result``)."""
    return RunInfo(
        source="trl-ext quickstart",
        method=result.method,
        trainer=METHODS[result.method].trainer,
        base_model=result.extra.get("base_model"),
        dataset=result.extra.get("task"),
        config=result.extra.get("config", {}),
        metrics=_final_metrics(result),
        steps=result.train_steps,
        alerts=result.alerts,
        alert_log=result.alert_log,
        sandbox=result.extra.get("sandbox"),
        extra={"settings": asdict(settings), "result": result.to_dict()},
    )


def _final_metrics(result: QuickstartResult) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    if result.before is not None and result.after is not None:
        metrics["eval/reward_sft_only"] = round(result.before.reward, 4)
        metrics["eval/reward_after_rl"] = round(result.after.reward, 4)
        metrics["eval/rollouts"] = result.after.rollouts
    if result.reward_first is not None:
        metrics["train/reward_first"] = round(result.reward_first, 4)
    if result.reward_last is not None:
        metrics["train/reward_last"] = round(result.reward_last, 4)
    if result.trust_region_metric is not None and result.trust_region_mean is not None:
        metrics[trust_region_summary_key(result.trust_region_metric)] = round(result.trust_region_mean, 4)
    metrics["train/steps"] = result.train_steps
    return metrics


def result_from_history(
    method: str,
    output: Path,
    settings: QuickstartSettings,
    fast: bool,
    history: Sequence[dict[str, Any]],
    monitors: Sequence[Any],
    adapter_dir: Path,
    plot_file: Path | None,
) -> QuickstartResult:
    """A trained run's result from its trainer's log history (rewards, the loss's trust-region metric, steps) and its monitors'
    alerts; the held-out evaluations and ``extra`` are the pipeline's to fill in."""
    rewards = [h["reward"] for h in history if isinstance(h.get("reward"), (int, float))]
    from trl_ext.losses import trust_region_metrics  # torch: loaded by the training that wrote ``history``

    logged = [key for key in trust_region_metrics() if any(isinstance(h.get(key), (int, float)) for h in history)]
    metric = logged[0] if logged else None
    masked = [h[metric] for h in history if isinstance(h.get(metric), (int, float))] if metric else []
    alerts: Counter[str] = Counter()
    alert_log: list[dict[str, Any]] = []
    for monitor in monitors:
        alerts.update(monitor.alert_counts)
        alert_log.extend({"monitor": type(monitor).__name__, **record} for record in monitor.alerts)
    steps = max((int(h.get("step", 0)) for h in history), default=0)
    return QuickstartResult(
        method=method,
        output_dir=output,
        seed=settings.seed,
        fast=fast,
        wall_time_s=0.0,
        train_steps=steps,
        adapter_dir=adapter_dir,
        plot_file=plot_file,
        reward_first=rewards[0] if rewards else None,
        reward_last=rewards[-1] if rewards else None,
        train_rewards=rewards,
        trust_region_metric=metric,
        trust_region_mean=statistics.fmean(masked) if masked else None,
        trust_region_max=max(masked) if masked else None,
        alerts=dict(sorted(alerts.items())),
        alert_log=sorted(alert_log, key=lambda record: record.get("step", 0)),
    )


def history_mean(history: Sequence[dict[str, Any]], key: str) -> float | None:
    """Mean of the finite values logged under ``key`` (None when there are none)."""
    values = [h[key] for h in history if isinstance(h.get(key), (int, float)) and math.isfinite(h[key])]
    return statistics.fmean(values) if values else None
