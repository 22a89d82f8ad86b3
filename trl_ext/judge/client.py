"""A robust async client for OpenAI-compatible chat endpoints, shared by every LLM judge in trl-ext.

`AsyncChatClient` wraps `openai.AsyncOpenAI` with what a training loop needs from a remote judge:

- **retries** are the openai SDK's own: it re-sends on 408, 409, 429, 5xx, timeouts and connection errors, with
  exponential backoff and jitter, honouring ``Retry-After``, up to ``max_retries`` times; other 4xx fail at once;
- **bounded concurrency**: at most ``max_concurrency`` HTTP requests in flight per event loop (a slot is held by one
  attempt on the wire, not during the SDK's backoff);
- **a per-attempt deadline** (``timeout`` seconds, wall clock, including a server that accepts and never answers);
- **counters** (`ChatClientStats`): every attempt, the SDK's retries among them, timeouts, 429s and 5xx are counted
  where they happen, in the SDK's HTTP client (`OpenAIEndpoint`'s);
- **structured output with fallback**: in ``structured_output="auto"`` a ``response_format`` the endpoint rejects
  (HTTP 400/422) is dropped for the rest of the client's life and the request is re-sent without it;
- **asking again for a usable reply** (`AsyncChatClient.chat_parsed`), which no HTTP client can do: a reply that
  arrives but cannot be parsed is followed by a repair request; both LLM judges go through it;
- **reading only the judge's own verdict**: a reply that holds several different verdicts is refused by
  `trl_ext.judge.verdicts.read_verdict` (`InjectionSuspected`), and `chat_parsed` asks again;
- the API key read from an environment variable named in the settings and never logged or shown in ``repr``.

Its settings are `trl_ext.judge.endpoint.EndpointSettings`; the HTTP part (one SDK client per event loop, its
retries, the concurrency bound, the deadline, the counters) is `trl_ext.judge.endpoint.OpenAIEndpoint`, which the
served RLMT reward model (`trl_ext.rewards.rlmt.ServedRewardModelScorer`) uses too.

After the SDK's retries `chat` raises `ChatCallError`; callers decide what a failure means (the span judge gives the
rollout zero credit). `trl_ext.judge.event_loop.BackgroundEventLoop` runs its coroutines from synchronous code
(a trainer) on a daemon thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Generic, TypeVar

import openai

from .endpoint import EndpointSettings, OpenAIEndpoint
from .verdicts import InjectionSuspected

logger = logging.getLogger(__name__)

T = TypeVar("T")

# What asking a judge can end in: the status of a `ParsedReply`, and of every judge verdict built from one.
REPLY_STATUSES = ("ok", "unparseable", "failed")


class ChatCallError(RuntimeError):
    """A chat request failed for good (after the SDK's retries, or at once for an error it does not retry).

    Attributes:
        kind: ``"timeout"``, ``"rate_limit"``, ``"server_error"`` (5xx, 408, 409), ``"connection"``,
            ``"client_error"`` (other 4xx) or ``"bad_response"`` (a 2xx whose body is not a chat completion; not
            re-sent here, `AsyncChatClient.chat_parsed` asks again).
        status: the last HTTP status, when there was one.
        attempts: HTTP requests sent.
        detail: what failed, without the request's description (``"connection: Connection error. (...)"``).
    """

    def __init__(self, message: str, *, kind: str, status: int | None, attempts: int, detail: str | None = None):
        super().__init__(message)
        self.kind, self.status, self.attempts = kind, status, attempts
        self.detail = detail if detail is not None else message


@dataclass
class ChatResult:
    """One successful chat completion.

    Attributes:
        message: the assistant message as a plain dict (``role``, ``content``, and ``tool_calls`` when present), ready
            to be appended to the conversation.
        finish_reason: the choice's finish reason.
        latency_s: wall time of the call, retries and backoff included.
        attempts: HTTP requests sent (1 = no retry).
        structured: whether ``response_format`` was sent with the successful request.
        usage: token usage reported by the endpoint, if any.
    """

    message: dict[str, Any]
    finish_reason: str | None
    latency_s: float
    attempts: int
    structured: bool
    usage: dict[str, Any] | None = None

    @property
    def content(self) -> str | None:
        return self.message.get("content")

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return self.message.get("tool_calls") or []


class ReplyCut(ValueError):
    """A reply that ended at the token limit (``finish_reason == "length"``): never parsed, asked again
    (`AsyncChatClient.chat_parsed`)."""


class JudgeOutcome:
    """Base of the results whose ``status`` is one of `REPLY_STATUSES` (`ParsedReply`, the judges' verdicts)."""

    status: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class ParsedReply(JudgeOutcome, Generic[T]):
    """What `AsyncChatClient.chat_parsed` got.

    Attributes:
        status: ``"ok"``, ``"unparseable"`` (the last reply did not parse) or ``"failed"`` (`ChatCallError`: the
            endpoint failed after the SDK's retries, or its last reply was not a chat completion).
        value: what ``parse`` returned, when ``"ok"``.
        error: why not ``"ok"``.
        raw_output: the text of the last reply (``None`` when there was none).
        requests: HTTP requests sent, the SDK's retries included (the ``first`` reply's not counted).
        repairs: follow-up requests sent after a reply that could not be used.
        injection_suspected: a reply was refused for holding several different verdicts (`InjectionSuspected`).
    """

    status: str
    value: T | None = None
    error: str | None = None
    raw_output: str | None = None
    requests: int = 0
    repairs: int = 0
    injection_suspected: bool = False


@dataclass
class ChatClientStats:
    """Counters since the client was created (all event loops together).

    Attributes:
        requests: HTTP requests sent (every attempt).
        retries: the SDK's re-sends among them (408/409/429/5xx, timeouts, connection errors).
        failures: `chat` calls that raised `ChatCallError`.
        timeouts: attempts that ran out of time.
        rate_limited: attempts answered 429.
        server_errors: attempts answered 5xx.
        structured_fallbacks: times the endpoint rejected ``response_format`` (``structured_output="auto"``).
    """

    requests: int = 0
    retries: int = 0
    failures: int = 0
    timeouts: int = 0
    rate_limited: int = 0
    server_errors: int = 0
    structured_fallbacks: int = 0


class AsyncChatClient:
    """Robust async calls to one model behind an OpenAI-compatible ``/v1/chat/completions`` endpoint.

    Args:
        base_url: the endpoint root, e.g. ``"http://127.0.0.1:8000/v1"``.
        model: the model name sent with every request.
        **settings: the other `EndpointSettings` fields (``api_key_env``, ``max_concurrency``, ``timeout``,
            ``max_retries``, ``structured_output``, ``request_params``), each documented there, with its defaults.
            `from_settings` builds a client from an `EndpointSettings`.
    """

    def __init__(self, base_url: str, model: str, **settings: Any):
        self.settings = EndpointSettings(base_url, model, **settings)
        self.endpoint = OpenAIEndpoint(self.settings, count=self._count)
        self.request_params = dict(self.settings.request_params)
        self.stats = ChatClientStats()
        self._structured_supported = self.settings.structured_output != "off"
        self._stats_lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: EndpointSettings) -> AsyncChatClient:
        """A client for the endpoint ``settings`` describe (e.g. `JudgeCreditConfig.judge_endpoint()`)."""
        return cls(**asdict(settings))

    def __repr__(self) -> str:  # never shows the key
        return (
            f"{type(self).__name__}(base_url={self.base_url!r}, model={self.model!r}, api_key_env={self.api_key_env!r}, "
            f"max_concurrency={self.max_concurrency}, timeout={self.timeout}, max_retries={self.max_retries})"
        )

    @property
    def structured_supported(self) -> bool:
        """False once the endpoint has rejected ``response_format`` (in ``"auto"`` mode) or in ``"off"`` mode."""
        return self._structured_supported

    @property
    def peak_in_flight(self) -> int:
        """Most HTTP requests ever in flight at once on any one event loop (checks the concurrency bound)."""
        return self.endpoint.peak_in_flight

    @property
    def base_url(self) -> str:
        return self.settings.base_url

    @property
    def model(self) -> str:
        return self.settings.model

    @property
    def api_key_env(self) -> str | None:
        return self.settings.api_key_env

    @property
    def max_concurrency(self) -> int:
        return self.settings.max_concurrency

    @property
    def timeout(self) -> float:
        return self.settings.timeout

    @property
    def max_retries(self) -> int:
        return self.settings.max_retries

    @property
    def structured_output(self) -> str:
        return self.settings.structured_output

    def _count(self, **increments: int) -> None:
        with self._stats_lock:
            for name, value in increments.items():
                setattr(self.stats, name, getattr(self.stats, name) + value)

    async def chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        response_format: dict[str, Any] | None = None,
        **params: Any,
    ) -> ChatResult:
        """Send one chat completion request (the SDK retries it as needed).

        Args:
            messages: the conversation (OpenAI message dicts).
            tools: OpenAI tool (function) definitions; omitted when None or empty.
            tool_choice: forwarded when tools are sent.
            response_format: e.g. ``{"type": "json_schema", "json_schema": {...}}``; subject to ``structured_output``.
            **params: per-request parameters overriding ``request_params``.

        Raises:
            ChatCallError: after the SDK's retries, at once for an error it does not retry, or for a reply that is
                not a chat completion (``kind="bad_response"``).
        """
        started = time.perf_counter()
        with self.endpoint.counting_attempts() as call:
            while True:
                use_structured = response_format is not None and self._structured_supported
                body: dict[str, Any] = {
                    **self.request_params,
                    **params,
                    "model": self.model,
                    "messages": list(messages),
                }
                if tools:
                    body["tools"] = list(tools)
                    if tool_choice is not None:
                        body["tool_choice"] = tool_choice
                if use_structured:
                    body["response_format"] = response_format
                client = await self.endpoint.client()
                call.sdk_attempts = 0
                try:
                    # `post(..., cast_to=object)` (the SDK's documented route for raw calls) returns the JSON body as a
                    # dict: the typed `chat.completions.create` costs ~1 ms of CPU per call in request transforms and
                    # pydantic models, which at 32 calls in flight serialises into tens of ms per wave.
                    response = await client.post("/chat/completions", cast_to=object, body=body)
                    result = _parse_completion(response)
                except openai.APIStatusError as error:
                    rejected = error.status_code in (400, 422) and use_structured
                    if rejected and self.structured_output == "auto":
                        self._drop_structured_output(error.status_code)
                        continue
                    raise self._failure(error, call.attempts) from error
                except (openai.APIError, ValueError, KeyError, IndexError, TypeError, AttributeError) as error:
                    raise self._failure(error, call.attempts) from error
                result.latency_s = time.perf_counter() - started
                result.attempts, result.structured = call.attempts, use_structured
                return result

    async def chat_parsed(
        self,
        messages: Sequence[dict[str, Any]],
        parse: Callable[[str], T],
        *,
        repairs: int,
        repair_prompt: Callable[[ValueError], str],
        first: ChatResult | None = None,
        **chat_kwargs: Any,
    ) -> ParsedReply[T]:
        """Ask until the reply can be used: the one place where trl-ext retries what the SDK cannot see.

        The SDK re-sends what failed on the wire; this follows up on a reply that arrived but is of no use. When
        ``parse`` rejects the reply's text (raises `ValueError`), the reply and ``repair_prompt(error)`` (a user
        message) are appended to the conversation and it is sent again; when the endpoint's reply was not a chat
        completion at all (`ChatCallError` of kind ``"bad_response"``), the same request is sent again. At most
        ``repairs`` follow-ups. Never raises `ChatCallError`: a failure is a ``"failed"`` `ParsedReply`.

        Args:
            messages: the conversation.
            parse: reply text -> value; raises `ValueError` (e.g. `SpanParseError`) for a reply it cannot use.
            repairs: follow-up requests allowed (0 = none).
            repair_prompt: the parse error -> the user message asking for a usable reply.
            first: a reply to ``messages`` already received (e.g. the last answer of a tool round), parsed first.
            **chat_kwargs: forwarded to `chat` (``response_format``, ``tools``, sampling parameters, ...).
        """
        if repairs < 0:
            raise ValueError(f"repairs={repairs} must be >= 0 (0 = no follow-up request).")
        conversation = list(messages)
        outcome: ParsedReply[T] = ParsedReply(status="failed")
        reply = first
        for attempt in range(repairs + 1):
            outcome.repairs = attempt
            if reply is None:
                try:
                    reply = await self.chat(conversation, **chat_kwargs)
                except ChatCallError as error:
                    outcome.requests += error.attempts
                    outcome.status, outcome.error, outcome.raw_output = "failed", str(error), None
                    if error.kind == "bad_response":
                        continue
                    return outcome
                outcome.requests += reply.attempts
            outcome.raw_output = reply.content
            try:
                if reply.finish_reason == "length":  # its own JSON is broken: what is still readable may be a quote
                    raise ReplyCut(
                        "the reply was cut at the token limit (finish_reason='length') before it ended; answer again "
                        "with the verdict only, shorter"
                    )
                outcome.value = parse(reply.content or "")
            except ValueError as error:
                outcome.status, outcome.error = "unparseable", str(error)
                outcome.injection_suspected |= isinstance(error, InjectionSuspected)
                conversation += [
                    {"role": "assistant", "content": reply.content or ""},
                    {"role": "user", "content": repair_prompt(error)},
                ]
                reply = None
                continue
            outcome.status, outcome.error = "ok", None
            return outcome
        return outcome

    def _drop_structured_output(self, status: int) -> None:
        self._structured_supported = False
        self._count(structured_fallbacks=1)
        logger.warning(
            "Judge endpoint %s rejected response_format (HTTP %s); falling back to free-form JSON replies parsed "
            "tolerantly. Set structured_output='off' to skip this probe.",
            self.base_url,
            status,
        )

    def _failure(self, error: Exception, attempts: int, *, count: bool = True) -> ChatCallError:
        """The `ChatCallError` for what the SDK raised (or for a body that is not a chat completion); counted in
        ``stats.failures`` unless ``count=False``."""
        status = error.status_code if isinstance(error, openai.APIStatusError) else None
        if isinstance(error, openai.APITimeoutError):  # before APIConnectionError, its base class
            kind, detail = "timeout", "timed out"
        elif status == 429:
            kind, detail = "rate_limit", str(error)
        elif status is not None and (status >= 500 or status in (408, 409)):
            kind, detail = "server_error", str(error)
        elif status is not None:
            kind, detail = "client_error", str(error)
        elif isinstance(error, openai.APIConnectionError):
            cause = error.__cause__  # the SDK's "Connection error." hides what failed (refused, DNS, TLS)
            kind, detail = "connection", str(error) + (f" ({type(cause).__name__}: {cause})" if cause else "")
        else:  # a body that is not JSON, or JSON that is not a chat completion
            kind, detail = "bad_response", f"not a chat completion ({type(error).__name__}: {error})"
        if count:
            self._count(failures=1)
        what = f"{kind} {status}" if status is not None else kind
        return ChatCallError(
            f"Chat request to {self.base_url} (model {self.model!r}) failed after {attempts} attempt(s): "
            f"{what}: {detail}",
            kind=kind,
            status=status,
            attempts=attempts,
            detail=f"{what}: {detail}",
        )

    async def probe(self, timeout: float = 10.0) -> EndpointProbe:
        """Check that the endpoint answers, without a chat request (nothing is generated or billed).

        Sends one ``GET <base_url>/models`` (the OpenAI-compatible model list; no retry, ``timeout`` seconds) with
        an SDK client of its own, so the counters and the concurrency bound are untouched. The endpoint answers when
        it replies at all, a 404 for the route included (not every server lists its models); a connection error, a
        timeout, a 5xx, or a 401/403 (the API key) are a problem. When the list comes back, ``models`` holds it.
        """
        client = openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.endpoint.api_key(), max_retries=0, timeout=timeout
        )
        try:
            page = await asyncio.wait_for(client.models.list(), timeout + 1.0)
            models = [str(getattr(item, "id", item)) for item in getattr(page, "data", [])]
            return EndpointProbe(ok=True, models=models)
        except openai.APIStatusError as error:
            if error.status_code in (401, 403) or error.status_code >= 500:
                return EndpointProbe(ok=False, error=self._failure(error, 1, count=False))
            return EndpointProbe(ok=True)  # it answers; it just does not list its models
        except (openai.APIError, asyncio.TimeoutError, ValueError, TypeError, AttributeError) as error:
            if isinstance(error, asyncio.TimeoutError):
                error = openai.APITimeoutError(request=None)  # type: ignore[arg-type]
            return EndpointProbe(ok=False, error=self._failure(error, 1, count=False))
        finally:
            await client.close()

    async def aclose(self) -> None:
        """Close the HTTP client of the running event loop."""
        await self.endpoint.aclose()


