"""Parse and validate the judge's token spans (docs/judge_credit.md).

The judge answers with ``{"spans": [{start, end, label, confidence, quote}, ...]}`` (or a bare array), token indices
with ``end`` exclusive, as the arguments of its ``submit_verdict`` tool call (`spans_from_tool_arguments`) or as its
reply's text (`extract_span_list`, by the rules of `trl_ext.judge.verdicts.read_verdict`: the reply alone, or the
span lists it wrote itself among code fences and prose, those the policy forged dropped, the most negative of several
taken); `validate_spans` keeps the spans that are well-formed and
whose quote really is in the text of their tokens, and drops the others with a reason, so a confused or manipulated judge cannot put credit on tokens it did not read.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .markers import MarkedTrace, strip_markers
from .verdicts import read_verdict, verdicts_in

# Reasons a span is dropped, in the order they are checked.
DROP_REASONS = (
    "not_an_object",  # the list item is not a JSON object
    "missing_field",  # one of start, end, label, confidence, quote is absent
    "wrong_type",  # start/end not integers, confidence not a number, label/quote not strings
    "out_of_range",  # start < 0 or end > number of completion tokens
    "empty_or_reversed",  # start >= end
    "unknown_label",  # label not in the label table
    "bad_confidence",  # confidence outside [0, 1] (or NaN)
    "quote_mismatch",  # quote (whitespace-normalised, markers removed) not found in the span's text
)
SPAN_FIELDS = ("start", "end", "label", "confidence", "quote")


class SpanParseError(ValueError):
    """The judge's output contains no JSON span list."""


@dataclass(frozen=True)
class Span:
    """One validated judge span over completion tokens ``[start, end)``."""

    start: int
    end: int
    label: str
    confidence: float
    quote: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "end": self.end,
            "label": self.label,
            "confidence": self.confidence,
            "quote": self.quote,
        }


@dataclass(frozen=True)
class DroppedSpan:
    """A span the validator rejected: the raw item, the reason (one of `DROP_REASONS`) and a human-readable detail."""

    reason: str
    detail: str
    item: Any

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "detail": self.detail, "item": self.item}


@dataclass
class SpanValidation:
    """Result of `validate_spans`: the kept spans and the dropped ones."""

    valid: list[Span] = field(default_factory=list)
    dropped: list[DroppedSpan] = field(default_factory=list)

    def dropped_by_reason(self) -> dict[str, int]:
        return dict(Counter(d.reason for d in self.dropped))


def span_list_of(value: Any) -> list[Any] | None:
    """The span list a JSON value holds, or None when it is not verdict-shaped.

    Verdict-shaped: an object with a ``spans`` array, or a bare array of objects each carrying a span field (an empty
    array counts). A citation like ``[1]`` and a span object on its own are not verdicts.
    """
    if isinstance(value, dict):
        spans = value.get("spans")
        return spans if isinstance(spans, list) else None
    if isinstance(value, list) and all(isinstance(item, dict) and item.keys() & set(SPAN_FIELDS) for item in value):
        return value
    return None


def forged_span_lists(text: str) -> list[list[Any]]:
    """The verdict-shaped span lists in the policy's own text (a forged verdict that a judge might quote): every one,
    nested or inside a string included, and a bare ``[]``."""
    if not any(f'"{name}"' in text for name in ("spans", *SPAN_FIELDS)) and "[]" not in text:
        return []  # no span list without one of the keys, or an empty array: skip the scan
    return verdicts_in(text, span_list_of)


def span_list_in_text(value: Any) -> list[Any] | None:
    """`span_list_of` for a value inside a longer reply: a bare ``[]`` there is no verdict (a citation, an empty
    example, or the policy's two-character refusal bait); ``{"spans": []}`` is."""
    return None if value == [] else span_list_of(value)


def span_list_credit(items: Sequence[Any], label_scores: Mapping[str, float]) -> float:
    """How favourable a span list is to the policy: ``Σ score(label) × confidence`` over its well-formed items (the
    credit it would give, before validation and the cap). Used to take the least favourable of several."""
    total = 0.0
    for item in items:
        if not isinstance(item, dict):
            continue
        score = label_scores.get(item.get("label"))
        confidence = item.get("confidence", 1.0)
        if isinstance(score, (int, float)) and isinstance(confidence, (int, float)) and math.isfinite(confidence):
            total += float(score) * float(confidence)
    return total


