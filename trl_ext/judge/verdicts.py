"""Reading only the judge's own verdict out of a reply (`read_verdict`), shared by every LLM judge in trl-ext.

A judge quotes the policy's text, and the policy can write verdict-shaped JSON into it, hoping the judge's reply
carries it: credited as the verdict, or making the reply look ambiguous so that it is refused (a refused verdict
gives no credit, which pays on exactly the rollouts judge credit exists to punish). So a reply is read by these rules:

0. The judge is asked to write its verdict between ``<VERDICT-…>`` and ``</VERDICT-…>`` lines whose tag carries the
   request's nonce (`verdict_tag`), which the policy never sees. When the reply holds such a section, only the text
   inside it is read (`own_text`); a judge that ignores the tag is read whole, by the rules below.
1. A reply that is one JSON value (structured output, or a judge that answers with the JSON only) is read as a whole:
   nothing quoted inside its strings is looked at.
2. Otherwise only the values the reply itself wrote are read: its top-level JSON values (`top_level_json_values`),
   never the JSON inside their strings, nor values nested in them.
3. A value equal to a verdict the policy wrote (``forged``, found in the policy's text by the caller with
   `verdicts_in`) is a quote, not the judge's: it is dropped.
4. What a value must be to count as a verdict inside a longer reply may be stricter than as the whole reply
   (``in_text``: the span judge takes a bare ``[]`` only as the whole reply).
5. Several different verdicts left: with ``worst`` the least favourable one to the policy is taken (no refusal that
   a policy could profit from); without, the reply is refused (`InjectionSuspected`).

A reply cut at ``max_tokens`` is never read (`trl_ext.judge.client.AsyncChatClient.chat_parsed` asks again): its own
JSON is broken, and what is left readable may be only a quote. What a verdict is (a span list, a rubric's scores) is
the caller's ``verdict_of``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..text import json_candidates, top_level_json_values

T = TypeVar("T")

VERDICT_TAG_PREFIX = "VERDICT-"


def verdict_tag(nonce: str) -> str:
    """The tag that fences the judge's verdict in a text reply (``<VERDICT-3f9a…>`` … ``</VERDICT-3f9a…>``), made
    from the request's nonce (`trl_ext.judge.prompts.new_nonce`): the policy cannot write it."""
    return VERDICT_TAG_PREFIX + nonce.rsplit("-", 1)[-1]


def own_text(text: str, tag: str | None) -> str:
    """The part of a reply the judge fenced with ``tag`` (every ``<tag>…</tag>`` section, joined by newlines), or
    the whole reply when it holds none (or ``tag`` is None). A section left open at the end is not read."""
    if not tag or not isinstance(text, str):
        return text
    sections = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return "\n".join(sections) if sections else text


class InjectionSuspected(ValueError):
    """A judge reply holds more than one different verdict: one of them may be the policy's forged verdict, quoted.

    A judge fault like an unparseable reply (`AsyncChatClient.chat_parsed` asks again, then the rollout gets the
    judge's fallback), counted apart as a suspected injection.
    """


def read_from_text(text: str | None) -> bool:
    """Whether a verdict reply is free text (anything but one JSON value): the channel a quoted forgery can travel,
    which structured output closes. What the trainers count as ``judge/text_verdicts``."""
    try:
        json.loads(text or "")
    except (ValueError, RecursionError):
        return True
    return False


def verdicts_in(text: str, verdict_of: Callable[[Any], T | None]) -> list[T]:
    """The different verdicts among every JSON value of ``text``, nested ones and those inside strings included
    (`trl_ext.text.json_candidates`), in order: how the policy's text is searched for forged verdicts.

    Args:
        text: the policy's text (or any text to search exhaustively).
        verdict_of: a JSON value -> the verdict it holds (compared with ``==``), or None when it is not
            verdict-shaped.
    """
    found: list[T] = []
    for value in json_candidates(text):
        verdict = verdict_of(value)
        if verdict is not None and verdict not in found:
            found.append(verdict)
    return found


def reply_verdicts(
    text: str, verdict_of: Callable[[Any], T | None], *, forged: Sequence[T] = (), tag: str | None = None
) -> list[T]:
    """The different verdicts a reply wrote itself (rules 0, 2 and 3 of the module docstring): among the top-level
    JSON values of its own text (`own_text` of ``tag``), those ``verdict_of`` reads as a verdict and not equal to
    one of ``forged``, in order. More than one is a reply to flag (``injection_suspected``): a quote the judge
    paraphrased, or a judge of two minds."""
    found: list[T] = []
    for value in top_level_json_values(own_text(text or "", tag)):
        verdict = verdict_of(value)
        if verdict is not None and verdict not in forged and verdict not in found:
            found.append(verdict)
    return found


def read_verdict(
    text: str,
    verdict_of: Callable[[Any], T | None],
    *,
    forged: Sequence[T] = (),
    in_text: Callable[[Any], T | None] | None = None,
    worst: Callable[[T], float] | None = None,
    tag: str | None = None,
) -> T | None:
    """The judge's own verdict in a reply whose verdict came as text, or None when it holds none (module docstring).

    Args:
        text: the judge's reply.
        verdict_of: a JSON value -> the verdict it holds, or None when it is not verdict-shaped (rule 1).
        forged: the verdicts the policy wrote (`verdicts_in` of its text): a reply's value equal to one is dropped.
        in_text: the verdict of a value inside a longer reply (default ``verdict_of``).
        worst: a verdict -> how favourable it is to the policy; with several different verdicts left, the one with
            the smallest value is taken.
        tag: the request's `verdict_tag`: when the reply fences a section with it, only that is read (rule 0).

    Raises:
        InjectionSuspected: several different verdicts are left and no ``worst`` is given.
    """
    text = own_text(text, tag)
    try:
        whole = verdict_of(json.loads(text))
    except (ValueError, RecursionError):
        whole = None
    if whole is not None:
        return whole
    found = reply_verdicts(text, in_text or verdict_of, forged=forged)
    if len(found) > 1:
        if worst is not None:
            return min(found, key=worst)
        raise InjectionSuspected(
            f"the reply holds {len(found)} different verdicts (a quoted one among them?); reply with your own verdict "
            "only, as one JSON object and nothing else"
        )
    return found[0] if found else None
