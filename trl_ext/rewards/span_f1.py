"""Character-span overlap F1 of predicted vs gold evidence spans, the verifiable baseline (docs/char_span_f1.md).

The RLM blog started from this reward and replaced it by the rubric judge (`trl_ext.rewards.rubric`) because it was
too noisy; it stays here for comparison runs and for filtering cold-start traces (`trl_ext.sft`).

**Spans.** A side (predicted or gold) is a list whose items are any of:

- ``(start, end)`` (a tuple or a two-item list of ints, as JSON gives it) or ``{"start": s, "end": e}``: the
  half-open character range ``context[start:end]``; ``0 <= start <= end`` (and ``end <= len(context)`` when a
  context is given). An empty range counts for nothing.
- a string: a quote, located at its **first exact occurrence** in ``context`` (case and whitespace matter). A quote
  that does not occur in the context (or any quote when no context is given) still counts ``len(quote)``
  characters on its side, none of them overlapping the other side: an invented quote lowers precision, a gold
  quote that cannot be found lowers recall. The empty string counts for nothing.

Each side is the **union** of its ranges (overlapping or repeated spans count once). With ``P`` and ``G`` the
character counts of the predicted and gold sides and ``O`` the characters in both::

    precision = O / P,   recall = O / G,   F1 = 2·O / (P + G)

Both sides empty: precision = recall = F1 = ``empty_score`` (default 1.0: nothing to find, nothing claimed). Exactly
one side empty: all three are 0.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..text import completion_text, final_answer_text

SpanItem = tuple[int, int] | Sequence[int] | Mapping[str, int] | str


@dataclass(frozen=True)
class SpanScores:
    """Overlap scores of one predicted/gold pair (see the module docstring for the definitions).

    Attributes:
        precision, recall, f1: in [0, 1].
        predicted_chars: ``P``, characters on the predicted side (union, unlocated quotes included).
        gold_chars: ``G``, characters on the gold side.
        overlap_chars: ``O``, characters in both.
        unlocated_predicted: predicted quotes not found in the context.
        unlocated_gold: gold quotes not found in the context.
    """

    precision: float
    recall: float
    f1: float
    predicted_chars: int
    gold_chars: int
    overlap_chars: int
    unlocated_predicted: int = 0
    unlocated_gold: int = 0


def char_span_scores(
    predicted: Sequence[SpanItem],
    gold: Sequence[SpanItem],
    context: str | None = None,
    *,
    empty_score: float = 1.0,
) -> SpanScores:
    """Precision, recall and F1 of the character overlap of ``predicted`` and ``gold`` spans.

    Args:
        predicted: the predicted spans (see the module docstring for the accepted items).
        gold: the gold evidence spans, same forms.
        context: the text the spans point into; needed to locate quotes and to bound-check offsets.
        empty_score: the scores when both sides are empty.

    Raises:
        TypeError: a side is a bare string (wrap it in a list) or holds an item of an unknown form.
        ValueError: an offset range is negative, reversed or past the end of ``context``.
    """
    predicted_ranges, predicted_extra, predicted_unlocated = _locate(predicted, context, "predicted")
    gold_ranges, gold_extra, gold_unlocated = _locate(gold, context, "gold")
    predicted_union, gold_union = _union(predicted_ranges), _union(gold_ranges)
    predicted_chars = _length(predicted_union) + predicted_extra
    gold_chars = _length(gold_union) + gold_extra
    overlap = _overlap(predicted_union, gold_union)
    if predicted_chars == 0 and gold_chars == 0:
        precision = recall = f1 = float(empty_score)
    elif predicted_chars == 0 or gold_chars == 0:
        precision = recall = f1 = 0.0
    else:
        precision, recall = overlap / predicted_chars, overlap / gold_chars
        f1 = 2 * overlap / (predicted_chars + gold_chars)
    return SpanScores(
        precision=precision,
        recall=recall,
        f1=f1,
        predicted_chars=predicted_chars,
        gold_chars=gold_chars,
        overlap_chars=overlap,
        unlocated_predicted=predicted_unlocated,
        unlocated_gold=gold_unlocated,
    )


def char_span_f1(
    predicted: Sequence[SpanItem],
    gold: Sequence[SpanItem],
    context: str | None = None,
    *,
    empty_score: float = 1.0,
) -> float:
    """Character-span overlap F1, ``2·O / (P + G)`` (see `char_span_scores` and the module docstring).

    Example:
        >>> context = "The cat sat on the mat."
        >>> char_span_f1(["cat sat"], [(4, 11)], context)  # same 7 characters
        1.0
        >>> char_span_f1([(0, 7)], [(4, 11)], context)  # "The cat" vs "cat sat": 3 shared of 7 + 7
        0.42857142857142855
    """
    return char_span_scores(predicted, gold, context, empty_score=empty_score).f1


def parse_predicted_spans(answer: str) -> list[SpanItem]:
    """Read predicted spans from a model's answer text.

    In order: a JSON list of spans (quotes and/or ``[start, end]`` pairs), or a JSON object whose ``"spans"`` or
    ``"evidence"`` key holds such a list; otherwise the whole answer, stripped, is one quote (nothing if empty).
    """
    text = answer.strip()
    if not text:
        return []
    if text[:1] in "[{":
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if isinstance(value, Mapping):
            value = value.get("spans", value.get("evidence"))
        if isinstance(value, list) and all(_is_span_item(item) for item in value):
            return value
    return [text]


def parse_gold_spans(value: Any) -> list[SpanItem]:
    """Gold spans from a dataset cell: a list of span items, a JSON string of one, or a single quote string."""
    if value is None:
        return []
    if isinstance(value, str):
        stripped = value.strip()
        if stripped[:1] == "[":
            try:
                parsed = json.loads(stripped)
            except ValueError:
                parsed = None
            if isinstance(parsed, list):
                return parsed
        return [value] if value else []
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        if len(value) == 2 and all(_is_int(v) for v in value):
            return [tuple(value)]  # a single (start, end) pair
        return list(value)
    raise TypeError(
        f"Gold spans must be a list of spans, a JSON string of one, or a quote; got {type(value).__name__}."
    )


class CharSpanF1Reward:
    """Char-span F1 as a TRL reward function: ``(prompts, completions, **columns) -> list[float]``.

    The prediction is the completion's final answer (the last ``FINAL(...)`` when present, else the whole text;
    conversational completions use their assistant messages), read by `parse_predicted_spans`. The gold spans come
    from the dataset column ``gold_column`` (`parse_gold_spans`) and the context from ``context_column``.

    Args:
        gold_column: dataset column with the gold evidence spans.
        context_column: dataset column with the context the spans point into; ``None`` when all spans are offsets
            that need no bound check (quotes then never locate).
        empty_score: reward when neither side has a span.
        name: the function's ``__name__``, used by TRL for the metric name (``rewards/<name>/mean``).

    Example:
        >>> reward = CharSpanF1Reward(gold_column="evidence", context_column="context")
        >>> reward(prompts=["q"], completions=['FINAL(["cat sat"])'], evidence=[[[4, 11]]],
        ...        context=["The cat sat on the mat."])
        [1.0]
    """

    def __init__(
        self,
        gold_column: str = "evidence",
        context_column: str | None = "context",
        *,
        empty_score: float = 1.0,
        name: str = "char_span_f1",
    ):
        if not gold_column:
            raise ValueError("gold_column must name the dataset column that holds the gold spans, e.g. 'evidence'.")
        self.gold_column = gold_column
        self.context_column = context_column
        self.empty_score = empty_score
        self.__name__ = name

    @property
    def required_columns(self) -> list[str]:
        """The dataset columns this reward reads (trl-ext's trainers check them when they are built)."""
        return [self.gold_column] + ([self.context_column] if self.context_column is not None else [])

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        golds = _column(kwargs, self.gold_column, len(completions))
        contexts = (
            _column(kwargs, self.context_column, len(completions))
            if self.context_column is not None
            else [None] * len(completions)
        )
        rewards = []
        for completion, gold, context in zip(completions, golds, contexts, strict=True):
            predicted = parse_predicted_spans(final_answer_text(completion_text(completion)))
            rewards.append(char_span_f1(predicted, parse_gold_spans(gold), context, empty_score=self.empty_score))
        return rewards


# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------
def _column(kwargs: Mapping[str, Any], name: str, length: int) -> list[Any]:
    if name not in kwargs:
        available = sorted(
            k for k in kwargs if k not in ("trainer_state", "log_extra", "log_metric", "completion_ids")
        )
        raise KeyError(
            f"The reward needs the dataset column {name!r}, which the batch does not have (columns: {available}). "
            "Add the column to the dataset or pass the right column name."
        )
    values = list(kwargs[name])
    if len(values) != length:
        raise ValueError(f"Column {name!r} has {len(values)} values for {length} completions.")
    return values


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_span_item(item: Any) -> bool:
    if isinstance(item, str):
        return True
    if isinstance(item, Mapping):
        return _is_int(item.get("start")) and _is_int(item.get("end"))
    return isinstance(item, (list, tuple)) and len(item) == 2 and all(_is_int(v) for v in item)


def _locate(spans: Sequence[SpanItem], context: str | None, side: str) -> tuple[list[tuple[int, int]], int, int]:
    """Ranges of the located spans, characters of the unlocated quotes, and how many quotes were unlocated."""
    if isinstance(spans, (str, bytes)):
        raise TypeError(f"The {side} spans must be a list; wrap the single quote in a list: [{spans!r}].")
    if not isinstance(spans, Sequence):
        raise TypeError(f"The {side} spans must be a list of spans, got {type(spans).__name__}.")
    ranges: list[tuple[int, int]] = []
    extra, unlocated = 0, 0
    for item in spans:
        if isinstance(item, str):
            if not item:
                continue
            start = context.find(item) if context is not None else -1
            if start < 0:
                extra += len(item)
                unlocated += 1
            else:
                ranges.append((start, start + len(item)))
            continue
        if isinstance(item, Mapping):
            start, end = item.get("start"), item.get("end")
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            start, end = item
        else:
            raise TypeError(
                f"Unknown {side} span {item!r}: use a quote string, a (start, end) pair of ints or "
                '{"start": s, "end": e}.'
            )
        if not (_is_int(start) and _is_int(end)):
            raise TypeError(f"The {side} span {item!r} must hold integer character offsets.")
        if start < 0 or end < start:
            raise ValueError(f"The {side} span {item!r} is not a half-open range [start, end) with 0 <= start <= end.")
        if context is not None and end > len(context):
            raise ValueError(
                f"The {side} span {item!r} ends past the context ({len(context)} characters); offsets index the "
                "context the spans were taken from."
            )
        if end > start:
            ranges.append((start, end))
    return ranges, extra, unlocated


def _union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(ranges: list[tuple[int, int]]) -> int:
    return sum(end - start for start, end in ranges)


def _overlap(first: list[tuple[int, int]], second: list[tuple[int, int]]) -> int:
    """Characters shared by two sorted, disjoint range lists (two-pointer sweep)."""
    i = j = total = 0
    while i < len(first) and j < len(second):
        low, high = max(first[i][0], second[j][0]), min(first[i][1], second[j][1])
        if high > low:
            total += high - low
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return total
