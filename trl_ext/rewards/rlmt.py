"""RLMT: the model plans in ``<think>`` then responds; a reward model scores the response only (SPEC §5).

"Language Models that Think, Chat Better" (Bhaskar, Ye, Chen; arXiv 2509.20357) trains chat models with GRPO to
write a plan ``z`` before the response ``y`` and maximises ``E[r(y, x)]`` where the reward model ``r`` never sees
the plan. This module holds the pieces that are not the trainer (`trl_ext.trainers.rlmt` wires them together):

- **Formats.** ``"instruct"`` (chat models): a system instruction asks for ``<think> plan </think> response``.
  ``"zero"`` (base models): a plain-text prefix prompt asks for ``<think> plan </think> <response> response
  </response>``, and generation stops at ``</response>`` (`ZERO_STOP_STRING`). See `rlmt_prompt`,
  `rlmt_format_dataset`.
- **`split_thinking`**: ``(thinking, response, well_formed)`` from a completion, robust to chat templates that
  pre-fill ``<think>`` in the generation prompt (TRL #6966: the completion then starts inside the plan and has no
  opening tag), to missing and to repeated tags.
- **Scorers** (TRL reward functions): `RewardModelScorer` runs a ``transformers`` sequence-classification reward
  model on its own device/dtype with its own chat template; `ServedRewardModelScorer` asks a vLLM-served reward model
  over HTTP (``POST /classify``). Both score ``prompt + response`` only; in strict mode a malformed completion gets
  the lowest reward.
- **On-policy DPO** (the paper's DPO variant): `build_dpo_pairs` turns scored samples into ``prompt``/``chosen``/
  ``rejected`` rows for `trl.DPOTrainer` (best vs worst per prompt); `sample_on_policy_pairs` samples them first.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

from ..text import completion_text, message_text, prompt_messages

logger = logging.getLogger(__name__)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<response>", "</response>"
RLMT_FORMATS = ("instruct", "zero")
ZERO_STOP_STRING = RESPONSE_CLOSE

# The "zero" prefix of SPEC §5 (the RLMT paper's prompt for base models), completed with the format it announces.
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


# ----------------------------------------------------------------------------------------------------------------
# Formats
# ----------------------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------------------
# Splitting the plan from the response
# ----------------------------------------------------------------------------------------------------------------
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


def truncate_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """``text`` up to and including the first occurrence of any stop string (unchanged when none occurs)."""
    ends = [text.find(stop) + len(stop) for stop in stop_strings if stop and stop in text]
    return text[: min(ends)] if ends else text


# ----------------------------------------------------------------------------------------------------------------
# Scorers: the reward model sees prompt + response only
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class ScorerStats:
    """Counters since the scorer was created: completions scored, malformed ones, failed requests (served RM)."""

    completions: int = 0
    malformed: int = 0
    failed: int = 0


class _ResponseOnlyScorer:
    """What both scorers share: splitting, the reward model's conversation, the malformed reward, logging."""

    def __init__(
        self,
        *,
        format: Format,
        strict: bool,
        malformed_reward: float | None,
        malformed_margin: float,
        starts_in_thinking: bool,
        system_prompt: str,
        original_prompt_column: str | None,
        name: str,
    ):
        _check_format(format)
        if malformed_reward is not None and not math.isfinite(malformed_reward):
            raise ValueError(f"malformed_reward={malformed_reward} must be finite, or None for the batch minimum.")
        if malformed_margin < 0:
            raise ValueError(f"malformed_margin={malformed_margin} must be >= 0.")
        self.format = format
        self.strict = strict
        self.malformed_reward = malformed_reward
        self.malformed_margin = malformed_margin
        self.starts_in_thinking = starts_in_thinking
        self.system_prompt = system_prompt
        self.original_prompt_column = original_prompt_column
        self.__name__ = name
        self.stats = ScorerStats()
        self._stats_lock = threading.Lock()

    def split(self, completion: Any) -> ThinkingSplit:
        """`split_thinking` of one TRL completion (string or conversational) with this scorer's settings."""
        return split_thinking(completion_text(completion), self.format, starts_in_thinking=self.starts_in_thinking)

    def conversations(
        self, prompts: Sequence[Any], completions: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> tuple[list[list[dict[str, Any]]], list[ThinkingSplit]]:
        """The reward model's input for every completion (original prompt + response only), and the splits."""
        if len(prompts) != len(completions):
            raise ValueError(f"Got {len(prompts)} prompts for {len(completions)} completions.")
        column = self.original_prompt_column
        if column is not None and kwargs.get(column) is not None:
            originals = [prompt_messages(p) for p in kwargs[column]]
        else:
            originals = [original_prompt(p, self.format, system_prompt=self.system_prompt) for p in prompts]
        splits = [self.split(completion) for completion in completions]
        conversations = [
            [*messages, {"role": "assistant", "content": split.response}]
            for messages, split in zip(originals, splits, strict=True)
        ]
        return conversations, splits

    def to_score(self, splits: Sequence[ThinkingSplit]) -> list[int]:
        """Indices the reward model must score: all in lenient mode, the well-formed ones in strict mode."""
        return [i for i, split in enumerate(splits) if split.well_formed or not self.strict]

    def finalize(
        self,
        splits: Sequence[ThinkingSplit],
        indices: Sequence[int],
        scores: Sequence[float | None],
        log_metric: Callable[[str, float], None] | None,
    ) -> list[float | None]:
        """Place the reward model's scores and give malformed completions (strict mode) the lowest reward.

        The lowest reward is ``malformed_reward`` when set, else the batch minimum: the lowest score of this call
        minus ``malformed_margin`` (``-malformed_margin`` when nothing was scored); so a malformed completion always
        ranks below every well-formed one of its group.
        """
        rewards: list[float | None] = [None] * len(splits)
        for index, score in zip(indices, scores, strict=True):
            rewards[index] = score
        malformed = [i for i, split in enumerate(splits) if not split.well_formed]
        if self.strict and malformed:
            if self.malformed_reward is not None:
                lowest = self.malformed_reward
            else:
                valid = [s for s in scores if s is not None and math.isfinite(s)]
                lowest = (min(valid) if valid else 0.0) - self.malformed_margin
            for i in malformed:
                rewards[i] = lowest
        with self._stats_lock:
            self.stats.completions += len(splits)
            self.stats.malformed += len(malformed)
        if log_metric is not None and splits:
            log_metric(f"{self.__name__}/malformed_ratio", len(malformed) / len(splits))
            scored = [s for s in scores if s is not None]
            if scored:
                log_metric(f"{self.__name__}/response_score_mean", sum(scored) / len(scored))
        return rewards


class RewardModelScorer(_ResponseOnlyScorer):
    """A ``transformers`` sequence-classification reward model as a TRL reward function, scoring responses only.

    For each completion: split off the plan (`split_thinking`), rebuild the user's conversation (the dataset column
    ``original_prompt_column`` when present, else `original_prompt` of the prompt), append the response as the
    assistant turn, render it with the **reward model's** chat template, and read the score (logit
    ``label_index``). Batched, sorted by length, under ``torch.inference_mode``, on the scorer's own device and
    dtype: the reward model is not the policy and is never wrapped by Accelerate.

    Do not pass a reward model directly to `GRPOTrainer`: TRL would score the prompt *and the whole completion*,
    plan included. Wrap it in this class.

    Args:
        model: a model id/path (loaded with ``AutoModelForSequenceClassification``) or a loaded model.
        tokenizer: its tokenizer (loaded from ``model`` when it is a path). Must have a chat template, or pass
            ``chat_template``.
        format: ``"instruct"`` or ``"zero"`` (how completions are split).
        strict: malformed completions (see `split_thinking`) get the lowest reward instead of a score.
        malformed_reward: that lowest reward; ``None`` = the batch minimum minus ``malformed_margin``.
        malformed_margin: see ``malformed_reward``.
        starts_in_thinking: the policy's template pre-fills ``<think>`` (see `split_thinking`).
        device: where the reward model runs; ``None`` = the current CUDA device when there is one (each Accelerate
            process has its own), else CPU; resolved at the first call.
        dtype: e.g. ``"bfloat16"`` or ``torch.bfloat16``; ``None`` keeps the model's.
        batch_size: conversations per forward pass.
        max_length: longest input in tokens; longer inputs lose their *beginning* (the response end is kept).
        label_index: which logit is the score (reward models have one label: 0).
        chat_template: overrides the tokenizer's chat template.
        system_prompt: the RLMT instruction to remove from prompts (see `original_prompt`).
        original_prompt_column: dataset column with the user's original prompt (`rlmt_format_dataset` adds it).
        name: ``__name__`` for TRL's metric names.
        model_init_kwargs: extra ``from_pretrained`` arguments when ``model`` is a path.
    """

    def __init__(
        self,
        model: str | torch.nn.Module,
        tokenizer: Any = None,
        *,
        format: Format = "instruct",
        strict: bool = True,
        malformed_reward: float | None = None,
        malformed_margin: float = 1.0,
        starts_in_thinking: bool = False,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 8,
        max_length: int | None = None,
        label_index: int = 0,
        chat_template: str | None = None,
        system_prompt: str = INSTRUCT_SYSTEM_PROMPT,
        original_prompt_column: str | None = ORIGINAL_PROMPT_COLUMN,
        name: str = "reward_model",
        model_init_kwargs: dict[str, Any] | None = None,
    ):
        super().__init__(
            format=format,
            strict=strict,
            malformed_reward=malformed_reward,
            malformed_margin=malformed_margin,
            starts_in_thinking=starts_in_thinking,
            system_prompt=system_prompt,
            original_prompt_column=original_prompt_column,
            name=name,
        )
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1.")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length={max_length} must be >= 1 or None.")
        torch_dtype = _resolve_dtype(dtype)
        if isinstance(model, str):
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            init_kwargs = dict(model_init_kwargs or {})
            if torch_dtype is not None:
                init_kwargs.setdefault("dtype", torch_dtype)
            tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model)
            model = AutoModelForSequenceClassification.from_pretrained(model, **init_kwargs)
        elif not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a model id/path or a torch.nn.Module, got {type(model).__name__}.")
        if tokenizer is None:
            raise ValueError("Pass the reward model's tokenizer: tokenizer=AutoTokenizer.from_pretrained(<rm id>).")
        num_labels = getattr(getattr(model, "config", None), "num_labels", 1)
        if not 0 <= label_index < num_labels:
            raise ValueError(f"label_index={label_index} but the reward model has {num_labels} label(s).")
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "The reward model's tokenizer has no chat template, so the (prompt, response) conversation cannot be "
                "rendered the way the reward model was trained: pass chat_template=..."
            )
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = tokenizer.pad_token_id  # sequence classification reads the last non-pad token
        if torch_dtype is not None:
            model = model.to(dtype=torch_dtype)
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.label_index = label_index
        self._device = torch.device(device) if device is not None else None

    @property
    def device(self) -> torch.device:
        if self._device is None:
            self._device = (
                torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
            )
        return self._device

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        conversations, splits = self.conversations(prompts, completions, kwargs)
        indices = self.to_score(splits)
        scores = self.score_conversations([conversations[i] for i in indices])
        return self.finalize(splits, indices, scores, kwargs.get("log_metric"))

    def render(self, conversation: Sequence[Mapping[str, Any]]) -> str:
        """The text the reward model reads for one conversation (its own chat template)."""
        return self.tokenizer.apply_chat_template(list(conversation), tokenize=False)

    @torch.inference_mode()
    def score_conversations(self, conversations: Sequence[Sequence[Mapping[str, Any]]]) -> list[float]:
        """Reward-model scores of full conversations (the last turn being the assistant's response)."""
        if not conversations:
            return []
        if next(self.model.parameters()).device != self.device:
            self.model.to(self.device)
        texts = [self.render(conversation) for conversation in conversations]
        encoded = [self._encode(text) for text in texts]
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        scores: list[float] = [0.0] * len(encoded)
        pad_id = self.tokenizer.pad_token_id
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            width = max(len(encoded[i]) for i in chunk)
            input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, i in enumerate(chunk):  # right padding keeps positions of the real tokens unchanged
                input_ids[row, : len(encoded[i])] = torch.tensor(encoded[i])
                attention_mask[row, : len(encoded[i])] = 1
            logits = self.model(
                input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device)
            ).logits
            values = logits[:, self.label_index].float().cpu().tolist()
            for i, value in zip(chunk, values, strict=True):
                scores[i] = value
        return scores

    def _encode(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the chat template adds its own BOS
        if self.max_length is not None and len(ids) > self.max_length:
            ids = ids[-self.max_length :]
        return ids


class ServedRewardModelScorer(_ResponseOnlyScorer):
    """A reward model served over HTTP by vLLM (or a server with the same API), scoring responses only.

    vLLM serves a sequence-classification reward model (``vllm serve <rm> --runner pooling``) with a
    ``POST /classify`` route (at the server root, not under ``/v1``; SGLang serves the same API at
    ``/v1/classify``). The request carries ``model`` and either ``messages`` (one conversation, rendered with the
    reward model's own chat template on the server) or ``input`` (a list of rendered texts); the reply's
    ``data[i].probs`` holds the logits, after an activation unless ``use_activation`` is false. This scorer sends:

    - ``request_mode="messages"`` (default): one request per completion with the conversation, so the server
      applies the reward model's chat template (needs a vLLM with chat-style classify requests);
    - ``request_mode="text"``: batches of ``batch_size`` texts rendered here with ``tokenizer``'s chat template
      (the reward model's tokenizer), sent with ``add_special_tokens: false``;

    and ``use_activation: false`` by default, so the score is the raw logit, as `RewardModelScorer` reads it.

    Requests use the OpenAI SDK's HTTP client (``max_retries`` with backoff on 408/409/429/5xx and connection
    errors, ``timeout`` per request), at most ``max_concurrency`` at once. A request that still fails gives its
    completions ``fallback_reward`` and is counted in ``stats.failed``; nothing is raised into training.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        path: str = "/classify",
        request_mode: Literal["messages", "text"] = "messages",
        tokenizer: Any = None,
        use_activation: bool | None = False,
        label_index: int = 0,
        batch_size: int = 32,
        max_concurrency: int = 16,
        timeout: float = 60.0,
        max_retries: int = 3,
        api_key_env: str | None = None,
        fallback_reward: float | None = None,
        format: Format = "instruct",
        strict: bool = True,
        malformed_reward: float | None = None,
        malformed_margin: float = 1.0,
        starts_in_thinking: bool = False,
        system_prompt: str = INSTRUCT_SYSTEM_PROMPT,
        original_prompt_column: str | None = ORIGINAL_PROMPT_COLUMN,
        name: str = "served_reward_model",
    ):
        super().__init__(
            format=format,
            strict=strict,
            malformed_reward=malformed_reward,
            malformed_margin=malformed_margin,
            starts_in_thinking=starts_in_thinking,
            system_prompt=system_prompt,
            original_prompt_column=original_prompt_column,
            name=name,
        )
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url={base_url!r} must be the server root, e.g. 'http://127.0.0.1:8000'.")
        if request_mode not in ("messages", "text"):
            raise ValueError(f"request_mode={request_mode!r} must be 'messages' or 'text'.")
        if request_mode == "text" and (tokenizer is None or getattr(tokenizer, "chat_template", None) is None):
            raise ValueError(
                "request_mode='text' renders conversations locally: pass the reward model's tokenizer (with its chat "
                "template), or use request_mode='messages' to let the server render them."
            )
        for label, value in (("batch_size", batch_size), ("max_concurrency", max_concurrency)):
            if value < 1:
                raise ValueError(f"{label}={value} must be >= 1.")
        if not timeout > 0 or max_retries < 0:
            raise ValueError(f"timeout={timeout} must be > 0 and max_retries={max_retries} >= 0.")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.path = "/" + path.lstrip("/")
        self.request_mode = request_mode
        self.tokenizer = tokenizer
        self.use_activation = use_activation
        self.label_index = label_index
        self.batch_size = batch_size
        self.max_concurrency = max_concurrency
        self.timeout = float(timeout)
        self.max_retries = max_retries
        self.api_key_env = api_key_env
        self.fallback_reward = fallback_reward
        self._per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[Any, asyncio.Semaphore]] = (
            weakref.WeakKeyDictionary()
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.base_url + self.path!r}, model={self.model!r})"

    async def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        conversations, splits = self.conversations(prompts, completions, kwargs)
        indices = self.to_score(splits)
        scores = await self.score_conversations([conversations[i] for i in indices])
        return self.finalize(splits, indices, scores, kwargs.get("log_metric"))

    async def score_conversations(self, conversations: Sequence[Sequence[Mapping[str, Any]]]) -> list[float | None]:
        """Scores of full conversations; ``fallback_reward`` for those whose request failed."""
        if self.request_mode == "messages":
            bodies = [{"messages": list(conversation)} for conversation in conversations]
            sizes = [1] * len(bodies)
        else:
            texts = [self.tokenizer.apply_chat_template(list(c), tokenize=False) for c in conversations]
            chunks = [texts[i : i + self.batch_size] for i in range(0, len(texts), self.batch_size)]
            bodies = [{"input": chunk, "add_special_tokens": False} for chunk in chunks]
            sizes = [len(chunk) for chunk in chunks]
        results = await asyncio.gather(*(self._request(body, size) for body, size in zip(bodies, sizes, strict=True)))
        return [score for chunk in results for score in chunk]

    async def _request(self, body: dict[str, Any], size: int) -> list[float | None]:
        import openai

        client, semaphore = self._resources()
        payload = {"model": self.model, **body}
        if self.use_activation is not None:
            payload["use_activation"] = self.use_activation
        try:
            async with semaphore:
                reply = await client.post(self.path, cast_to=object, body=payload)
            return _classify_scores(reply, size, self.label_index)
        except (openai.APIError, ValueError, KeyError, TypeError, IndexError) as error:
            with self._stats_lock:
                self.stats.failed += size
            logger.warning(
                "%s: scoring %d conversation(s) at %s failed (%s: %s); they get the fallback reward %s.",
                self.__name__,
                size,
                self.base_url + self.path,
                type(error).__name__,
                str(error)[:200],
                self.fallback_reward,
            )
            return [self.fallback_reward] * size

    def _resources(self) -> tuple[Any, asyncio.Semaphore]:
        import os

        import openai

        loop = asyncio.get_running_loop()
        resources = self._per_loop.get(loop)
        if resources is None:
            key = os.environ.get(self.api_key_env) if self.api_key_env else None
            client = openai.AsyncOpenAI(
                base_url=self.base_url, api_key=key or "EMPTY", max_retries=self.max_retries, timeout=self.timeout
            )
            resources = (client, asyncio.Semaphore(self.max_concurrency))
            self._per_loop[loop] = resources
        return resources


def _classify_scores(reply: Any, size: int, label_index: int) -> list[float]:
    """Scores from a ``/classify`` reply: ``data[i].probs[label_index]`` in ``index`` order."""
    data = reply["data"]
    if len(data) != size:
        raise ValueError(f"the server returned {len(data)} results for {size} inputs")
    ordered = sorted(data, key=lambda item: item.get("index", 0))
    scores = [float(item["probs"][label_index]) for item in ordered]
    if not all(math.isfinite(s) for s in scores):
        raise ValueError(f"non-finite score in {scores}")
    return scores


def _resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype name; use e.g. 'bfloat16', 'float16' or 'float32'.")
    return resolved


# ----------------------------------------------------------------------------------------------------------------
# On-policy DPO pairs (the paper's DPO variant: best vs worst of 8 samples by reward-model score)
# ----------------------------------------------------------------------------------------------------------------
def select_dpo_pair(scores: Sequence[float | None], min_margin: float = 0.0) -> tuple[int, int] | None:
    """``(chosen, rejected)`` indices: the best and the worst score; ``None`` when no preference exists.

    Scores that are ``None`` or not finite are ignored. Ties break towards the earliest sample (for both the best
    and the worst). No pair when fewer than two scores are valid, or when ``best - worst <= min_margin`` (with the
    default 0, when all valid scores are equal).
    """
    if min_margin < 0:
        raise ValueError(f"min_margin={min_margin} must be >= 0.")
    valid = [(i, float(s)) for i, s in enumerate(scores) if s is not None and math.isfinite(s)]
    if len(valid) < 2:
        return None
    best = max(valid, key=lambda item: (item[1], -item[0]))
    worst = min(valid, key=lambda item: (item[1], item[0]))
    if best[1] - worst[1] <= min_margin:
        return None
    return best[0], worst[0]


def build_dpo_pairs(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    scores: Sequence[float | None],
    *,
    group_ids: Sequence[Any] | None = None,
    min_margin: float = 0.0,
) -> Any:
    """On-policy DPO rows from scored samples: per prompt, chosen = best and rejected = worst by score.

    Samples are grouped by ``group_ids`` when given, else by equal prompts (groups keep the order in which they
    first appear). Groups without a preference (`select_dpo_pair`: fewer than two valid scores, or all tied within
    ``min_margin``) are skipped and counted in the log. Completions are kept whole (plan and response): the policy
    learns to produce both, while the scores came from the response alone.

    Returns:
        A `datasets.Dataset` with ``prompt``, ``chosen``, ``rejected`` (the formats TRL's ``DPOTrainer`` reads:
        strings, or conversational prompts with lists of assistant messages) and ``chosen_score``,
        ``rejected_score``.
    """
    from datasets import Dataset

    if not len(prompts) == len(completions) == len(scores):
        raise ValueError(
            f"Got {len(prompts)} prompts, {len(completions)} completions and {len(scores)} scores: pass one prompt "
            "and one score per completion (repeat each prompt once per sample)."
        )
    if group_ids is not None and len(group_ids) != len(prompts):
        raise ValueError(f"group_ids has {len(group_ids)} entries for {len(prompts)} samples.")
    groups: dict[Any, list[int]] = {}
    for i, prompt in enumerate(prompts):
        key = group_ids[i] if group_ids is not None else _prompt_key(prompt)
        groups.setdefault(key, []).append(i)
    rows: dict[str, list[Any]] = {"prompt": [], "chosen": [], "rejected": [], "chosen_score": [], "rejected_score": []}
    skipped = 0
    for members in groups.values():
        pair = select_dpo_pair([scores[i] for i in members], min_margin)
        if pair is None:
            skipped += 1
            continue
        chosen, rejected = members[pair[0]], members[pair[1]]
        rows["prompt"].append(prompts[chosen])
        rows["chosen"].append(_as_dpo_completion(completions[chosen], prompts[chosen]))
        rows["rejected"].append(_as_dpo_completion(completions[rejected], prompts[chosen]))
        rows["chosen_score"].append(float(scores[chosen]))
        rows["rejected_score"].append(float(scores[rejected]))
    logger.info(
        "On-policy DPO pairs: %d pairs from %d prompts (%d skipped: fewer than two valid scores or no margin).",
        len(rows["prompt"]),
        len(groups),
        skipped,
    )
    return Dataset.from_dict(rows)


def _prompt_key(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)


def _as_dpo_completion(completion: Any, prompt: Any) -> Any:
    """Conversational prompts need conversational completions in TRL's DPO format."""
    if isinstance(prompt, str) or not isinstance(completion, str):
        return completion if isinstance(completion, str) else [dict(m) for m in completion]
    return [{"role": "assistant", "content": completion}]


@torch.no_grad()
def sample_on_policy_pairs(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Any],
    scorer: Callable[..., Any],
    *,
    num_samples: int = 8,
    max_new_tokens: int = 1024,
    temperature: float = 0.7,
    top_p: float = 1.0,
    stop_strings: Sequence[str] | None = None,
    min_margin: float = 0.0,
    generation_kwargs: dict[str, Any] | None = None,
    scorer_kwargs: dict[str, Sequence[Any]] | None = None,
) -> Any:
    """Sample ``num_samples`` completions per prompt from the policy with ``transformers``, score them with
    ``scorer`` (any TRL-style reward function, e.g. a `RewardModelScorer`; async ones are awaited), and build the
    DPO pairs (`build_dpo_pairs`). For large runs, sample with vLLM instead and call `build_dpo_pairs` yourself.

    Conversational prompts are rendered with the tokenizer's chat template (generation prompt added); string
    prompts (the "zero" format) are used as they are. Completions are cut after the first stop string.
    ``scorer_kwargs`` holds per-prompt dataset columns for the scorer (repeated per sample here).
    """
    if num_samples < 2:
        raise ValueError(f"num_samples={num_samples}: a pair needs at least 2 samples per prompt (the paper uses 8).")
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    all_prompts, all_completions, group_ids = [], [], []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            text = prompt
        else:
            text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
        input_ids = tokenizer(text, return_tensors="pt", add_special_tokens=isinstance(prompt, str))["input_ids"]
        output = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=torch.ones_like(input_ids).to(device),
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            num_return_sequences=num_samples,
            pad_token_id=pad_id,
            **(generation_kwargs or {}),
        )
        texts = tokenizer.batch_decode(output[:, input_ids.shape[1] :], skip_special_tokens=True)
        for text_out in texts:
            if stop_strings:
                text_out = truncate_at_stop(text_out, stop_strings)
            all_prompts.append(prompt)
            all_completions.append(
                text_out if isinstance(prompt, str) else [{"role": "assistant", "content": text_out}]
            )
            group_ids.append(index)
    columns = {key: [values[g] for g in group_ids] for key, values in (scorer_kwargs or {}).items()}
    scores = scorer(prompts=all_prompts, completions=all_completions, **columns)
    if inspect.isawaitable(scores):
        scores = asyncio.run(_await(scores))
    return build_dpo_pairs(all_prompts, all_completions, list(scores), group_ids=group_ids, min_margin=min_margin)


async def _await(awaitable: Any) -> Any:
    return await awaitable


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