@dataclass
class EndpointProbe:
    """What `AsyncChatClient.probe` found.

    Attributes:
        ok: the endpoint answered.
        error: why not (``kind``: ``"connection"``, ``"timeout"``, ``"client_error"`` for 401/403,
            ``"server_error"``, ``"bad_response"``).
        models: the model names it serves, when it lists them.
    """

    ok: bool
    error: ChatCallError | None = None
    models: list[str] | None = None


def _parse_completion(response: Any) -> ChatResult:
    """Read the first choice of a chat-completion JSON body; raises KeyError/IndexError/TypeError if malformed."""
    choice = response["choices"][0]
    raw = choice["message"]
    message: dict[str, Any] = {"role": "assistant", "content": raw.get("content")}
    tool_calls = raw.get("tool_calls")
    if tool_calls:
        message["tool_calls"] = [
            {
                "id": call["id"],
                "type": call.get("type", "function"),
                "function": {"name": call["function"]["name"], "arguments": call["function"].get("arguments") or ""},
            }
            for call in tool_calls
        ]
    if not isinstance(message["content"], (str, type(None))):
        raise TypeError(f"message content is {type(message['content']).__name__}, not a string")
    return ChatResult(message, choice.get("finish_reason"), 0.0, 0, False, response.get("usage"))
