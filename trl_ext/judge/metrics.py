"""The judge-credit metrics of a batch of verdicts, written once for the synchronous and the asynchronous trainers.

As `trl_ext.rlm.metrics`, each value has the shape TRL's asynchronous trainer reduces a log window by: a rate is a
``(numerator, denominator)`` pair (Σ numerators / Σ denominators over ranks and the window, never a mean of ratios);
a count of the batch is a float. The synchronous trainer sums every part over its ranks (one generation batch), the
asynchronous worker pushes the dictionary as it is; neither logs a rate whose denominator is 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["verdict_metrics"]


def verdict_metrics(
    verdicts: Sequence[Any], label_scores: Mapping[str, float], credit_mass: float, outcome_mass: float
) -> dict[str, float | tuple[float, float]]:
    """The judge metrics of one batch of verdicts (docs/judge_credit.md, *Metrics*).

    Args:
        verdicts: one `JudgeVerdict` per rollout of the batch.
        label_scores: the labels (one ``judge/label/<label>`` count each).
        credit_mass: Σ |c| over the batch's trained completion tokens.
        outcome_mass: Σ |A| over the same tokens.

    Returns:
        ``judge/failure_ratio``, ``judge/refused_ratio``, ``judge/spans_per_rollout``, ``judge/invalid_span_ratio``
        and ``judge/share`` as pairs; ``judge/injection_suspected``, ``judge/text_verdicts`` and
        ``judge/label/<label>`` as counts.
    """
    rollouts = float(len(verdicts))
    valid = float(sum(len(verdict.spans) for verdict in verdicts))
    dropped = float(sum(len(verdict.dropped) for verdict in verdicts))
    metrics: dict[str, float | tuple[float, float]] = {
        "judge/failure_ratio": (float(sum(not verdict.ok for verdict in verdicts)), rollouts),
        "judge/refused_ratio": (float(sum(verdict.status == "unparseable" for verdict in verdicts)), rollouts),
        "judge/spans_per_rollout": (valid, rollouts),
        "judge/invalid_span_ratio": (dropped, valid + dropped),
        "judge/share": (float(credit_mass), float(credit_mass + outcome_mass)),
        "judge/injection_suspected": float(sum(verdict.injection_suspected for verdict in verdicts)),
        "judge/text_verdicts": float(sum(verdict.text_verdict for verdict in verdicts)),
    }
    for label in label_scores:
        metrics[f"judge/label/{label}"] = float(
            sum(span.label == label for verdict in verdicts for span in verdict.spans)
        )
    return metrics
