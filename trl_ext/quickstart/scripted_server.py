"""A scripted OpenAI-compatible chat server on 127.0.0.1, for tests, benchmarks and the quickstart.

`ScriptedChatServer` is a real `http.server.ThreadingHTTPServer` on an ephemeral port speaking
``POST /v1/chat/completions`` and ``GET /v1/models``. Each request's JSON body goes to a *script*, a callable
``(request_json) -> reply``; the reply decides what the client sees:

- a ``str`` or `TextReply`: an assistant text message;
- `ToolCallReply`: an assistant message with tool calls (``finish_reason="tool_calls"``);
- `ErrorReply`: an HTTP error status (429 with an optional ``Retry-After``, 500, 400, ...) with an OpenAI-style body;
- `RawReply`: exactly the given status and body (malformed JSON, a body with no choices, ...);
- `HangReply`: no answer for ``seconds`` (or until the server stops), then the connection is closed.

Every reply can carry a ``delay`` (seconds) to simulate latency. The server records the requests it got
(`ScriptedChatServer.requests`). No network beyond the loopback interface is used::

    from trl_ext.quickstart.scripted_server import ScriptedChatServer, TextReply

    with ScriptedChatServer(lambda request: TextReply('{"spans": []}', delay=0.2)) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused")
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from trl_ext.text import last_user_text as _last_user_text

logger = logging.getLogger(__name__)

__all__ = [
    "ErrorReply",
    "HangReply",
    "RawReply",
    "Reply",
    "Script",
    "ScriptedChatServer",
    "TextReply",
    "ToolCall",
    "ToolCallReply",
    "last_user_text",
    "replies_in_order",
]


@dataclass
class TextReply:
    """An assistant message with text ``content``."""

    content: str
    delay: float = 0.0
    finish_reason: str = "stop"


@dataclass
class ToolCall:
    """One tool call: the function ``name`` and its ``arguments`` (a dict, serialised to JSON, or a raw string)."""

    name: str
    arguments: dict[str, Any] | str = field(default_factory=dict)
    id: str | None = None


@dataclass
class ToolCallReply:
    """An assistant message that calls tools (``content`` is usually ``None``)."""

    calls: list[ToolCall]
    content: str | None = None
    delay: float = 0.0


@dataclass
class ErrorReply:
    """An HTTP error: ``status`` (e.g. 429, 500, 400) with an OpenAI-style error body."""

    status: int
    message: str = "scripted error"
    retry_after: float | None = None
    delay: float = 0.0


@dataclass
class RawReply:
    """Exactly this HTTP ``status`` and ``body`` (for malformed or unusual responses)."""

    body: str | bytes
    status: int = 200
    content_type: str = "application/json"
    delay: float = 0.0


@dataclass
class HangReply:
    """Do not answer for ``seconds`` (or until the server stops), then drop the connection."""

    seconds: float = 3600.0


Reply = str | TextReply | ToolCallReply | ErrorReply | RawReply | HangReply
Script = Callable[[dict[str, Any]], Reply]


def replies_in_order(replies: Iterable[Reply], then: Reply | None = None) -> Script:
    """A script that answers the n-th request with the n-th reply (thread-safe), then with ``then`` forever.

    Raises `IndexError` inside the server (answered as HTTP 500) when the replies run out and ``then`` is None.
    """
    queue, lock = list(replies), threading.Lock()
    position = itertools.count()

    def script(_request: dict[str, Any]) -> Reply:
        with lock:
            index = next(position)
        if index < len(queue):
            return queue[index]
        if then is None:
            raise IndexError(f"replies_in_order got request #{index + 1} but has only {len(queue)} replies.")
        return then

    return script


def last_user_text(request: dict[str, Any]) -> str:
    """Text of the last user message of a chat request (`trl_ext.text.last_user_text`'s rule), "" without one; for
    scripts that route on it."""
    try:
        return _last_user_text(request.get("messages", []))
    except ValueError:
        return ""


class ScriptedChatServer:
    """An OpenAI-compatible chat-completions server on 127.0.0.1 whose replies come from ``script``.

    Args:
        script: ``(request_json) -> reply`` (see the module docstring). Called from the server's handler threads,
            concurrently; it must be thread-safe. An exception in it is answered as HTTP 500.
        model: model id reported by ``GET /v1/models`` and in replies.
        host: interface to bind; only loopback addresses are accepted.
        port: 0 picks a free ephemeral port.

    Use as a context manager (or `start`/`stop`). `base_url` is ``http://127.0.0.1:<port>/v1``.
    """

    def __init__(self, script: Script, *, model: str = "scripted-judge", host: str = "127.0.0.1", port: int = 0):
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"host={host!r}: ScriptedChatServer binds the loopback interface only; use '127.0.0.1'.")
        self.script = script
        self.model = model
        self._address = (host, port)
        self._requests: list[dict[str, Any]] = []
        self._headers: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> ScriptedChatServer:
        if self._httpd is not None:
            raise RuntimeError("ScriptedChatServer is already running; call stop() first.")
        handler = type("_BoundHandler", (_Handler,), {"server_ref": self})
        self._stopping.clear()
        self._httpd = _Server(self._address, handler)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="scripted-chat-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._stopping.set()  # releases hanging handlers
        self._httpd.shutdown()
        self._httpd.server_close()
        assert self._thread is not None
        self._thread.join(timeout=5)
        self._httpd, self._thread = None, None

    def __enter__(self) -> ScriptedChatServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- accessors -----------------------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("ScriptedChatServer is not running; use it as a context manager or call start().")
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>/v1``: pass as ``base_url`` to an OpenAI client."""
        return f"http://{self._address[0]}:{self.port}/v1"

    @property
    def requests(self) -> list[dict[str, Any]]:
        """A copy of the JSON bodies of the chat requests received so far, in arrival order."""
        with self._lock:
            return list(self._requests)

    @property
    def request_headers(self) -> list[dict[str, str]]:
        """HTTP headers of the chat requests received so far (same order as `requests`), names lower-cased."""
        with self._lock:
            return list(self._headers)

    def clear_requests(self) -> None:
        with self._lock:
            self._requests.clear()
            self._headers.clear()

    # -- used by the handler -------------------------------------------------------------------------------------
    def _record(self, request: dict[str, Any], headers: dict[str, str]) -> None:
        with self._lock:
            self._requests.append(request)
            self._headers.append(headers)

    def _completion_body(self, reply: TextReply | ToolCallReply, request: dict[str, Any]) -> dict[str, Any]:
        number = next(self._ids)
        message: dict[str, Any] = {"role": "assistant"}
        if isinstance(reply, TextReply):
            message["content"] = reply.content
            finish_reason = reply.finish_reason
        else:
            message["content"] = reply.content
            message["tool_calls"] = [
                {
                    "id": call.id or f"call_{number}_{i}",
                    "type": "function",
                    "function": {
                        "name": call.name,
                        "arguments": call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments),
                    },
                }
                for i, call in enumerate(reply.calls)
            ]
            finish_reason = "tool_calls"
        prompt_chars = sum(len(json.dumps(m.get("content"))) for m in request.get("messages", []))
        completion_chars = len(json.dumps(message))
        return {
            "id": f"chatcmpl-scripted-{number}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.get("model", self.model),
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": {
                "prompt_tokens": prompt_chars // 4,
                "completion_tokens": completion_chars // 4,
                "total_tokens": (prompt_chars + completion_chars) // 4,
            },
        }


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # hanging handlers must not block shutdown
    request_queue_size = 1024  # the default backlog (5) drops connections when a client opens 32 at once


