"""`evaluate` module: character-span overlap F1 of predicted vs gold evidence spans (trl-ext).

Wraps `trl_ext.rewards.span_f1` (definitions there). Inputs, one entry per example:

- ``predictions``: the model's answer text, read like the reward reads it (a JSON list of quotes and/or
  ``[start, end]`` offsets, or ``{"spans": [...]}``; otherwise the whole text is one quote), or a list of quotes;
- ``references``: the gold spans, as a JSON list (quotes and/or offsets) or a single quote string, or a list of
  quotes;
- ``contexts``: the text the spans point into (always a string: quotes are located in it and offsets are
  bound-checked against it).

Returns the means over examples of ``f1``, ``precision`` and ``recall``.
"""

import datasets
import evaluate

from trl_ext.rewards.span_f1 import char_span_scores, parse_gold_spans, parse_predicted_spans

_DESCRIPTION = "Character-span overlap F1 (2·O / (P + G)) of predicted vs gold evidence spans, averaged over examples."
_KWARGS_DESCRIPTION = """
Args:
    predictions: answer texts (JSON span lists or a quote) or lists of quotes.
    references: gold spans: JSON span lists, single quotes, or lists of quotes.
    contexts: the contexts the spans point into (strings).
    empty_score: score of an example where both sides are empty (default 1.0).
Returns:
    f1, precision, recall: means over the examples.
Example:
    >>> metric = evaluate.load(trl_ext.rewards.metrics.metric_path("char_span_f1"))
    >>> metric.compute(predictions=['["cat sat"]'], references=["[[4, 11]]"], contexts=["The cat sat on the mat."])
    {'f1': 1.0, 'precision': 1.0, 'recall': 1.0}
"""
_CITATION = ""


class CharSpanF1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=[
                datasets.Features(
                    {
                        "predictions": datasets.Value("string"),
                        "references": datasets.Value("string"),
                        "contexts": datasets.Value("string"),
                    }
                ),
                datasets.Features(
                    {
                        "predictions": datasets.Sequence(datasets.Value("string")),
                        "references": datasets.Sequence(datasets.Value("string")),
                        "contexts": datasets.Value("string"),
                    }
                ),
            ],
        )

    def _compute(self, predictions, references, contexts, empty_score=1.0):
        if not predictions:
            raise ValueError("char_span_f1 got no examples.")
        totals = {"f1": 0.0, "precision": 0.0, "recall": 0.0}
        for prediction, reference, context in zip(predictions, references, contexts):
            predicted = parse_predicted_spans(prediction) if isinstance(prediction, str) else list(prediction)
            gold = parse_gold_spans(reference) if isinstance(reference, str) else list(reference)
            scores = char_span_scores(predicted, gold, context, empty_score=empty_score)
            totals["f1"] += scores.f1
            totals["precision"] += scores.precision
            totals["recall"] += scores.recall
        return {name: value / len(predictions) for name, value in totals.items()}
