"""Where and how trl-ext reaches an OpenAI-compatible server: the settings (`EndpointSettings`) and the HTTP plumbing
every client shares (`OpenAIEndpoint`).

`EndpointSettings` is the one home of the endpoint settings and their help texts: `AsyncChatClient` takes them as
keywords, `RubricJudgeConfig` declares them as its own fields and `JudgeCreditConfig` as ``judge_<name>`` fields
(both with `trl_ext.fields.mirror_field`), and the served RLMT reward model (`ServedRewardModelScorer`) takes the
connection ones as keywords.

`OpenAIEndpoint` gives every event loop its own `openai.AsyncOpenAI` whose HTTP client (`_MeteredHttpClient`) holds
every attempt the SDK sends (the first and each retry) to ``max_concurrency`` in flight and ``timeout`` seconds of
wall clock, and counts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import logging
import os
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import openai

from ..fields import document_fields, documented

logger = logging.getLogger(__name__)

STRUCTURED_OUTPUT_MODES = ("auto", "on", "off")

# What the openai SDK re-sends (its `_should_retry`, and the timeouts and connection errors it catches), with its
# exponential backoff and jitter, honouring Retry-After. Any other 4xx fails at once.
RETRIED_ERRORS = "HTTP 408, 409, 429 and 5xx, timeouts and connection errors"


@document_fields
@dataclass(frozen=True)
class EndpointSettings:
    """The settings of one model behind an OpenAI-compatible endpoint (each field's help text is its doc).

    ``structured_output`` and ``request_params`` apply to chat requests (`AsyncChatClient`) only.
    """

    base_url: str = documented(
        help="Endpoint root the request paths are joined to, e.g. 'http://127.0.0.1:8000/v1' (a vLLM server) or "
        "'https://api.openai.com/v1'."
    )
    model: str = documented(help="Name of the model served at the endpoint, sent with every request.")
    api_key_env: str | None = documented(
        "OPENAI_API_KEY",
        "Environment variable holding the API key (never logged); when it is unset (or None) the placeholder "
        "'EMPTY' is sent, which local servers accept.",
    )
    max_concurrency: int = documented(32, "HTTP requests in flight at once, per event loop (per process).")
    timeout: float = documented(
        120.0,
        "Seconds one request attempt may take, wall clock (a server that accepts and never answers included); "
        "then the attempt is a timeout, which the SDK retries.",
    )
    max_retries: int = documented(
        3,
        f"Retries of a request by the openai SDK on {RETRIED_ERRORS}, with exponential backoff and jitter "
        "honouring Retry-After (0 = no retry); any other 4xx fails at once.",
    )
    structured_output: str = documented(
        "auto",
        "'auto' sends a JSON-schema response_format and drops it for good if the endpoint rejects "
        "it (HTTP 400/422), 'on' always sends it, 'off' never does; replies are parsed tolerantly in every mode.",
    )
    request_params: dict[str, Any] = documented(
        help="Extra parameters of every request, e.g. {'temperature': 0.0, 'max_tokens': 512}.",
        default_factory=dict,
    )

    def __post_init__(self) -> None:
        check_endpoint_settings({item.name: getattr(self, item.name) for item in fields(self)})

    @classmethod
    def from_fields(cls, source: Any, prefix: str = "", **overrides: Any) -> EndpointSettings:
        """The settings held by ``source``'s attributes ``<prefix><name>`` (a config's mirrored fields), with
        ``overrides`` for those it holds in another form; a bad value is named as ``<prefix><name>``."""
        values = {item.name: getattr(source, prefix + item.name) for item in fields(cls) if item.name not in overrides}
        values.update(overrides)
        check_endpoint_settings(values, prefix)
        return cls(**values)


def check_endpoint_settings(values: dict[str, Any], prefix: str = "") -> None:
    """Raise a `ValueError` naming the first bad setting of ``values`` (`EndpointSettings` field -> value) as
    ``<prefix><name>`` (the name the user set) and its fix."""
    base_url, model = values["base_url"], values["model"]
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ValueError(
            f"{prefix}base_url={base_url!r}: set it to the OpenAI-compatible endpoint root, an http(s) URL such as "
            "'http://127.0.0.1:8000/v1' for a local vLLM server or 'https://api.openai.com/v1'."
        )
    if not model:
        raise ValueError(f"{prefix}model is not set: give the model's name at {prefix}base_url, e.g. 'Qwen/Qwen3-8B'.")
    if values["max_concurrency"] < 1:
        raise ValueError(f"{prefix}max_concurrency={values['max_concurrency']} must be >= 1.")
    if not values["timeout"] > 0:
        raise ValueError(f"{prefix}timeout={values['timeout']} must be > 0 seconds.")
    retries = values["max_retries"]
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"{prefix}max_retries={retries!r} must be an integer >= 0 (0 = no retry).")
    if not isinstance(values["request_params"], Mapping):
        raise ValueError(
            f"{prefix}request_params={values['request_params']!r} must be a dict of request parameters, e.g. "
            "{'temperature': 0.0}."
        )
    if values["structured_output"] not in STRUCTURED_OUTPUT_MODES:
        raise ValueError(
            f"{prefix}structured_output={values['structured_output']!r}: use one of {list(STRUCTURED_OUTPUT_MODES)}."
        )


@dataclass
class CallAttempts:
    """HTTP attempts of one client call (all of them, and those of the SDK call now running)."""

    attempts: int = 0
    sdk_attempts: int = 0


_CURRENT_CALL: contextvars.ContextVar[CallAttempts | None] = contextvars.ContextVar("trl_ext_call", default=None)


def _httpx_module() -> Any:
    """The httpx package the installed openai SDK is built on (``httpx``, or ``httpx2`` in later SDKs)."""
    base = next(cls for cls in openai.DefaultAsyncHttpxClient.__mro__ if cls.__name__ == "AsyncClient")
    return importlib.import_module(base.__module__.partition(".")[0])


_httpx = _httpx_module()


class _MeteredHttpClient(openai.DefaultAsyncHttpxClient):
    """The SDK's own HTTP client, with every attempt it sends (the first and each retry) going through one
    concurrency slot, under a wall-clock deadline, and counted. The SDK calls `send` once per attempt, so this is
    where the retries it makes can be seen."""

    def __init__(self, *, slots: int, deadline: float, count: Callable[..., None], **kwargs: Any):
        super().__init__(**kwargs)
        self.semaphore = asyncio.Semaphore(slots)
        self.deadline = deadline
        self.count = count  # adds to the owner's counters: count(requests=1, timeouts=1, ...)
        self.in_flight = 0
        self.peak_in_flight = 0

    async def send(self, request: Any, **kwargs: Any) -> Any:
        call = _CURRENT_CALL.get()
        if call is not None:
            self.count(requests=1, retries=int(call.sdk_attempts > 0))
            call.attempts += 1
            call.sdk_attempts += 1
        else:
            self.count(requests=1)
        async with self.semaphore:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            try:
                response = await asyncio.wait_for(super().send(request, **kwargs), self.deadline)
            except asyncio.TimeoutError as error:  # the SDK retries the timeout like its own
                self.count(timeouts=1)
                raise _httpx.TimeoutException(f"no reply within {self.deadline:g} s", request=request) from error
            except _httpx.TimeoutException:
                self.count(timeouts=1)
                raise
            finally:
                self.in_flight -= 1
        if response.status_code == 429:
            self.count(rate_limited=1)
        elif response.status_code >= 500:
            self.count(server_errors=1)
        return response


@dataclass
class _LoopResources:
    client: openai.AsyncOpenAI
    http: _MeteredHttpClient
    closer: Any = None  # an async generator whose `finally` closes `client` when the loop shuts down


class OpenAIEndpoint:
    """An OpenAI-compatible server, for coroutines on any event loop: the HTTP plumbing every trl-ext client shares.

    Each event loop gets its own `openai.AsyncOpenAI` (an HTTP client cannot cross loops), closed when that loop
    shuts down. The SDK retries (``settings.max_retries``); its HTTP client (`_MeteredHttpClient`) holds every
    attempt to ``settings.max_concurrency`` in flight per loop and to ``settings.timeout`` seconds of wall clock,
    and reports each attempt to ``count``.

    Args:
        settings: the endpoint (``model``, ``structured_output`` and ``request_params`` are the client's business).
        count: called with counter increments (``requests``, ``retries``, ``timeouts``, ``rate_limited``,
            ``server_errors``); ``None`` counts nothing.
    """

    def __init__(self, settings: EndpointSettings, count: Callable[..., None] | None = None):
        self.settings = settings
        self._count = count or _count_nothing
        self._per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopResources] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def peak_in_flight(self) -> int:
        """Most HTTP requests ever in flight at once on any one event loop (checks the concurrency bound)."""
        return max((r.http.peak_in_flight for r in list(self._per_loop.values())), default=0)

    @contextlib.contextmanager
    def counting_attempts(self) -> Iterator[CallAttempts]:
        """Count, in the `CallAttempts` it yields, the HTTP attempts the SDK sends inside this block (this task's)."""
        call = CallAttempts()
        token = _CURRENT_CALL.set(call)
        try:
            yield call
        finally:
            _CURRENT_CALL.reset(token)

    async def client(self) -> openai.AsyncOpenAI:
        """The SDK client of the running event loop (made on first use)."""
        loop = asyncio.get_running_loop()
        resources = self._per_loop.get(loop)
        if resources is None:
            settings = self.settings
            http = _MeteredHttpClient(slots=settings.max_concurrency, deadline=settings.timeout, count=self._count)
            client = openai.AsyncOpenAI(
                base_url=settings.base_url,
                api_key=self.api_key(),
                max_retries=settings.max_retries,
                timeout=settings.timeout + 1.0,  # the wall-clock deadline of `_MeteredHttpClient` is the binding one
                http_client=http,
            )
            # `asyncio.run` (and `BackgroundEventLoop.close`) finalise the loop's async generators before closing it:
            # this one closes the HTTP client there, instead of a garbage-collected client trying to on a dead loop.
            closer = _close_on_shutdown(client)
            await closer.__anext__()
            resources = _LoopResources(client, http, closer)
            self._per_loop[loop] = resources
        return resources.client

    async def aclose(self) -> None:
        """Close the SDK client of the running event loop."""
        resources = self._per_loop.pop(asyncio.get_running_loop(), None)
        if resources is not None:
            await resources.closer.aclose()

    def api_key(self) -> str:
        """The API key from ``settings.api_key_env``, or the placeholder ``"EMPTY"`` when it is unset."""
        name = self.settings.api_key_env
        key = os.environ.get(name) if name else None
        if not key:
            logger.debug("Env var %r is unset: sending a placeholder API key.", name)
            return "EMPTY"
        return key


def _count_nothing(**increments: int) -> None:
    pass


async def _close_on_shutdown(client: openai.AsyncOpenAI) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await client.close()
