"""Reading only the judge's own verdict out of a reply (`read_verdict`), shared by every LLM judge in trl-ext.

A judge quotes the policy's text, and the policy can write a verdict-shaped JSON object into it: a reply that is not
one JSON value is read only when it holds one verdict, and one that holds several different ones is refused
(`InjectionSuspected`, counted by the judges; `trl_ext.judge.client.AsyncChatClient.chat_parsed` asks again). What a
verdict is (a span list, a rubric's scores) is the caller's ``verdict_of``; the JSON values of a text are found by
`trl_ext.text.json_candidates`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from ..text import json_candidates

T = TypeVar("T")


class InjectionSuspected(ValueError):
    """A judge reply holds more than one different verdict: one of them may be the policy's forged verdict, quoted.

    A judge fault like an unparseable reply (`AsyncChatClient.chat_parsed` asks again, then the rollout gets the
    judge's fallback), counted apart as a suspected injection.
    """


def verdicts_in(text: str, verdict_of: Callable[[Any], T | None]) -> list[T]:
    """The different verdicts among the JSON values of ``text`` (`trl_ext.text.json_candidates`), in order.

    Args:
        text: a judge reply, or the policy's text (to find the verdicts it forged).
        verdict_of: a JSON value -> the verdict it holds (compared with ``==``), or None when it is not
            verdict-shaped.
    """
    found: list[T] = []
    for value in json_candidates(text):
        verdict = verdict_of(value)
        if verdict is not None and verdict not in found:
            found.append(verdict)
    return found


def read_verdict(text: str, verdict_of: Callable[[Any], T | None]) -> T | None:
    """The judge's own verdict in a reply whose verdict came as text, or None when it holds none.

    A reply that is one JSON value (structured output, or a judge that answers with the JSON only) is read as a
    whole: verdict-shaped text quoted inside its strings is not looked at. Any other reply may quote the policy's
    text, forged verdicts included, in prose or in a code fence: it is read only when all its verdict-shaped values
    are the same verdict (a verdict shown twice, fenced and bare, is one).

    Raises:
        InjectionSuspected: the reply holds several different verdicts (the caller's repair asks for its own only).
    """
    try:
        whole = verdict_of(json.loads(text))
    except (ValueError, RecursionError):
        whole = None
    if whole is not None:
        return whole
    found = verdicts_in(text, verdict_of)
    if len(found) > 1:
        raise InjectionSuspected(
            f"the reply holds {len(found)} different verdicts (a quoted one among them?); reply with your own verdict "
            "only, as one JSON object and nothing else"
        )
    return found[0] if found else None