class _Handler(BaseHTTPRequestHandler):
    server_ref: ScriptedChatServer
    protocol_version = "HTTP/1.1"  # keep-alive, as real endpoints do
    disable_nagle_algorithm = True  # headers and body go out in two writes: without this each reply waits ~40 ms

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - signature of the base class
        logger.debug("scripted server: " + format, *args)

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        if self.path.rstrip("/") in ("/v1/models", "/models"):
            model = self.server_ref.model
            self._send_json(200, {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "trl-ext"}]})
        else:
            self._send_json(404, _error_body(f"No route GET {self.path}", "not_found"))

    def do_POST(self) -> None:  # noqa: N802 - http.server naming
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
            self._send_json(404, _error_body(f"No route POST {self.path}", "not_found"))
            return
        try:
            request = json.loads(raw or b"{}")
        except ValueError:
            self._send_json(400, _error_body("Request body is not JSON", "invalid_request_error"))
            return
        server = self.server_ref
        server._record(request, {name.lower(): value for name, value in self.headers.items()})
        if request.get("stream"):
            self._send_json(400, _error_body("ScriptedChatServer does not stream; send stream=false", "invalid"))
            return
        try:
            reply = server.script(request)
        except Exception as error:  # the script is user code: answer 500 rather than kill the handler thread
            logger.warning("ScriptedChatServer script raised %r; answering HTTP 500", error)
            self._send_json(500, _error_body(f"script error: {error!r}", "server_error"))
            return
        if isinstance(reply, str):
            reply = TextReply(reply)
        if isinstance(reply, HangReply):
            server._stopping.wait(reply.seconds)
            self.close_connection = True
            return
        if not isinstance(reply, (TextReply, ToolCallReply, ErrorReply, RawReply)):
            self._send_json(500, _error_body(f"script returned {type(reply).__name__}, not a Reply", "server_error"))
            return
        if reply.delay > 0 and server._stopping.wait(reply.delay):
            self.close_connection = True
            return
        if isinstance(reply, RawReply):
            data = reply.body.encode("utf-8") if isinstance(reply.body, str) else reply.body
            self._send_bytes(reply.status, data, reply.content_type)
            return
        if isinstance(reply, ErrorReply):
            headers = {} if reply.retry_after is None else {"Retry-After": f"{reply.retry_after:g}"}
            kind = "rate_limit_exceeded" if reply.status == 429 else "server_error"
            self._send_json(reply.status, _error_body(reply.message, kind), headers)
            return
        self._send_json(200, server._completion_body(reply, request))

    def _send_json(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self._send_bytes(status, json.dumps(body).encode("utf-8"), "application/json", headers)

    def _send_bytes(self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        try:
            self.send_response(status, HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else None)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up (timeout): nothing to answer


def _error_body(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": kind, "param": None}}
