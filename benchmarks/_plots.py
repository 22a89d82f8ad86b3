"""Curves over seeds for the evidence studies, drawn as `trl-ext plot` draws a run: matplotlib's Agg canvas (headless,
the caller's pyplot backend untouched), one panel per metric, shared x axis.

`plot_curves` draws, per panel and arm, the mean over seeds as a line and the range over seeds (min to max) as a
band, so a reader sees at once whether arms differ by more than seeds do. The PNGs go to ``benchmarks/images/``,
which RESULTS.md links.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

IMAGES = Path(__file__).with_name("images")

# panel title -> arm label -> one series per seed: (x values, y values)
Curves = Mapping[str, Mapping[str, Sequence[tuple[Sequence[float], Sequence[float]]]]]


def _band(
    series: Sequence[tuple[Sequence[float], Sequence[float]]],
) -> tuple[list[float], list[float], list[float], list[float]]:
    """x, mean, min and max over the seeds' series at the x values all of them have."""
    common = sorted(set.intersection(*(set(xs) for xs, _ in series))) if series else []
    points = [dict(zip(xs, ys)) for xs, ys in series]
    mean = [sum(p[x] for p in points) / len(points) for x in common]
    low = [min(p[x] for p in points) for x in common]
    high = [max(p[x] for p in points) for x in common]
    return common, mean, low, high


def plot_curves(
    curves: Curves, name: str, title: str, xlabel: str = "optimizer step", log_panels: Sequence[str] = ()
) -> Path:
    """Draw ``curves`` into ``benchmarks/images/<name>.png`` and return the path (a path relative to RESULTS.md is
    ``images/<name>.png``); the panels named in ``log_panels`` get a logarithmic y axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [panel for panel, arms in curves.items() if any(arms.values())]
    columns = 2 if len(panels) > 2 else 1
    rows = -(-len(panels) // columns)
    fig = Figure(figsize=(6.0 * columns, 2.6 * rows + 0.8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax, panel in zip(axes, panels):
        for index, (arm, series) in enumerate(curves[panel].items()):
            xs, mean, low, high = _band(series)
            if not xs:
                continue
            ax.plot(xs, mean, color=f"C{index}", lw=1.6, label=arm)
            ax.fill_between(xs, low, high, color=f"C{index}", alpha=0.18, lw=0)
        ax.set_title(panel + (" (log scale)" if panel in log_panels else ""), fontsize=10)
        if panel in log_panels:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    if panels:
        axes[0].legend(fontsize=7, loc="best")
    fig.suptitle(f"{title} (line: mean over seeds; band: min to max)", fontsize=10)
    IMAGES.mkdir(exist_ok=True)
    path = IMAGES / f"{name}.png"
    fig.savefig(path)
    return path
