"""RLMT reward-model scorers: the reward model scores the prompt and the response, never the plan (docs/rlmt.md).

Both are TRL reward functions. `RewardModelScorer` runs a ``transformers`` sequence-classification reward model on its
own device/dtype with its own chat template; `ServedRewardModelScorer` asks a vLLM-served reward model over HTTP
(``POST /classify``). Both score ``prompt + response`` only (`split_thinking` removes the plan); in strict mode a
malformed completion gets the lowest reward.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import openai
import torch

from ...judge.endpoint import EndpointSettings, OpenAIEndpoint
from ...text import completion_text, prompt_messages
from .formats import INSTRUCT_SYSTEM_PROMPT, ORIGINAL_PROMPT_COLUMN, Format, _check_format, original_prompt
from .thinking import ThinkingSplit, split_thinking

logger = logging.getLogger(__name__)

# The `EndpointSettings` fields `ServedRewardModelScorer` takes, with its defaults: a local server without a key, and
# fewer, shorter requests than a chat judge's (a /classify request is one forward pass).
SERVED_ENDPOINT_DEFAULTS = {"api_key_env": None, "max_concurrency": 16, "timeout": 60.0, "max_retries": 3}


@dataclass
class ScorerStats:
    """Counters since the scorer was created: completions scored, malformed ones, failed requests (served RM)."""

    completions: int = 0
    malformed: int = 0
    failed: int = 0


class _ResponseOnlyScorer:
    """What both scorers share: splitting, the reward model's conversation, the malformed reward, logging.

    Its keyword arguments besides ``name`` (documented in `RewardModelScorer`) are the settings of every
    response-only scorer; a subclass takes them as ``**response_only`` and passes them on.
    """

    def __init__(
        self,
        *,
        name: str,
        format: Format = "instruct",
        strict: bool = True,
        malformed_reward: float | None = None,
        malformed_margin: float = 1.0,
        starts_in_thinking: bool = False,
        system_prompt: str = INSTRUCT_SYSTEM_PROMPT,
        original_prompt_column: str | None = ORIGINAL_PROMPT_COLUMN,
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
        device: where the reward model runs; ``None`` = the current CUDA device when there is one (each Accelerate
            process has its own), else CPU; resolved at the first call.
        dtype: e.g. ``"bfloat16"`` or ``torch.bfloat16``; ``None`` keeps the model's.
        batch_size: conversations per forward pass.
        max_length: longest input in tokens; longer inputs lose their *beginning* (the response end is kept).
        label_index: which logit is the score (reward models have one label: 0).
        chat_template: overrides the tokenizer's chat template.
        name: ``__name__`` for TRL's metric names.
        model_init_kwargs: extra ``from_pretrained`` arguments when ``model`` is a path.
        **response_only: the settings every response-only scorer takes (`ServedRewardModelScorer` too):

            - format: ``"instruct"`` (default) or ``"zero"`` (how completions are split).
            - strict: malformed completions (see `split_thinking`) get the lowest reward instead of a score
              (default True).
            - malformed_reward: that lowest reward; ``None`` (default) = the batch minimum minus
              ``malformed_margin``.
            - malformed_margin: see ``malformed_reward`` (default 1.0).
            - starts_in_thinking: the policy's template pre-fills ``<think>`` (see `split_thinking`; default False).
            - system_prompt: the RLMT instruction to remove from prompts (see `original_prompt`; default
              `INSTRUCT_SYSTEM_PROMPT`).
            - original_prompt_column: dataset column with the user's original prompt (`rlmt_format_dataset` adds
              it; default `ORIGINAL_PROMPT_COLUMN`).
    """

    def __init__(
        self,
        model: str | torch.nn.Module,
        tokenizer: Any = None,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 8,
        max_length: int | None = None,
        label_index: int = 0,
        chat_template: str | None = None,
        name: str = "reward_model",
        model_init_kwargs: dict[str, Any] | None = None,
        **response_only: Any,
    ):
        super().__init__(name=name, **response_only)
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

    and ``use_activation: false`` by default, so the score is the raw logit, as `RewardModelScorer` reads it. The
    response-only settings (``format``, ``strict``, ``malformed_reward``, ...) are `RewardModelScorer`'s.

    Requests go through `trl_ext.judge.endpoint.OpenAIEndpoint`, as the LLM judges' do. A request that still fails
    after the retries gives its completions ``fallback_reward`` and is counted in ``stats.failed``; nothing is
    raised into training.

    Keyword arguments besides those named: the connection settings of `trl_ext.judge.endpoint.EndpointSettings`
    (``api_key_env``, ``max_concurrency``, ``timeout``, ``max_retries``, documented there; this scorer's defaults are
    `SERVED_ENDPOINT_DEFAULTS`) and the response-only settings of `RewardModelScorer` (``format``, ``strict``, ...).
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
        fallback_reward: float | None = None,
        name: str = "served_reward_model",
        **options: Any,
    ):
        endpoint = {key: options.pop(key) for key in SERVED_ENDPOINT_DEFAULTS if key in options}
        super().__init__(name=name, **options)
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url={base_url!r} must be the server root, e.g. 'http://127.0.0.1:8000'.")
        if request_mode not in ("messages", "text"):
            raise ValueError(f"request_mode={request_mode!r} must be 'messages' or 'text'.")
        if request_mode == "text" and (tokenizer is None or getattr(tokenizer, "chat_template", None) is None):
            raise ValueError(
                "request_mode='text' renders conversations locally: pass the reward model's tokenizer (with its chat "
                "template), or use request_mode='messages' to let the server render them."
            )
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1.")
        self.settings = EndpointSettings(base_url, model, **(SERVED_ENDPOINT_DEFAULTS | endpoint))
        self.endpoint = OpenAIEndpoint(self.settings)
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.path = "/" + path.lstrip("/")
        self.request_mode = request_mode
        self.tokenizer = tokenizer
        self.use_activation = use_activation
        self.label_index = label_index
        self.batch_size = batch_size
        self.fallback_reward = fallback_reward

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
        payload = {"model": self.model, **body}
        if self.use_activation is not None:
            payload["use_activation"] = self.use_activation
        try:
            client = await self.endpoint.client()
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
