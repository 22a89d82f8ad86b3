"""RLMT prompt formats and their stop strings (docs/rlmt.md).

- ``"instruct"`` (chat models): a system instruction asks for ``<think> plan </think> response``.
- ``"zero"`` (base models): a plain-text prefix prompt asks for ``<think> plan </think> <response> response
  </response>``, and generation stops at ``</response>`` (`ZERO_STOP_STRING`).

`rlmt_prompt` rewrites one prompt into a format, `original_prompt` undoes it (the conversation the reward model
sees), `rlmt_format_dataset` rewrites a dataset. `truncate_at_stop` and `stop_token_cut` cut a completion after its
first stop string, as text and as tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ...text import message_text, prompt_messages

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<response>", "</response>"
RLMT_FORMATS = ("instruct", "zero")
ZERO_STOP_STRING = RESPONSE_CLOSE

# The "zero" prefix (the RLMT paper's prompt for base models; docs/rlmt.md), completed with the format it announces.
ZERO_PROMPT_PREFIX = (
    "A conversation between User and Assistant. Following the User's query, the Assistant first plans a response, "
    "and then provides the response. The internal reasoning process is enclosed within <think> </think> tags and "
    "the response is enclosed within <response> </response> tags, i.e., <think> reasoning process here </think> "
    "<response> response here </response>."
)
# Placeholders: {prefix}, {conversation} (the earlier turns as "User: ..."/"Assistant: ..." lines, ending with the
# query's "User: ..." line).
ZERO_PROMPT_TEMPLATE = "{prefix}\n{conversation}\nAssistant:"

# System instruction of the "instruct" format (our wording of the paper's thinking instruction).
INSTRUCT_SYSTEM_PROMPT = (
    "Before you respond, think about the request and plan your response inside <think> </think> tags. After "
    "</think>, write the response itself: the user sees only the response, so it must be complete on its own."
)

# Dataset column `rlmt_format_dataset` adds: the prompt as the user wrote it, which is what the reward model sees.
ORIGINAL_PROMPT_COLUMN = "rlmt_original_prompt"

Format = Literal["instruct", "zero"]


def _check_format(format: str) -> None:
    if format not in RLMT_FORMATS:
        raise ValueError(
            f"format={format!r} is not an RLMT format: use 'instruct' (chat models) or 'zero' (base models)."
        )


def rlmt_prompt(
    prompt: str | Sequence[Mapping[str, Any]],
    format: Format = "instruct",
    *,
    system_prompt: str = INSTRUCT_SYSTEM_PROMPT,
    zero_template: str = ZERO_PROMPT_TEMPLATE,
) -> str | list[dict[str, Any]]:
    """Rewrite one prompt into the RLMT format.

    - ``"instruct"``: a conversation whose system message starts with ``system_prompt`` (an existing system
      message is kept after it). A plain string prompt becomes the user message. Idempotent.
    - ``"zero"``: a plain-text prompt, ``ZERO_PROMPT_PREFIX`` then the conversation as ``User: ...`` /
      ``Assistant: ...`` lines, ending with ``Assistant:`` (use it with ``ZERO_STOP_STRING`` as stop string and no
      chat template). Existing system messages are dropped (base models have no system role).
    """
    _check_format(format)
    messages = prompt_messages(prompt)
    if format == "instruct":
        if messages and messages[0].get("role") == "system":
            existing = message_text(messages[0])
            if existing.startswith(system_prompt):
                return messages
            return [{"role": "system", "content": f"{system_prompt}\n\n{existing}"}, *messages[1:]]
        return [{"role": "system", "content": system_prompt}, *messages]
    if isinstance(prompt, str) and prompt.startswith(ZERO_PROMPT_PREFIX):
        return prompt
    lines = []
    for message in messages:
        role = message.get("role")
        if role == "user":
            lines.append(f"User: {message_text(message).strip()}")
        elif role == "assistant":
            lines.append(f"Assistant: {message_text(message).strip()}")
    if not lines:
        raise ValueError("The prompt has no user message to put in the zero-format prompt.")
    return zero_template.format(prefix=ZERO_PROMPT_PREFIX, conversation="\n".join(lines))


def original_prompt(
    prompt: str | Sequence[Mapping[str, Any]],
    format: Format = "instruct",
    *,
    system_prompt: str = INSTRUCT_SYSTEM_PROMPT,
) -> list[dict[str, Any]]:
    """Undo `rlmt_prompt`: the conversation as the user wrote it, which is what the reward model should see.

    ``"instruct"``: the RLMT instruction is removed from the system message (the message is dropped when nothing
    else is left). ``"zero"``: the ``User:``/``Assistant:`` lines of a zero-format prompt are read back into
    messages. A prompt not in the format is returned as a conversation, unchanged.
    """
    _check_format(format)
    if format == "zero" and isinstance(prompt, str) and prompt.startswith(ZERO_PROMPT_PREFIX):
        body = prompt[len(ZERO_PROMPT_PREFIX) :].strip()
        if body.endswith("Assistant:"):
            body = body[: -len("Assistant:")].rstrip()
        messages: list[dict[str, Any]] = []
        for line in body.split("\n"):
            if line.startswith("User: "):
                messages.append({"role": "user", "content": line[len("User: ") :]})
            elif line.startswith("Assistant: "):
                messages.append({"role": "assistant", "content": line[len("Assistant: ") :]})
            elif messages:  # a multi-line message continues
                messages[-1]["content"] += "\n" + line
        return messages
    messages = prompt_messages(prompt)
    if messages and messages[0].get("role") == "system" and message_text(messages[0]).startswith(system_prompt):
        rest = message_text(messages[0])[len(system_prompt) :].strip()
        messages = ([{"role": "system", "content": rest}] if rest else []) + messages[1:]
    return messages


def rlmt_format_dataset(
    dataset: Any,
    format: Format = "instruct",
    *,
    prompt_column: str = "prompt",
    system_prompt: str = INSTRUCT_SYSTEM_PROMPT,
    original_prompt_column: str | None = ORIGINAL_PROMPT_COLUMN,
    num_proc: int | None = None,
) -> Any:
    """Rewrite a `datasets.Dataset`'s prompts into the RLMT format (`rlmt_prompt`), keeping the user's prompt.

    The original prompt goes to ``original_prompt_column`` (as a conversation), where the RLMT scorers read what
    the reward model sees; ``None`` keeps no copy (the scorers then undo the format with `original_prompt`).
    Rows already in the format are left as they are.
    """
    _check_format(format)
    if prompt_column not in dataset.column_names:
        raise KeyError(f"The dataset has no {prompt_column!r} column (columns: {dataset.column_names}).")

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        prompt = row[prompt_column]
        out: dict[str, Any] = {prompt_column: rlmt_prompt(prompt, format, system_prompt=system_prompt)}
        if original_prompt_column is not None:
            previous = row.get(original_prompt_column)
            out[original_prompt_column] = (
                previous if previous is not None else original_prompt(prompt, format, system_prompt=system_prompt)
            )
        return out

    return dataset.map(convert, num_proc=num_proc, desc=f"RLMT {format} format")


def truncate_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """``text`` up to and including the first occurrence of any stop string (unchanged when none occurs)."""
    ends = [text.find(stop) + len(stop) for stop in stop_strings if stop and stop in text]
    return text[: min(ends)] if ends else text


def stop_token_cut(token_ids: Sequence[int], tokenizer: Any, stop_strings: Sequence[str]) -> int | None:
    """How many leading tokens of a completion to keep so that it ends with its first stop string.

    Returns ``None`` when the decoded completion contains no stop string, else the smallest ``k`` such that
    ``decode(token_ids[:k])`` contains one (binary search: a prefix that contains a stop string stays containing it
    as tokens are added). Tokens after the stop were sampled past the point where generation should have ended;
    dropping them is what a generator's stop string does. A stop string that ends inside a token keeps that whole
    token (its text may run a few characters past the stop), as with vLLM's stop strings.
    """
    stops = [stop for stop in stop_strings if stop]
    if not stops or not token_ids:
        return None

    def contains_stop(k: int) -> bool:
        text = tokenizer.decode(list(token_ids[:k]), skip_special_tokens=False)
        return any(stop in text for stop in stops)

    if not contains_stop(len(token_ids)):
        return None
    low, high = 1, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        if contains_stop(middle):
            high = middle
        else:
            low = middle + 1
    return low


def cut_at_stop(
    token_ids: Sequence[int], logprobs: Sequence[float] | None, tokenizer: Any, stop_strings: Sequence[str]
) -> tuple[list[int], list[float] | None, bool]:
    """A completion ending with the token that completes its first stop string (`stop_token_cut`), with its log-probs:
    the one cut of both RLMT trainers.

    Args:
        token_ids: ``(C,)`` the sampled completion.
        logprobs: ``(C,)`` the sampler's log-prob of each token, or None (a sampler that gives none).
        tokenizer: decodes the completion to find the stop strings.
        stop_strings: e.g. ``["</response>"]``; none: nothing is cut.

    Returns:
        ``(ids, logprobs, cut)``: the first ``K <= C`` tokens and their log-probs (None without), and whether
        ``K < C`` (tokens were sampled past the stop: they are neither scored nor trained).
    """
    if logprobs is not None and len(token_ids) != len(logprobs):
        raise ValueError(
            f"{len(token_ids)} completion tokens but {len(logprobs)} log-probs: the sampler must return one log-prob "
            "per sampled token."
        )
    keep = stop_token_cut(token_ids, tokenizer, stop_strings) if stop_strings else None
    cut = keep is not None and keep < len(token_ids)
    end = keep if cut else len(token_ids)
    return list(token_ids[:end]), None if logprobs is None else [float(value) for value in logprobs[:end]], cut
