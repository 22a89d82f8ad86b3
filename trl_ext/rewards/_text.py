"""Text views of TRL's prompts and completions, shared by the reward functions.

TRL hands reward functions either *standard* data (``prompt``/``completion`` are strings) or *conversational* data
(lists of ``{"role", "content"}`` message dicts; a completion is the list of messages the model produced, usually a
single assistant message). These helpers give every reward the same reading of both forms.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Message = Mapping[str, Any]
Prompt = str | Sequence[Message]
Completion = str | Sequence[Message] | Message


def message_text(message: Message) -> str:
    """The text of one message: ``content`` as a string, or its text parts joined (multimodal content lists)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(
            part.get("text", "") if isinstance(part, Mapping) else str(part)
            for part in content
            if not isinstance(part, Mapping) or part.get("type", "text") == "text"
        )
    raise TypeError(f"Message content must be a string or a list of parts, got {type(content).__name__}.")


def completion_text(completion: Completion) -> str:
    """The text a policy wrote: the string itself, or the assistant messages' contents joined by newlines.

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
    """The last user message of a conversational prompt, or a plain prompt string unchanged."""
    if isinstance(prompt, str):
        return prompt
    for message in reversed(list(prompt)):
        if message.get("role") == "user":
            return message_text(message)
    raise ValueError(
        "The prompt has no user message to take the query from; pass the query in a dataset column and name it "
        "with `query_column`."
    )


def final_answer_text(text: str) -> str:
    """The answer of a ``FINAL(...)`` line when the text has one, else the text stripped of outer whitespace.

    The line is found as the RLM scaffold finds it (`trl_ext.rlm.scaffold.find_final_answer`: the first
    ``FINAL(`` starting a line outside code fences, up to its matching parenthesis), so the reward reads the answer
    the rollout gave. ``FINAL_VAR(name)`` names a REPL variable whose value is not in the text: the text is returned
    unchanged; a reward that must see that value needs the rollout's recorded answer (pass it in a column).
    """
    from ..rlm.scaffold import find_final_answer

    final = find_final_answer(text)
    if final is not None and final.kind == "FINAL":
        return final.value
    return text.strip()
