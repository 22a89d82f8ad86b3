"""A robust async client for OpenAI-compatible chat endpoints, shared by every LLM judge in trl-ext.

`AsyncChatClient` wraps `openai.AsyncOpenAI` with what a training loop needs from a remote judge:

- **bounded concurrency**: at most ``max_concurrency`` requests in flight per event loop (a semaphore held only
  while a request is on the wire, not during backoff);
- **a per-request deadline** (``timeout`` seconds, wall clock, including a server that accepts and never answers);
- **retries with exponential backoff** and jitter on 429, 408/409/425, 5xx, timeouts and connection errors,
  honouring ``Retry-After`` (capped at ``backoff_max``); other 4xx fail at once;
- **structured output with fallback**: in ``structured_output="auto"`` a ``response_format`` the endpoint rejects
  (HTTP 400/422) is dropped for the rest of the client's life and the request is re-sent without it;
- the API key read from an environment variable named in the config and never logged or shown in ``repr``.

After the retries it raises `ChatCallError`; callers decide what a failure means (the span judge gives the rollout
zero credit). `BackgroundEventLoop` runs coroutines from synchronous code (a trainer) on a daemon thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import openai

logger = logging.getLogger(__name__)

T = TypeVar("T")

STRUCTURED_OUTPUT_MODES = ("auto", "on", "off")
RETRYABLE_STATUS = frozenset({408, 409, 425, 429})


class ChatCallError(RuntimeError):
    """A chat request failed for good (after retries, or at once for a non-retryable error).

    Attributes:
        kind: ``"timeout"``, ``"rate_limit"``, ``"server_error"``, ``"connection"``, ``"client_error"`` or
            ``"bad_response"``.
        status: the last HTTP status, when there was one.
        attempts: requests sent.
    """

    def __init__(self, message: str, *, kind: str, status: int | None, attempts: int):
        super().__init__(message)
        self.kind, self.status, self.attempts = kind, status, attempts


@dataclass
class ChatResult:
    """One successful chat completion.

    Attributes:
        message: the assistant message as a plain dict (``role``, ``content``, and ``tool_calls`` when present), ready
            to be appended to the conversation.
        finish_reason: the choice's finish reason.
        latency_s: wall time of the call, retries and backoff included.
        attempts: requests sent (1 = no retry).
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


@dataclass
class ChatClientStats:
    """Counters since the client was created (all event loops together)."""

    requests: int = 0
    retries: int = 0
    failures: int = 0
    timeouts: int = 0
    rate_limited: int = 0
    server_errors: int = 0
    structured_fallbacks: int = 0


@dataclass
class _Failure:
    """Why one attempt failed: ``kind`` (see `ChatCallError`), HTTP ``status``, ``Retry-After`` seconds, the error."""

    kind: str
    status: int | None
    retry_after: float | None
    error: Any


@dataclass
class _LoopResources:
    client: openai.AsyncOpenAI
    semaphore: asyncio.Semaphore
    closer: Any = None  # an async generator whose `finally` closes `client` when the loop shuts down
    in_flight: int = 0
    peak_in_flight: int = 0


