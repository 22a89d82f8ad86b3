"""`trl_ext.judge.metrics.verdict_metrics`, the judge metrics both judge-credit trainers log, against hand counts."""

from trl_ext.judge import DEFAULT_LABEL_SCORES, Span
from trl_ext.judge.judge import JudgeVerdict
from trl_ext.judge.metrics import verdict_metrics
from trl_ext.judge.spans import DroppedSpan


def span(label: str) -> Span:
    return Span(start=0, end=1, label=label, confidence=1.0, quote="x")


def test_rates_are_pairs_and_counts_are_counts():
    verdicts = [
        JudgeVerdict(
            "ok",
            spans=[span("original_error"), span("key_progress")],
            dropped=[DroppedSpan("out_of_range", "end > tokens", {})],
        ),
        JudgeVerdict("ok", spans=[span("original_error")], text_verdict=True),
        JudgeVerdict("unparseable", injection_suspected=True),
        JudgeVerdict("failed"),
    ]
    metrics = verdict_metrics(verdicts, DEFAULT_LABEL_SCORES, credit_mass=1.5, outcome_mass=4.5)
    assert metrics["judge/failure_ratio"] == (2.0, 4.0)
    assert metrics["judge/refused_ratio"] == (1.0, 4.0)
    assert metrics["judge/spans_per_rollout"] == (3.0, 4.0)
    assert metrics["judge/invalid_span_ratio"] == (1.0, 4.0)
    assert metrics["judge/share"] == (1.5, 6.0)
    assert metrics["judge/injection_suspected"] == 1.0 and metrics["judge/text_verdicts"] == 1.0
    assert metrics["judge/label/original_error"] == 2.0 and metrics["judge/label/key_progress"] == 1.0
    assert {name for name in metrics if name.startswith("judge/label/")} == {
        f"judge/label/{label}" for label in DEFAULT_LABEL_SCORES
    }
