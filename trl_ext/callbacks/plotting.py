"""One-look plot of a GRPO run's health: reward, the loss's trust-region metric (TRL's clip rate, the IPO masked
ratio: `trl_ext.losses.trust_region_metrics`), entropy, KL, judge share, an asynchronous run's staleness and
rollout wait, and alerts.

`plot_run` reads the ``log_history`` of the run's ``trainer_state.json`` and draws one PNG. It needs matplotlib,
an optional extra (``pip install 'trl-ext[plot]'``), imported only when a plot is drawn. It uses matplotlib's Agg
canvas directly, so it works headless and never changes the pyplot backend of the caller.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..losses import LOSSES, trust_region_metrics
from .alerts import ALERT_KEY_PREFIX
from .configs import ClipRateMonitorConfig, EntropyMonitorConfig, StalenessMonitorConfig
from .rules import dropped_share, wait_share

TRAINER_STATE_NAME = "trainer_state.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_STALENESS = StalenessMonitorConfig()  # the logged keys of TRL's asynchronous trainer
# Series derived from several logged keys, drawn and marked like logged ones.
WAIT_SHARE = "rollout wait / step time"
DROPPED_SHARE = "dropped as stale"

# The panel where a rule's marker goes and its metric (first present; the clip panel's: the registered losses'
# trust-region metrics); every alert also gets a line across panels.
_RULE_MARKER = {
    "clip_rate_high": ("clip", ()),
    "clip_rate_low": ("clip", ()),
    "clip_rate_stuck_zero": ("clip", ()),
    "clip_rate_drop": ("clip", ()),
    "clip_rate_jump": ("clip", ()),
    "entropy_collapse": ("entropy", ("entropy",)),
    "kl_spike": ("kl", ("kl",)),
    "reward_collapse": ("reward", ("reward",)),
    "reward_no_signal": ("reward", ("reward",)),
    "answer_rate_collapse": ("reward", ("reward",)),  # the answers' loss shows in the reward
    "judge_failure": ("judge", ("judge/failure_ratio",)),
    "judge_injection": (None, ()),  # a count, not plotted
    "stale_rollouts": ("staleness", (_STALENESS.staleness_metric,)),
    "trainer_starved": ("wait", (WAIT_SHARE,)),
}
_PERCENT_PANELS = {"clip", "judge", "wait"}
_CLIP_COLORS = ("C1", "C4", "C5", "C8", "C9")  # the clip panel's series, in the order of `_panel_series`
# Alert colours, distinct from the metric lines (C0-C3, C6, C7).
_ALERT_COLORS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "black", "gold", "navy", "crimson")


def find_trainer_state(output_dir: str | os.PathLike[str]) -> Path:
    """The ``trainer_state.json`` describing the latest state of a run.

    ``output_dir`` may be a run's output directory, a ``checkpoint-*`` directory or a ``trainer_state.json`` file.
    In an output directory, the top-level file (written by ``trainer.save_state()``, or by a monitor that stopped
    the run) and the newest ``checkpoint-*`` are compared and the one with the larger ``global_step`` wins.

    Raises:
        FileNotFoundError: nothing found, with the places looked at.
    """
    path = Path(output_dir)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist; pass the output_dir of a training run.")
    candidates = []
    top = path / TRAINER_STATE_NAME
    if top.is_file():
        candidates.append(top)
    checkpoints = sorted(
        (int(m.group(1)), child)
        for child in path.iterdir()
        if child.is_dir() and (m := _CHECKPOINT_RE.match(child.name)) and (child / TRAINER_STATE_NAME).is_file()
    )
    if checkpoints:
        candidates.append(checkpoints[-1][1] / TRAINER_STATE_NAME)
    if not candidates:
        raise FileNotFoundError(
            f"No {TRAINER_STATE_NAME} in {path} nor in a checkpoint-* folder inside it. Save one with "
            "trainer.save_state() after training, or train with save_strategy='steps'."
        )

    def global_step(candidate: Path) -> int:
        try:
            return int(json.loads(candidate.read_text()).get("global_step", 0))
        except (OSError, ValueError):
            return -1

    return max(candidates, key=lambda c: (global_step(c), c == top))


def _panel_series() -> dict[str, tuple[str, ...]]:
    """Each panel's logged keys; the clip panel's: every registered loss's trust-region metric, then the related
    fractions the losses log (``ipo/capped_ratio``)."""
    related = (key for spec in LOSSES.values() for key in spec.trust_region_related)
    return {
        "reward": ("reward",),
        "clip": tuple(dict.fromkeys((*trust_region_metrics(), *related))),
        "entropy": ("entropy",),
        "kl": ("kl",),
        "judge": ("judge/share", "judge/failure_ratio"),
        "staleness": (_STALENESS.staleness_metric, "sample/staleness_max"),
        "wait": (WAIT_SHARE,),
    }


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _series(entries: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for entry in entries:
        value = entry.get(key)
        if _finite(value) and "step" in entry:
            steps.append(int(entry["step"]))
            values.append(float(value))
    return steps, values


def _derived_series(entries: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """The series of a derived key: `WAIT_SHARE` (`wait_share` of each log holding both times) or `DROPPED_SHARE`
    (`dropped_share` of each training log of an asynchronous run, against the steps since the previous one)."""
    steps: list[int] = []
    values: list[float] = []
    previous = 0
    for entry in entries:
        if "step" not in entry:
            continue
        step = int(entry["step"])
        if key == WAIT_SHARE:
            wait, step_s = entry.get(_STALENESS.wait_metric), entry.get(_STALENESS.step_time_metric)
            share = wait_share(float(wait), float(step_s)) if _finite(wait) and _finite(step_s) else None
        else:
            samples = entry.get(_STALENESS.samples_metric)
            if not (_finite(samples) and _finite(entry.get(_STALENESS.staleness_metric))):
                continue
            dropped = entry.get(_STALENESS.dropped_metric)
            share = dropped_share(float(dropped) if _finite(dropped) else 0.0, float(samples), step - previous)
            previous = step
        if share is not None:
            steps.append(step)
            values.append(share)
    return steps, values


def _any_series(entries: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """A logged key's series, or a derived one's (`WAIT_SHARE`, `DROPPED_SHARE`)."""
    return _derived_series(entries, key) if key in (WAIT_SHARE, DROPPED_SHARE) else _series(entries, key)


def _monitor_entry(state: Mapping[str, Any], name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(constructor args, monitor_state) of the monitor ``name`` saved in ``stateful_callbacks``, or empty dicts."""
    entry = (state.get("stateful_callbacks") or {}).get(name)
    if isinstance(entry, list):
        entry = entry[-1] if entry else None
    if not isinstance(entry, Mapping):
        return {}, {}
    monitor_state = (entry.get("attributes") or {}).get("monitor_state")
    return dict(entry.get("args") or {}), dict(monitor_state) if isinstance(monitor_state, Mapping) else {}


