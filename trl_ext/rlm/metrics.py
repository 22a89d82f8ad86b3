"""The metrics of a batch of RLM rollouts, written once for the synchronous and the asynchronous trainers.

Each value has the shape TRL's asynchronous trainer reduces a log window by, so one dictionary serves both:

- a ``(numerator, denominator)`` pair is a rate: Σ numerators / Σ denominators over ranks and the log window (never
  a mean of ratios);
- a name whose last part has the word ``total`` is a counter: summed;
- a name whose last part has the word ``max`` is an extremum: the largest.

The synchronous trainers reduce the same dictionary over ranks (`trl_seam.GRPOSeam.log_rollout_metrics`); the
asynchronous RLM worker pushes it to TRL's metrics queue as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

from .stats import EngineStats
from .tree import RolloutTree

__all__ = ["MetricValue", "rollout_metrics"]

MetricValue = float | tuple[float, float]


def rollout_metrics(trees: Sequence[RolloutTree], stats: EngineStats, num_rows: int) -> dict[str, MetricValue]:
    """The RLM metrics of one batch of rollouts (docs/stepwise_rlm.md, *Logged metrics*).

    Args:
        trees: the batch's rollout trees (one per root).
        stats: the engine's counters for the batch.
        num_rows: the training samples the trees became (one per turn of every node trained).

    Returns:
        Rates as ``(numerator, denominator)`` pairs (a denominator may be 0: no value for that batch), counters
        (``*_total``) and extrema (``*_max``) as floats.
    """
    roots = float(len(trees))
    nodes = [node for tree in trees for node in tree.nodes]
    children = [node for tree in trees for node in tree.nodes[1:]]
    cells = float(stats.repl_cells)
    return {
        "rlm/turns_mean": (float(sum(len(node.turns) for node in nodes)), float(len(nodes))),
        "rlm/children_mean": (float(len(children)), roots),
        "rlm/child_answer_rate": (
            float(sum(node.final_answer is not None for node in children)),
            float(len(children)),
        ),
        "rlm/final_answer_rate": (float(sum(tree.final_answer is not None for tree in trees)), roots),
        "rlm/roots_total": roots,
        "rlm/rows_per_root": (float(num_rows), roots),
        "rlm/depth_max": float(max((node.depth for node in nodes), default=0)),
        "repl/error_rate": (float(stats.repl_errors), cells),
        "repl/timeout_rate": (float(stats.repl_timeouts), cells),
        "repl/crash_rate": (float(stats.repl_crashes), cells),
        "repl/truncated_answers_total": float(stats.truncated_answers),
        "rlm/prompt_too_long_total": float(stats.prompt_too_long),
        "rlm/refused_queries_total": float(stats.refused_queries),
    }
