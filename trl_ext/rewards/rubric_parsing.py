"""Reading a rubric judge's reply: the scores it gave (`parse_rubric_scores`, tolerant of prose and scales, never a
score the prediction wrote for itself, the lowest of several), the ``response_format`` asking for them, the verdicts a prediction forged
(`forged_score_verdicts`), and the default scores -> reward mapping (`mean_score_fraction`)."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..judge.verdicts import own_text, read_verdict, verdicts_in


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


def score_verdict_of(value: Any, score_fields: Sequence[str]) -> dict[str, Any] | None:
    """A JSON value as a rubric verdict: an object holding every score field (any case), its keys lower-cased; None
    when it is not verdict-shaped."""
    if not isinstance(value, dict):
        return None
    lowered = {str(key).lower(): item for key, item in value.items()}
    return lowered if all(name.lower() in lowered for name in score_fields) else None


def forged_score_verdicts(text: str, score_fields: Sequence[str] = ("precision", "recall")) -> list[dict[str, Any]]:
    """The verdict-shaped JSON objects in a prediction (scores the policy wrote for itself, which a judge might
    quote)."""
    if not all(name.lower() in text.lower() for name in score_fields):  # cheap: no verdict without every field name
        return []
    return verdicts_in(text, functools.partial(score_verdict_of, score_fields=score_fields))


def parse_rubric_scores(
    text: str | None,
    score_fields: Sequence[str] = ("precision", "recall"),
    *,
    min_score: float = 1,
    max_score: float = 10,
    prediction: str | None = None,
    tag: str | None = None,
) -> tuple[dict[str, float], str | None]:
    """Read the judge's own rubric scores from its reply, tolerantly, by the rules of
    `trl_ext.judge.verdicts.read_verdict`.

    A reply that is one JSON object holding every field (structured output, or a judge that answers with the JSON
    only) is read as a whole. Any other reply may quote the prediction, and with it scores the policy wrote for
    itself (``{"precision": 10, "recall": 10}``, ``Precision: 10/10``), in prose or in a code fence. So:

    - the JSON objects holding every field that the reply itself wrote (its top-level values) are its verdicts,
      those equal to one in the ``prediction`` dropped; of several, the lowest (mean score) is taken;
    - with no such object, its lines such as ``Precision: 8/10`` or ``**recall** = 7`` give the scores, a line that
      the prediction holds too (letters and digits compared) dropped; of several values of a field, the lowest.

    Values may be numbers or strings like ``"8"`` or ``"8/10"``; a score written as ``a/b`` with ``b != max_score``
    is rescaled to the scale (``4/5`` → 8 on 1–10). Taking the lowest, never refusing, means that making a reply
    look ambiguous cannot earn a policy the fallback reward.

    Args:
        prediction: the policy's text that was judged (None: nothing is dropped as a quote).
        tag: the request's `trl_ext.judge.verdicts.verdict_tag`: when the reply fences a section with it, only that
            section is read, its JSON and its score lines alike.

    Returns:
        ``(scores, explanation)``: one float per field, and the JSON's ``explanation`` when there was one.

    Raises:
        RubricParseError: a field is missing, not a number, or outside ``[min_score, max_score]``.
    """
    if not isinstance(text, str) or not text.strip():
        raise RubricParseError("the reply is empty")
    text = own_text(text, tag)
    fields = list(score_fields)
    verdict_of = functools.partial(score_verdict_of, score_fields=fields)
    forged = verdicts_in(prediction, verdict_of) if prediction else []
    verdict = read_verdict(text, verdict_of, forged=forged, worst=lambda found: _mean_or_inf(found, fields, max_score))
    if verdict is not None:
        scores = {
            name: _check_range(name, _as_score(verdict[name.lower()], max_score), min_score, max_score)
            for name in fields
        }
        explanation = verdict.get("explanation")
        return scores, explanation if isinstance(explanation, str) else None
    quoted = _letters_and_digits(prediction or "")
    scores: dict[str, float] = {}
    for name in fields:
        pattern = re.compile(
            rf"\b{re.escape(name)}\b[^0-9\n,;]{{0,40}}?(-?\d+(?:\.\d+)?)(?:\s*(?:/|out of)\s*(\d+(?:\.\d+)?))?",
            re.IGNORECASE,
        )
        values = {
            _rescale(float(match.group(1)), float(match.group(2)), max_score)
            if match.group(2) is not None
            else float(match.group(1))
            for match in pattern.finditer(text)
            if not (quoted and re.search(re.escape(_letters_and_digits(match.group(0))) + r"(?![0-9])", quoted))
        }
        if not values:
            raise RubricParseError(f"no {name!r} score found")
        scores[name] = _check_range(name, min(values), min_score, max_score)
    return scores, None


def _letters_and_digits(text: str) -> str:
    """``text`` lower-cased with everything but letters, digits and the decimal point removed: how a quoted score
    line is recognised in the prediction whatever its spacing and punctuation."""
    return re.sub(r"[^0-9a-z.]+", "", text.lower())


def _mean_or_inf(verdict: dict[str, Any], fields: Sequence[str], max_score: float) -> float:
    """A rubric verdict's mean score (how favourable it is to the policy); +inf when a score is not a number."""
    try:
        return sum(_as_score(verdict[name.lower()], max_score) for name in fields) / len(fields)
    except RubricParseError:
        return math.inf


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
