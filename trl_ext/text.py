"""Text views of chat data, shared by the rewards, the judges and the cold-start pipeline.

TRL hands reward functions either *standard* data (``prompt``/``completion`` are strings) or *conversational* data
(lists of ``{"role", "content"}`` message dicts; a completion is the list of messages the model produced, usually a
single assistant message). These helpers give every reader the same view of both forms.

**One rule for message content.** ``content`` is a string, ``None`` (no text), or a list of OpenAI content parts.
From a list, the text parts (``{"type": "text", "text": ...}``, a part without ``type``, or a bare string) are joined
with a newline and the other parts (images, audio, ...) are skipped. A newline, not nothing: the parts are separate
blocks, and gluing them would run the last word of one into the first word of the next.

`json_candidates` finds every JSON value a text holds (alone, in a code fence, with prose around it, nested in
another): what the judges search the policy's text with for forged verdicts. `top_level_json_values` finds only the
values a reply itself wrote, never the JSON quoted inside their strings: what the judges read their verdicts from.
`find_final_answer` finds an RLM action's ``FINAL(...)``/``FINAL_VAR(...)`` line (the scaffold and the rewards
read answers the same way). Pure: this module imports nothing of trl-ext.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Message = Mapping[str, Any]
Prompt = str | Sequence[Message]
Completion = str | Sequence[Message] | Message

PART_SEPARATOR = "\n"


def message_text(message: Message) -> str:
    """The text of one message, by the module's content rule (text parts joined with a newline).

    Raises:
        TypeError: for content that is neither a string, ``None`` nor a list of parts.
    """
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return PART_SEPARATOR.join(
            (part.get("text") or "") if isinstance(part, Mapping) else str(part)
            for part in content
            if not isinstance(part, Mapping) or part.get("type", "text") == "text"
        )
    raise TypeError(f"Message content must be a string or a list of parts, got {type(content).__name__}.")


def completion_text(completion: Completion) -> str:
    """The text a policy wrote: the string itself, or the assistant messages' texts joined by newlines.

    Raises:
        TypeError: for anything that is neither a string, a message dict nor a list of message dicts.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return message_text(completion)
    if isinstance(completion, Sequence):
        parts = []
        for message in completion:
            if not isinstance(message, Mapping):
                raise TypeError(
                    f"A conversational completion must be a list of message dicts; found a {type(message).__name__}."
                )
            if message.get("role", "assistant") == "assistant":
                parts.append(message_text(message))
        return "\n".join(parts)
    raise TypeError(
        f"A completion must be a string or a list of message dicts (TRL's two formats); got {type(completion).__name__}."
    )