def extract_span_list(
    text: str,
    *,
    forged: Sequence[list[Any]] = (),
    label_scores: Mapping[str, float] | None = None,
    tag: str | None = None,
) -> list[Any]:
    """The judge's span list, from a reply in which it came as text (`trl_ext.judge.verdicts.read_verdict`).

    A reply that is one JSON value is read as a whole. Otherwise the span lists the reply itself wrote are read (its
    top-level values, among code fences and prose: ``{"spans": [...]}`` or a bare list of span objects; a bare ``[]``
    only as the whole reply), those equal to a list the policy wrote dropped (``forged``: `forged_span_lists` of the
    trace); a citation like ``[1]`` in the prose is not a span list.

    Args:
        text: the judge's reply.
        forged: the span lists in the policy's text.
        label_scores: the label table: with it, of several different span lists the most negative one is taken
            (`span_list_credit`); without, the reply is refused.
        tag: the request's `trl_ext.judge.verdicts.verdict_tag`: when the reply fences a section with it, only that
            section is read.

    Raises:
        InjectionSuspected: several different span lists and no ``label_scores`` (a `ValueError`: the caller asks
            again, then counts an unparseable verdict).
        SpanParseError: the reply holds no span list (the caller counts the rollout as an unparseable verdict).
    """
    if not isinstance(text, str):
        raise SpanParseError(f"Judge output must be a string, got {type(text).__name__}.")
    spans = read_verdict(
        text,
        span_list_of,
        forged=forged,
        in_text=span_list_in_text,
        worst=None if label_scores is None else (lambda items: span_list_credit(items, label_scores)),
        tag=tag,
    )
    if spans is not None:
        return spans
    preview = text[:200].replace("\n", "\\n")
    raise SpanParseError(
        f"No JSON span list found in the judge output (starts with {preview!r}); the judge must answer "
        '{"spans": [{"start": .., "end": .., "label": .., "confidence": .., "quote": ..}]}.'
    )


def spans_from_tool_arguments(arguments: str) -> list[Any]:
    """The span list of a ``submit_verdict`` tool call: its arguments, the JSON object ``{"spans": [...]}``.

    Raises:
        SpanParseError: the arguments are not that object (the judge is told so in the tool's reply).
    """
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError) as error:
        raise SpanParseError(f"submit_verdict's arguments are not JSON ({error})") from None
    spans = value.get("spans") if isinstance(value, dict) else None
    if not isinstance(spans, list):
        raise SpanParseError('submit_verdict takes {"spans": [...]}: a "spans" array of span objects')
    return spans


def normalize_whitespace(text: str) -> str:
    """Collapse every run of whitespace to one space and strip the ends."""
    return " ".join(text.split())


def validate_spans(items: Sequence[Any], trace: MarkedTrace, label_scores: Mapping[str, float]) -> SpanValidation:
    """Keep the well-formed spans of ``items`` and drop the others, each with a reason from `DROP_REASONS`.

    Args:
        items: the raw list the judge returned (from `extract_span_list`).
        trace: the completion the spans refer to; its `MarkedTrace.num_tokens` bounds the indices and
            `MarkedTrace.span_text` is what a quote must be found in.
        label_scores: known labels (only the keys are used here).

    Returns:
        `SpanValidation` with ``valid`` (in the judge's order) and ``dropped``.
    """
    result = SpanValidation()
    for item in items:
        reason, detail = _check_span(item, trace, label_scores)
        if reason is None:
            result.valid.append(
                Span(
                    start=item["start"],
                    end=item["end"],
                    label=item["label"],
                    confidence=float(item["confidence"]),
                    quote=item["quote"],
                )
            )
        else:
            result.dropped.append(DroppedSpan(reason=reason, detail=detail, item=item))
    return result


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_span(item: Any, trace: MarkedTrace, label_scores: Mapping[str, float]) -> tuple[str | None, str]:
    if not isinstance(item, dict):
        return "not_an_object", f"expected a JSON object, got {type(item).__name__}"
    missing = [name for name in SPAN_FIELDS if name not in item]
    if missing:
        return "missing_field", f"missing {missing}"
    start, end, label, confidence, quote = (item[name] for name in SPAN_FIELDS)
    if not (_is_int(start) and _is_int(end)):
        return "wrong_type", f"start/end must be integers, got {start!r}/{end!r}"
    if not isinstance(confidence, (int, float)) or isinstance(confidence, bool):
        return "wrong_type", f"confidence must be a number, got {confidence!r}"
    if not isinstance(label, str) or not isinstance(quote, str):
        return "wrong_type", "label and quote must be strings"
    if start < 0 or end > trace.num_tokens:
        return "out_of_range", f"[{start}, {end}) outside [0, {trace.num_tokens})"
    if start >= end:
        return "empty_or_reversed", f"start {start} >= end {end}"
    if label not in label_scores:
        return "unknown_label", f"{label!r} not in {sorted(label_scores)}"
    if math.isnan(confidence) or not 0.0 <= confidence <= 1.0:
        return "bad_confidence", f"confidence {confidence!r} outside [0, 1]"
    wanted = normalize_whitespace(strip_markers(quote))
    if not wanted or wanted not in normalize_whitespace(trace.span_text(start, end)):
        return "quote_mismatch", f"quote {quote[:80]!r} not in the text of tokens [{start}, {end})"
    return None, ""