def _blocks(steps: list[int], values: list[float], size: int) -> tuple[list[int], list[float]]:
    """Means of consecutive blocks of ``size`` values (the observations of `ClipRateMonitor`), at the block end."""
    out_steps, out_values = [], []
    for start in range(0, len(values) - size + 1, size):
        out_steps.append(steps[start + size - 1])
        out_values.append(sum(values[start : start + size]) / size)
    return out_steps, out_values


def _load_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "Plotting needs matplotlib, an optional dependency of trl-ext: pip install 'trl-ext[plot]'"
        ) from error
    return Figure, FigureCanvasAgg


def plot_run(output_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Draw the health of a GRPO run as one PNG and return its path.

    Panels (each only when its metrics were logged): reward (± its std), clip rate / IPO masked ratio in % with
    the healthy band shaded (the band of the run's `ClipRateMonitor`, default 1–20 %), entropy (with the
    `EntropyMonitor` floor), KL, judge share and failure ratio, and for an asynchronous run the staleness (mean and
    max in policy versions, the run's ``max_staleness``, the share of rollouts dropped as stale) and the rollout
    wait (share of the step time, with the `StalenessMonitor`'s ``max_wait_share``). Every ``monitor/alerts/<rule>`` in the logs is
    drawn as a vertical line across the panels and a marker on its metric's panel, with a legend of the rules.

    Args:
        output_dir: the run's output directory (or a checkpoint directory, or a ``trainer_state.json``).
        out: the PNG to write; default ``<output_dir>/monitors.png`` (next to the state file for a file path).

    Raises:
        FileNotFoundError: no ``trainer_state.json`` found.
        ValueError: the log history holds none of the metrics above.
        ImportError: matplotlib is not installed.
    """
    state_path = find_trainer_state(output_dir)
    state = json.loads(state_path.read_text())
    history = [
        entry
        for entry in state.get("log_history", [])
        if not any(str(key).startswith("eval_") for key in entry) and "train_runtime" not in entry
    ]

    panel_series = _panel_series()
    panels = [name for name, keys in panel_series.items() if any(_any_series(history, key)[0] for key in keys)]
    if not panels:
        raise ValueError(
            f"{state_path} has no reward, {', '.join(trust_region_metrics())}, entropy, kl, judge or staleness "
            "metrics in its log_history; is it a GRPO run with logging_steps set?"
        )

    alerts: dict[str, list[int]] = {}
    for entry in history:
        for key, value in entry.items():
            if key.startswith(ALERT_KEY_PREFIX) and value and "step" in entry:
                alerts.setdefault(key[len(ALERT_KEY_PREFIX) :], []).append(int(entry["step"]))

    Figure, FigureCanvasAgg = _load_matplotlib()
    fig = Figure(figsize=(11, 2.2 * len(panels) + 0.9), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    rule_colors = {rule: _ALERT_COLORS[i % len(_ALERT_COLORS)] for i, rule in enumerate(sorted(alerts))}
    clip_args, clip_state = _monitor_entry(state, "ClipRateMonitor")
    aggregate = clip_state.get("aggregate", 1)
    aggregate = aggregate if isinstance(aggregate, int) and aggregate > 1 else 1
    # The monitors' settings saved with the run; their defaults for a run without them.
    clip_defaults, entropy_defaults = ClipRateMonitorConfig(), EntropyMonitorConfig()
    band = (
        clip_args.get("healthy_min", clip_defaults.healthy_min),
        clip_args.get("healthy_max", clip_defaults.healthy_max),
    )
    entropy_args, _ = _monitor_entry(state, "EntropyMonitor")
    entropy_floor = entropy_args.get("entropy_floor", entropy_defaults.entropy_floor)
    kl_max = entropy_args.get("kl_max", entropy_defaults.kl_max)
    staleness_args, staleness_state = _monitor_entry(state, "StalenessMonitor")
    max_staleness = staleness_state.get("max_staleness", staleness_args.get("max_staleness"))
    max_wait_share = staleness_args.get("max_wait_share", _STALENESS.max_wait_share)

    for ax, panel in zip(axes, panels):
        scale = 100.0 if panel in _PERCENT_PANELS else 1.0
        if panel == "reward":
            steps, values = _series(history, "reward")
            ax.plot(steps, values, color="C0", lw=1.6, label="reward")
            std_steps, stds = _series(history, "reward_std")
            if std_steps == steps and steps:
                ax.fill_between(
                    steps,
                    [v - s for v, s in zip(values, stds)],
                    [v + s for v, s in zip(values, stds)],
                    color="C0",
                    alpha=0.15,
                    lw=0,
                    label="± reward_std",
                )
            ax.set_ylabel("reward")
        elif panel == "clip":
            ax.axhspan(
                100 * band[0],
                100 * band[1],
                color="tab:green",
                alpha=0.12,
                lw=0,
                label=f"healthy band {100 * band[0]:g}–{100 * band[1]:g}%",
            )
            for index, key in enumerate(panel_series["clip"]):
                color = _CLIP_COLORS[index % len(_CLIP_COLORS)]
                steps, values = _series(history, key)
                if not steps:
                    continue
                if aggregate > 1:  # per-log values alternate within a generation cycle: show what the monitor sees
                    ax.plot(
                        steps, [100 * v for v in values], color=color, lw=0.8, alpha=0.35, label=f"{key} (per log)"
                    )
                    obs_steps, obs_values = _blocks(steps, values, aggregate)
                    ax.plot(
                        obs_steps,
                        [100 * v for v in obs_values],
                        color=color,
                        lw=1.8,
                        marker="o",
                        ms=3,
                        label=f"{key} (mean of {aggregate} logs)",
                    )
                else:
                    ax.plot(steps, [100 * v for v in values], color=color, lw=1.4, marker=".", ms=3, label=key)
            ax.set_ylabel("clip / mask (%)")
            top = max([100 * band[1] * 1.3] + [100 * v for k in panel_series["clip"] for v in _series(history, k)[1]])
            ax.set_ylim(0, top * 1.05)
        elif panel == "entropy":
            steps, values = _series(history, "entropy")
            ax.plot(steps, values, color="C2", lw=1.6, label="entropy")
            if _finite(entropy_floor):
                ax.axhline(entropy_floor, color="0.4", ls=":", lw=1, label=f"floor {entropy_floor:g}")
            baseline_logs = entropy_args.get("baseline_logs", entropy_defaults.baseline_logs)
            max_drop = entropy_args.get("max_drop", entropy_defaults.max_drop)
            if _finite(max_drop) and isinstance(baseline_logs, int) and len(values) >= baseline_logs > 0:
                limit = (1 - max_drop) * statistics.median(values[:baseline_logs])
                ax.axhline(limit, color="C2", ls=":", lw=1, label=f"collapse: -{100 * max_drop:g}% of early level")
            ax.set_ylabel("entropy (nats)")
        elif panel == "kl":
            steps, values = _series(history, "kl")
            ax.plot(steps, values, color="C3", lw=1.6, label="kl")
            if _finite(kl_max) and values and max(values) > 0.5 * kl_max:
                ax.axhline(kl_max, color="0.4", ls=":", lw=1, label=f"kl_max {kl_max:g}")
            ax.set_ylabel("KL to reference")
        elif panel == "staleness":
            for key, color in zip(panel_series["staleness"], ("C0", "C9")):
                steps, values = _series(history, key)
                if steps:
                    ax.plot(steps, values, color=color, lw=1.4, marker=".", ms=3, label=key)
            if _finite(max_staleness):
                ax.axhline(max_staleness, color="0.4", ls=":", lw=1, label=f"max_staleness {max_staleness:g}")
            ax.set_ylabel("staleness (versions)")
            ax.set_ylim(bottom=0)
            steps, values = _derived_series(history, DROPPED_SHARE)
            if any(values):
                dropped_ax = ax.twinx()
                dropped_ax.bar(steps, [100 * v for v in values], color="C3", alpha=0.3, label=f"% {DROPPED_SHARE}")
                dropped_ax.set_ylabel(f"% {DROPPED_SHARE}")
                dropped_ax.set_ylim(0, 100)
                dropped_ax.legend(loc="upper right", fontsize=8, framealpha=0.8)
                ax.set_zorder(dropped_ax.get_zorder() + 1)  # the staleness lines over the bars
                ax.patch.set_visible(False)
        elif panel == "wait":
            steps, values = _derived_series(history, WAIT_SHARE)
            ax.plot(steps, [100 * v for v in values], color="C8", lw=1.4, marker=".", ms=3, label=WAIT_SHARE)
            if _finite(max_wait_share):
                ax.axhline(100 * max_wait_share, color="0.4", ls=":", lw=1, label=f"max_wait_share {max_wait_share:g}")
            ax.set_ylabel("rollout wait (%)")
            ax.set_ylim(bottom=0)
        else:  # judge
            for key, color in zip(panel_series["judge"], ("C6", "C7")):
                steps, values = _series(history, key)
                if steps:
                    ax.plot(steps, [100 * v for v in values], color=color, lw=1.4, label=key)
            ax.set_ylabel("judge (%)")
            ax.set_ylim(bottom=0)

        for rule, steps_fired in alerts.items():
            for step in steps_fired:
                ax.axvline(step, color=rule_colors[rule], ls="--", lw=1.1, alpha=0.8)
            marker_panel, marker_keys = _RULE_MARKER.get(rule, (None, ()))
            if marker_panel == panel:
                if panel == "clip":  # the metric the monitor watched, else the first registered one present
                    watched = clip_state.get("metric")
                    marker_keys = (watched,) if watched in trust_region_metrics() else trust_region_metrics()
                by_step: dict[int, float] = {}
                for key in marker_keys:
                    steps, values = _any_series(history, key)
                    if panel == "clip" and aggregate > 1:
                        steps, values = _blocks(steps, values, aggregate)
                    for s, v in zip(steps, values):
                        by_step.setdefault(s, v)
                points = [(s, by_step[s] * scale) for s in steps_fired if s in by_step]
                if points:
                    ax.scatter(
                        *zip(*points),
                        color=rule_colors[rule],
                        marker="v",
                        s=60,
                        zorder=5,
                        edgecolors="black",
                        linewidths=0.5,
                    )
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8, framealpha=0.8)

    axes[-1].set_xlabel("global step")
    last_step = state.get("global_step", max((int(e["step"]) for e in history if "step" in e), default=0))
    run_dir = Path(output_dir).resolve()
    run_dir = run_dir.parent if run_dir.is_file() else run_dir
    title = f"{run_dir.name}: {last_step} steps"
    max_steps = state.get("max_steps")
    if isinstance(max_steps, int) and 0 < last_step < max_steps:
        final = sorted(rule for rule, fired in alerts.items() if last_step in fired)
        title += f" of {max_steps}, stopped early" + (f" after {', '.join(final)}" if final else "")
    fig.suptitle(title, fontsize=12, x=0.01, ha="left", fontweight="bold")
    if alerts:
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color=rule_colors[r], ls="--", marker="v", lw=1.1) for r in sorted(alerts)]
        labels = [f"{r}: {len(alerts[r])}x, first at step {min(alerts[r])}" for r in sorted(alerts)]
        fig.legend(
            handles,
            labels,
            loc="outside lower center",
            ncol=min(3, len(labels)),
            fontsize=9,
            title="monitor alerts (dashed lines)",
            title_fontsize=9,
            frameon=False,
        )
    else:
        axes[-1].set_title("no monitor alerts", fontsize=9, color="0.3", loc="right")

    if out is None:
        base = state_path.parent if Path(output_dir).is_file() else Path(output_dir)
        out = base / "monitors.png"
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