class AsyncChatClient:
    """Robust async calls to one model behind an OpenAI-compatible ``/v1/chat/completions`` endpoint.

    Args:
        base_url: endpoint root, e.g. ``"http://127.0.0.1:8000/v1"`` (vLLM) or ``"https://api.openai.com/v1"``.
        model: model name sent with every request.
        api_key_env: name of the environment variable holding the API key. When it is unset (or ``None``) the
            placeholder ``"EMPTY"`` is sent, which local servers accept.
        max_concurrency: requests in flight at once, per event loop.
        timeout: seconds one request may take, wall clock.
        max_retries: retries after the first attempt for retryable errors.
        backoff_initial: delay before the first retry, seconds; doubles each retry (times a jitter in [0.5, 1]).
        backoff_max: cap on any single delay, ``Retry-After`` included.
        structured_output: ``"auto"`` (send ``response_format`` when given, drop it if the endpoint rejects it),
            ``"on"`` (always send; a rejection is an error) or ``"off"`` (never send).
        request_params: extra parameters for every request (e.g. ``{"temperature": 0.0, "max_tokens": 2048}``).
        seed: seeds the backoff jitter.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key_env: str | None = "OPENAI_API_KEY",
        max_concurrency: int = 32,
        timeout: float = 120.0,
        max_retries: int = 3,
        backoff_initial: float = 1.0,
        backoff_max: float = 30.0,
        structured_output: str = "auto",
        request_params: dict[str, Any] | None = None,
        seed: int | None = None,
    ):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url={base_url!r} must be an http(s) URL such as 'http://127.0.0.1:8000/v1'.")
        if not model:
            raise ValueError("model must name the judge model served at base_url, e.g. 'Qwen/Qwen3-8B'.")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency} must be >= 1.")
        if not timeout > 0:
            raise ValueError(f"timeout={timeout} must be > 0 seconds.")
        if max_retries < 0:
            raise ValueError(f"max_retries={max_retries} must be >= 0 (0 = no retry).")
        if backoff_initial < 0 or backoff_max < backoff_initial:
            raise ValueError(
                f"backoff_initial={backoff_initial}, backoff_max={backoff_max}: need 0 <= backoff_initial <= backoff_max."
            )
        if structured_output not in STRUCTURED_OUTPUT_MODES:
            raise ValueError(f"structured_output={structured_output!r} must be one of {STRUCTURED_OUTPUT_MODES}.")
        self.base_url = base_url
        self.model = model
        self.api_key_env = api_key_env
        self.max_concurrency = max_concurrency
        self.timeout = float(timeout)
        self.max_retries = max_retries
        self.backoff_initial = float(backoff_initial)
        self.backoff_max = float(backoff_max)
        self.structured_output = structured_output
        self.request_params = dict(request_params or {})
        self.stats = ChatClientStats()
        self._structured_supported = structured_output != "off"
        self._random = random.Random(seed)
        self._per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopResources] = (
            weakref.WeakKeyDictionary()
        )
        self._stats_lock = threading.Lock()

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
        """Most requests ever in flight at once on any one event loop (checks the concurrency bound)."""
        return max((r.peak_in_flight for r in list(self._per_loop.values())), default=0)

    def _api_key(self) -> str:
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if not key:
            logger.debug("Env var %r is unset: sending a placeholder API key.", self.api_key_env)
            return "EMPTY"
        return key

    async def _resources(self) -> _LoopResources:
        loop = asyncio.get_running_loop()
        resources = self._per_loop.get(loop)
        if resources is None:
            client = openai.AsyncOpenAI(
                base_url=self.base_url,
                api_key=self._api_key(),
                max_retries=0,  # retries are ours, so they can be counted and bounded
                timeout=self.timeout + 1.0,  # the wall-clock deadline below is the binding one
            )
            # `asyncio.run` (and `BackgroundEventLoop.close`) finalise the loop's async generators before closing it:
            # this one closes the HTTP client there, instead of a garbage-collected client trying to on a dead loop.
            closer = _close_on_shutdown(client)
            await closer.__anext__()
            resources = _LoopResources(client, asyncio.Semaphore(self.max_concurrency), closer)
            self._per_loop[loop] = resources
        return resources

    def _count(self, **increments: int) -> None:
        with self._stats_lock:
            for name, value in increments.items():
                setattr(self.stats, name, getattr(self.stats, name) + value)

    def _delay(self, retry: int, retry_after: float | None) -> float:
        delay = min(self.backoff_max, self.backoff_initial * (2**retry)) * self._random.uniform(0.5, 1.0)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.backoff_max))
        return delay

    async def chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        response_format: dict[str, Any] | None = None,
        **params: Any,
    ) -> ChatResult:
        """Send one chat completion request, with retries.

        Args:
            messages: the conversation (OpenAI message dicts).
            tools: OpenAI tool (function) definitions; omitted when None or empty.
            tool_choice: forwarded when tools are sent.
            response_format: e.g. ``{"type": "json_schema", "json_schema": {...}}``; subject to ``structured_output``.
            **params: per-request parameters overriding ``request_params``.

        Raises:
            ChatCallError: after the retries, or at once for a non-retryable error.
        """
        started = time.perf_counter()
        attempts, retry = 0, 0
        while True:
            use_structured = response_format is not None and self._structured_supported
            body: dict[str, Any] = {**self.request_params, **params, "model": self.model, "messages": list(messages)}
            if tools:
                body["tools"] = list(tools)
                if tool_choice is not None:
                    body["tool_choice"] = tool_choice
            if use_structured:
                body["response_format"] = response_format
            attempts += 1
            outcome = await self._attempt(body)
            if isinstance(outcome, ChatResult):
                outcome.latency_s = time.perf_counter() - started
                outcome.attempts, outcome.structured = attempts, use_structured
                return outcome
            kind, status = outcome.kind, outcome.status
            if kind == "client_error" and status in (400, 422) and use_structured and self.structured_output == "auto":
                self._structured_supported = False
                self._count(structured_fallbacks=1)
                logger.warning(
                    "Judge endpoint %s rejected response_format (HTTP %s); falling back to free-form JSON replies "
                    "parsed tolerantly. Set structured_output='off' to skip this probe.",
                    self.base_url,
                    status,
                )
                continue
            retryable = kind in ("timeout", "rate_limit", "server_error", "connection", "bad_response")
            if not retryable or retry >= self.max_retries:
                self._count(failures=1)
                raise ChatCallError(
                    f"Chat request to {self.base_url} (model {self.model!r}) failed after {attempts} attempt(s): "
                    f"{kind} {status or ''} {outcome.error}".strip(),
                    kind=kind,
                    status=status,
                    attempts=attempts,
                )
            delay = self._delay(retry, outcome.retry_after)
            retry += 1
            self._count(retries=1)
            logger.debug("Judge request failed (%s %s); retry %d in %.2fs", kind, status, retry, delay)
            await asyncio.sleep(delay)

    async def _attempt(self, body: dict[str, Any]) -> ChatResult | _Failure:
        """Send one request (holding a concurrency slot); classify what went wrong, if anything."""
        resources = await self._resources()
        async with resources.semaphore:
            resources.in_flight += 1
            resources.peak_in_flight = max(resources.peak_in_flight, resources.in_flight)
            self._count(requests=1)
            try:
                # `post(..., cast_to=object)` (the SDK's documented route for raw calls) returns the JSON body as a
                # dict: the typed `chat.completions.create` costs ~1 ms of CPU per call in request transforms and
                # pydantic models, which at 32 calls in flight serialises into tens of ms per wave.
                response = await asyncio.wait_for(
                    resources.client.post("/chat/completions", cast_to=object, body=body), self.timeout
                )
            except (asyncio.TimeoutError, openai.APITimeoutError) as error:
                self._count(timeouts=1)
                return _Failure("timeout", None, None, str(error) or "timed out")
            except openai.APIStatusError as error:
                status = error.status_code
                retry_after = _retry_after_seconds(error)
                if status == 429:
                    self._count(rate_limited=1)
                    return _Failure("rate_limit", status, retry_after, error)
                if status >= 500:
                    self._count(server_errors=1)
                    return _Failure("server_error", status, retry_after, error)
                if status in RETRYABLE_STATUS:
                    return _Failure("server_error", status, retry_after, error)
                return _Failure("client_error", status, None, error)
            except openai.APIConnectionError as error:
                return _Failure("connection", None, None, error)
            except (openai.APIResponseValidationError, ValueError) as error:  # ValueError: a body that is not JSON
                return _Failure("bad_response", None, None, error)
            finally:
                resources.in_flight -= 1
        try:
            return _parse_completion(response)
        except (KeyError, IndexError, TypeError, AttributeError) as error:
            return _Failure(
                "bad_response", None, None, f"malformed chat completion ({error!r}): {str(response)[:200]}"
            )

    async def aclose(self) -> None:
        """Close the HTTP client of the running event loop."""
        loop = asyncio.get_running_loop()
        resources = self._per_loop.pop(loop, None)
        if resources is not None:
            await resources.closer.aclose()


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


def _retry_after_seconds(error: openai.APIStatusError) -> float | None:
    response = getattr(error, "response", None)
    value = response.headers.get("retry-after") if response is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: fall back to our own backoff


@dataclass
class BackgroundEventLoop:
    """An asyncio event loop on a daemon thread, so synchronous code (a trainer step) can start coroutines that run
    while it keeps working, and collect them later.

    ``submit(coro)`` returns a `concurrent.futures.Future`; ``close()`` stops the loop (also at interpreter exit).
    """

    name: str = "trl-ext-judge-loop"
    _loop: asyncio.AbstractEventLoop = field(init=False, repr=False)
    _thread: threading.Thread = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.call_soon(ready.set)
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        ready.wait()
        weakref.finalize(self, _stop_loop, self._loop, self._thread)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._loop.is_closed() or not self._thread.is_alive():
            raise RuntimeError("BackgroundEventLoop is closed; create a new one.")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from a thread other than the loop's)."""

        async def wrapper() -> T:
            return await coro

        return self.submit(wrapper()).result(timeout)

    def close(self) -> None:
        _stop_loop(self._loop, self._thread)


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    if loop.is_closed():
        return
    if thread.is_alive():
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
    if not thread.is_alive():
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())  # closes the HTTP clients opened on this loop
        except Exception as error:  # best effort at shutdown
            logger.debug("Could not finalise the judge loop's async generators: %r", error)
        loop.close()


async def _close_on_shutdown(client: openai.AsyncOpenAI) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await client.close()