def prompt_messages(prompt: Prompt) -> list[dict[str, Any]]:
    """The prompt as a conversation: a plain string becomes one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, Sequence):
        return [dict(message) for message in prompt]
    raise TypeError(
        f"A prompt must be a string or a list of message dicts (TRL's two formats); got {type(prompt).__name__}."
    )


def last_user_text(prompt: Prompt) -> str:
    """The task as the policy saw it: a plain prompt string unchanged, or the text of the last user message.

    Raises:
        ValueError: a conversation with no user message.
        TypeError: a prompt in neither of TRL's two formats.
    """
    if isinstance(prompt, str):
        return prompt
    messages = prompt_messages(prompt)
    for message in reversed(messages):
        if message.get("role") == "user":
            return message_text(message)
    raise ValueError(
        f"The prompt has no user message to read the task from (roles: {[m.get('role') for m in messages]}); "
        "end each conversational prompt with the user's message, or pass the prompt as a plain string."
    )


_FENCE = re.compile(r"^[ \t]*```")
_FINAL_VAR_LINE = re.compile(r"^[ \t]*FINAL_VAR\((.*)\)[ \t]*$")
_FINAL_START = re.compile(r"^[ \t]*FINAL\(")


@dataclass(frozen=True)
class FinalAnswer:
    """A ``FINAL(answer)`` or ``FINAL_VAR(name)`` line found in an action."""

    kind: Literal["FINAL", "FINAL_VAR"]
    value: str  # the answer text for FINAL, the variable name for FINAL_VAR


def find_final_answer(action: str) -> FinalAnswer | None:
    """The first ``FINAL(...)``/``FINAL_VAR(...)`` line of `action` outside code fences, or None.

    ``FINAL(`` must start a line (after indentation); its answer runs to the matching closing parenthesis and may
    span lines. ``FINAL_VAR(name)`` must fill its line; quotes around the name are dropped. A ``FINAL(`` whose
    parenthesis never closes is ignored (the completion was cut).
    """
    lines = action.split("\n")
    in_fence = False
    outside: list[str] = []  # lines outside fences; fenced lines blanked so indices stay aligned
    for line in lines:
        if _FENCE.match(line):
            in_fence = not in_fence
            outside.append("")
            continue
        outside.append("" if in_fence else line)
    for index, line in enumerate(outside):
        match = _FINAL_VAR_LINE.match(line)
        if match:
            return FinalAnswer("FINAL_VAR", match.group(1).strip().strip("'\"").strip())
        start = _FINAL_START.match(line)
        if start:
            rest = "\n".join([line[start.end() :], *outside[index + 1 :]])
            depth = 1
            for position, char in enumerate(rest):
                if char == "(":
                    depth += 1
                elif char == ")":
                    depth -= 1
                    if depth == 0:
                        return FinalAnswer("FINAL", rest[:position].strip())
            return None
    return None


def final_answer_text(text: str) -> str:
    """The answer of a ``FINAL(...)`` line when the text has one, else the text stripped of outer whitespace.

    The line is found as the RLM scaffold finds it (`find_final_answer`: the first ``FINAL(`` starting a line
    outside code fences, up to its matching parenthesis), so the reward reads the answer
    the rollout gave. ``FINAL_VAR(name)`` names a REPL variable whose value is not in the text: the text is returned
    unchanged; a reward that must see that value needs the rollout's recorded answer (pass it in a column).
    """
    final = find_final_answer(text)
    if final is not None and final.kind == "FINAL":
        return final.value
    return text.strip()


# A fenced block: ``` or ```json (any case), on one line or several; the group is what is inside.
_FENCE_RE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n?(.*?)```", re.DOTALL | re.IGNORECASE)
_OPENING_RE = re.compile(r"[\[{]")


def json_candidates(text: str) -> Iterator[Any]:
    """The JSON values in a model's reply, most deliberate first.

    Yields, in order: the whole reply parsed as JSON; the inside of each fenced block (````` ``` ````` or
    ````` ```json `````, any case); then every array or object starting at a ``[`` or ``{`` of the text, read with
    `json.JSONDecoder.raw_decode`, so prose before and after it does not matter. Values nested in others are yielded
    on their own too, and a value can come more than once (a fenced block is also in the text): callers take the
    first value of the shape they want. Text that is not JSON is skipped. Scanning stops at a value nested deeper
    than the parser's stack (every bracket after its start is nested as deep, and retrying each would be quadratic).

    Raises:
        TypeError: ``text`` is not a string.
    """
    if not isinstance(text, str):
        raise TypeError(f"json_candidates reads a reply string, got {type(text).__name__}.")
    for candidate in (text, *(match.group(1) for match in _FENCE_RE.finditer(text))):
        try:
            value = json.loads(candidate)
        except (ValueError, RecursionError):
            continue
        yield value
    decoder = json.JSONDecoder()
    for match in _OPENING_RE.finditer(text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except ValueError:
            continue
        except RecursionError:
            return
        yield value


def top_level_json_values(text: str) -> Iterator[Any]:
    """The JSON values written at the top level of ``text``, left to right: each array or object starting at a ``[``
    or ``{`` that is not inside a value already read (`json.JSONDecoder.raw_decode`). Unlike `json_candidates`, the
    values nested in another and the strings inside a value are never read on their own: JSON that a reply quotes
    inside its own JSON's strings is not a value of the reply. Text that is not JSON is skipped one character at a
    time (a value may start inside it).

    Raises:
        TypeError: ``text`` is not a string.
    """
    if not isinstance(text, str):
        raise TypeError(f"top_level_json_values reads a reply string, got {type(text).__name__}.")
    decoder = json.JSONDecoder()
    position = 0
    while True:
        match = _OPENING_RE.search(text, position)
        if match is None:
            return
        try:
            value, end = decoder.raw_decode(text, match.start())
        except ValueError:
            position = match.start() + 1
            continue
        except RecursionError:
            return
        yield value
        position = end
