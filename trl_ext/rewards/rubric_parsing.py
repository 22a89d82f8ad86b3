"""Reading a rubric judge's reply: the scores it gave (`parse_rubric_scores`, tolerant of prose and scales), the
``response_format`` asking for them, and the default scores -> reward mapping (`mean_score_fraction`)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..text import json_candidates


class RubricParseError(ValueError):
    """A judge reply holds no valid score for every rubric field."""


def mean_score_fraction(scores: Mapping[str, float], max_score: float = 10.0) -> float:
    """The default mapping: the mean over the fields of ``score / max_score`` (``(p/10 + r/10) / 2``)."""
    if not scores:
        raise ValueError("No scores to map to a reward.")
    return sum(value / max_score for value in scores.values()) / len(scores)


def response_format_for(score_fields: Sequence[str]) -> dict[str, Any]:
    """The OpenAI ``response_format`` (strict JSON schema) asking for an explanation and one number per field."""
    properties: dict[str, Any] = {"explanation": {"type": "string"}}
    properties.update({name: {"type": "number"} for name in score_fields})
    return {
        "type": "json_schema",
        "json_schema": {
            "name": "rubric_scores",
            "strict": True,
            "schema": {
                "type": "object",
                "properties": properties,
                "required": list(properties),
                "additionalProperties": False,
            },
        },
    }


def parse_rubric_scores(
    text: str | None,
    score_fields: Sequence[str] = ("precision", "recall"),
    *,
    min_score: float = 1,
    max_score: float = 10,
) -> tuple[dict[str, float], str | None]:
    """Read the rubric scores from a judge reply, tolerantly.

    Tried in order: a JSON object holding every field (the whole reply, a fenced code block, or embedded in prose;
    values may be numbers or strings like ``"8"`` or ``"8/10"``); then lines such as ``Precision: 8/10`` or
    ``**recall** = 7``. A score written as ``a/b`` with ``b != max_score`` is rescaled to the scale (``4/5`` → 8 on
    1–10).

    Returns:
        ``(scores, explanation)``: one float per field, and the JSON's ``explanation`` when there was one.

    Raises:
        RubricParseError: a field is missing, not a number, or outside ``[min_score, max_score]``.
    """
    if not isinstance(text, str) or not text.strip():
        raise RubricParseError("the reply is empty")
    fields = list(score_fields)
    errors: list[str] = []
    for candidate in (value for value in json_candidates(text) if isinstance(value, dict)):
        lowered = {str(key).lower(): value for key, value in candidate.items()}
        if not all(name.lower() in lowered for name in fields):
            continue
        try:
            scores = {
                name: _check_range(name, _as_score(lowered[name.lower()], max_score), min_score, max_score)
                for name in fields
            }
        except RubricParseError as error:
            errors.append(str(error))
            continue
        explanation = lowered.get("explanation")
        return scores, explanation if isinstance(explanation, str) else None
    scores = {}
    for name in fields:
        pattern = re.compile(
            rf"\b{re.escape(name)}\b[^0-9\n,;]{{0,40}}?(-?\d+(?:\.\d+)?)(?:\s*(?:/|out of)\s*(\d+(?:\.\d+)?))?",
            re.IGNORECASE,
        )
        match = pattern.search(text)
        if match is None:
            reason = errors[0] if errors else f"no {name!r} score found"
            raise RubricParseError(reason)
        value = float(match.group(1))
        if match.group(2) is not None:
            value = _rescale(value, float(match.group(2)), max_score)
        scores[name] = _check_range(name, value, min_score, max_score)
    return scores, None


_FRACTION_RE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(?:/|out of)\s*(\d+(?:\.\d+)?)\s*$", re.IGNORECASE)


def _as_score(value: Any, max_score: float) -> float:
    if isinstance(value, bool):
        raise RubricParseError(f"score {value!r} is a boolean, not a number")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        stripped = value.strip()
        fraction = _FRACTION_RE.match(stripped)
        if fraction:
            return _rescale(float(fraction.group(1)), float(fraction.group(2)), max_score)
        try:
            return float(stripped)
        except ValueError:
            pass
    raise RubricParseError(f"score {value!r} is not a number")


def _rescale(value: float, denominator: float, max_score: float) -> float:
    if denominator <= 0:
        raise RubricParseError(f"score {value}/{denominator} has a non-positive denominator")
    return value if denominator == max_score else value * max_score / denominator


def _check_range(name: str, value: float, min_score: float, max_score: float) -> float:
    if not math.isfinite(value) or not min_score <= value <= max_score:
        raise RubricParseError(f"{name} = {value} is outside [{score_text(min_score)}, {score_text(max_score)}]")
    return value


def score_text(value: float) -> str:
    """A score as the judge reads it: ``10`` rather than ``10.0``."""
    return str(int(value)) if float(value).is_integer() else str(value)
