"""`split_thinking`: the plan and the response of an RLMT completion (docs/rlmt.md).

Robust to chat templates that pre-fill ``<think>`` in the generation prompt (TRL #6966: the completion then starts
inside the plan and has no opening tag), to missing and to repeated tags; says whether the completion is well formed,
which the scorers' strict mode rewards.
"""

from __future__ import annotations

from typing import NamedTuple

from .formats import RESPONSE_CLOSE, RESPONSE_OPEN, THINK_CLOSE, THINK_OPEN, Format, _check_format


class ThinkingSplit(NamedTuple):
    """``(thinking, response, well_formed)``, both texts stripped of surrounding whitespace."""

    thinking: str
    response: str
    well_formed: bool


def split_thinking(text: str, format: Format = "instruct", *, starts_in_thinking: bool = False) -> ThinkingSplit:
    """Split a completion into its plan and its response.

    Rules (``"instruct"``): the response is the text after the **last** ``</think>``; the thinking is the text
    before it, minus a leading ``<think>``. The opening tag is optional, because templates that pre-fill ``<think>``
    in the generation prompt (TRL #6966) produce completions that start inside the plan. A ``<think>`` after the
    last ``</think>`` opens an unterminated plan: the response stops there. With no ``</think>`` at all: an opened
    ``<think>`` means the whole text is an unfinished plan (empty response); no tag at all means the model skipped
    the plan, so the text is the response, unless ``starts_in_thinking`` (the template pre-fills ``<think>``), when
    it is an unfinished plan.

    ``"zero"`` adds the response tags: the response is the inside of the ``<response>`` that follows the plan, up to
    ``</response>`` or the end of the text (the stop string is usually cut by the generator).

    **Well formed** means: exactly one ``</think>``, at most one ``<think>`` and only at the very start, a non-empty
    plan and a non-empty response; for ``"zero"`` also exactly one ``<response>`` right after ``</think>``, at most
    one ``</response>`` and nothing but whitespace after it.
    """
    _check_format(format)
    if not isinstance(text, str):
        raise TypeError(f"split_thinking expects the completion text (str), got {type(text).__name__}.")
    opens, closes = text.count(THINK_OPEN), text.count(THINK_CLOSE)
    if closes == 0:
        if opens:
            start = text.find(THINK_OPEN) + len(THINK_OPEN)
            return ThinkingSplit(text[start:].strip(), "", False)
        if starts_in_thinking:
            return ThinkingSplit(text.strip(), "", False)
        return ThinkingSplit("", _strip_response_tags(text) if format == "zero" else text.strip(), False)

    cut = text.rfind(THINK_CLOSE)
    head, tail = text[:cut], text[cut + len(THINK_CLOSE) :]
    stripped_head = head.lstrip()
    opened_at_start = stripped_head.startswith(THINK_OPEN)
    thinking = (stripped_head[len(THINK_OPEN) :] if opened_at_start else head).strip()
    reopened = tail.find(THINK_OPEN)
    if reopened >= 0:
        tail = tail[:reopened]
    well_formed = closes == 1 and reopened < 0 and (opens == 0 or (opens == 1 and opened_at_start)) and bool(thinking)

    if format == "instruct":
        response = tail.strip()
        return ThinkingSplit(thinking, response, well_formed and bool(response))

    rest = tail.lstrip()
    if not rest.startswith(RESPONSE_OPEN):
        return ThinkingSplit(thinking, _strip_response_tags(tail), False)
    body = rest[len(RESPONSE_OPEN) :]
    end = body.find(RESPONSE_CLOSE)
    response, after = (body, "") if end < 0 else (body[:end], body[end + len(RESPONSE_CLOSE) :])
    response = response.strip()
    well_formed = (
        well_formed
        and bool(response)
        and text.count(RESPONSE_OPEN) == 1
        and text.count(RESPONSE_CLOSE) <= 1
        and not after.strip()
    )
    return ThinkingSplit(thinking, response, well_formed)


def _strip_response_tags(text: str) -> str:
    return text.replace(RESPONSE_OPEN, "").replace(RESPONSE_CLOSE, "").strip()
