"""The REPL's wire protocol, parent side: the messages (`ReplResult`, `QueryRequest`, `QueryRefused`), the framing
over the interpreter's two pipes (`Wire`) and the checks of every message the sandbox sends (`parse_query`,
`parse_result`).

Framed messages on two pipes, a 4-byte big-endian length then the payload; pickles from parent to child, JSON
objects from child to parent (the parent never unpickles anything the sandbox produced). The child side is
`trl_ext.rlm.sandbox.child` (its `wire` and `server` modules):

    zygote            the server's code, then each REPL's configuration     (see `trl_ext.rlm.sandbox.local`)
    parent -> child   {"kind": "init", "context", "helpers", "objects"}      once, at start
    child -> parent   {"kind": "ready"} | {"kind": "ready", "error": traceback}
    parent -> child   {"kind": "exec", "seq": n, "code": str}
    child -> parent   {"kind": "query", "seq": n, "function", "prompts", "contexts"}  zero or more times, each
    parent -> child   {"kind": "answer", "answers": [str]} | {"kind": "answer", "error": str}   answered by this
    child -> parent   {"kind": "result", "seq": n, "stdout", "error", "final_answer"}

Every frame from the child carries the sequence number of the cell it belongs to; a frame of another cell, or
bytes after a cell's result, is a protocol violation (`PythonREPL` then kills the interpreter). Threat model:
docs/security.md, class 5.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import select
import struct
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "OUTPUT_NOTE_CHARS",
    "QUERY_FUNCTIONS",
    "AsyncQueryHandler",
    "ChildGone",
    "ProtocolError",
    "QueryHandler",
    "QueryRefused",
    "QueryRequest",
    "ReplResult",
    "Wire",
    "cap_text",
    "parse_query",
    "parse_result",
]

QUERY_FUNCTIONS = ("llm_query", "llm_query_batched", "rlm_query", "rlm_query_batched")
# Room for the note the sandbox puts after output it cut ("... [n more characters of output not shown]").
OUTPUT_NOTE_CHARS = 80
_HEADER = struct.Struct(">I")


@dataclass(frozen=True)
class ReplResult:
    """What one cell produced.

    Attributes:
        stdout: captured stdout+stderr (at most `max_output_chars` characters, then a note; the trainer cuts
            whatever the sandbox sends), preceded by `REPL_RESTART_NOTICE` when the interpreter had to be
            restarted before this cell.
        error: the traceback the model reads (only its own frames, at most `max_output_chars` characters, then a
            note), or a description of a timeout/crash.
        timed_out: the cell hit the wall-clock limit and the interpreter was killed.
        final_answer: set when the cell called ``FINAL_VAR``: the value, as a string.
        crashed: the interpreter died during the cell (crash, CPU limit, protocol violation) and was discarded.
        restarted: the cell ran in a fresh interpreter because the previous one was lost.
        answer_truncated: the final answer was longer than ``max_answer_chars`` and was cut to that length.
    """

    stdout: str
    error: str | None = None
    timed_out: bool = False
    final_answer: str | None = None
    crashed: bool = False
    restarted: bool = False
    answer_truncated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "stdout": self.stdout,
            "error": self.error,
            "timed_out": self.timed_out,
            "final_answer": self.final_answer,
            "crashed": self.crashed,
            "restarted": self.restarted,
            "answer_truncated": self.answer_truncated,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplResult:
        keys = ("stdout", "error", "timed_out", "final_answer", "crashed", "restarted")
        return cls(**{key: data[key] for key in keys}, answer_truncated=data.get("answer_truncated", False))


@dataclass(frozen=True)
class QueryRequest:
    """A call of ``llm_query``/``llm_query_batched``/``rlm_query``/``rlm_query_batched`` made by model code.

    Attributes:
        function: which of the four functions was called.
        prompts: one prompt per requested completion (the single-prompt functions send one).
        contexts: for the ``rlm_*`` functions, one JSON value per prompt (None where the model gave none);
            None for the ``llm_*`` functions.
    """

    function: Literal["llm_query", "llm_query_batched", "rlm_query", "rlm_query_batched"]
    prompts: tuple[str, ...]
    contexts: tuple[Any, ...] | None = None

    @property
    def recursive(self) -> bool:
        return self.function.startswith("rlm_")


class QueryRefused(Exception):  # noqa: N818 - it is a refusal the model reads, not an internal error
    """Raised by a query handler to refuse a request; the message is raised in the model's code."""


QueryHandler = Callable[[QueryRequest], Sequence[str]]
AsyncQueryHandler = Callable[[QueryRequest], Awaitable[Sequence[str]]]


class ChildGone(Exception):
    """The interpreter closed its end of the pipe (it exited or was killed), or the REPL closed the wire."""


class ProtocolError(Exception):
    """The interpreter sent something that is not a valid message."""


# ------------------------------------------------------------------------------------------------- the wire
class Wire:
    """Framed messages over two non-blocking pipes: pickles out, JSON objects in.

    `close` may come from any thread, also while a `recv` or `send` waits on an event loop: the waiting call then
    raises `ChildGone`, and the descriptors are closed once it has let go of them. They are never closed under a
    running read or while a loop still watches them (a closed number is soon another REPL's pipe).
    """

    def __init__(self, read_fd: int, write_fd: int, max_message_bytes: int) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd
        self.max_message_bytes = max_message_bytes
        self._buffer = bytearray()
        self._lock = threading.Lock()
        self._closed = False
        self._waiting: tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]] | None = None  # the call in flight
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)

    def close(self) -> None:
        """Close both pipes, once, from any thread (a call waiting on them raises `ChildGone`)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            waiting = self._waiting
            if waiting is None:
                self._close_fds()
        if waiting is not None:  # its owner closes the descriptors when it lets go of them
            loop, future = waiting
            try:
                loop.call_soon_threadsafe(_fail_with_child_gone, future)
            except RuntimeError:  # that loop is closed: nothing waits on it any more
                pass

    def _close_fds(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            os.close(fd)

    @contextlib.contextmanager
    def _in_flight(self, future: asyncio.Future[Any]) -> Iterator[None]:
        """Marks `future` as the call waiting on the pipes until it is done (`close` then fails it)."""
        with self._lock:
            if self._closed:
                raise ChildGone()
            self._waiting = (asyncio.get_running_loop(), future)
        try:
            yield
        finally:
            with self._lock:
                self._waiting = None
                if self._closed:
                    self._close_fds()

    @staticmethod
    def encode(message: Mapping[str, Any]) -> bytes:
        payload = pickle.dumps(dict(message), protocol=pickle.HIGHEST_PROTOCOL)
        return _HEADER.pack(len(payload)) + payload

    def _next_frame(self) -> dict[str, Any] | None:
        if len(self._buffer) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(self._buffer)
        if size > self.max_message_bytes:
            raise ProtocolError(f"a {size}-byte message exceeds max_message_bytes={self.max_message_bytes}")
        if len(self._buffer) < _HEADER.size + size:
            return None
        payload = bytes(self._buffer[_HEADER.size : _HEADER.size + size])
        del self._buffer[: _HEADER.size + size]
        try:
            message = json.loads(payload)
        except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser's stack
            raise ProtocolError(f"malformed message ({exc})") from None
        if not isinstance(message, dict) or not isinstance(message.get("kind"), str):
            raise ProtocolError("a message must be a JSON object with a string 'kind'")
        return message

    def pending(self) -> bool:
        """Bytes are waiting: buffered, or readable on the pipe right now."""
        if self._buffer:
            return True
        with self._lock:
            if self._closed:
                return False
            poller = select.poll()  # not select.select: descriptors past 1023 are common with hundreds of REPLs
            poller.register(self.read_fd, select.POLLIN)
            return bool(poller.poll(0))

    def _read_available(self) -> bool:
        try:
            data = os.read(self.read_fd, 1 << 16)
        except BlockingIOError:
            return False
        if not data:
            raise ChildGone()
        self._buffer += data
        return True

    async def recv(self, timeout_s: float) -> dict[str, Any]:
        """The next message; raises TimeoutError after `timeout_s`, `ChildGone` on end of file."""
        frame = self._next_frame()
        if frame is not None:
            return frame
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Any]] = loop.create_future()

        def on_readable() -> None:
            if future.done():
                return
            try:
                while self._read_available():
                    frame = self._next_frame()
                    if frame is not None:
                        future.set_result(frame)
                        return
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                future.set_exception(exc)

        with self._in_flight(future):
            loop.add_reader(self.read_fd, on_readable)
            try:
                return await asyncio.wait_for(future, max(timeout_s, 0.0))
            except asyncio.TimeoutError:
                raise TimeoutError() from None
            finally:
                loop.remove_reader(self.read_fd)

    def _write_some(self, view: memoryview) -> int:
        try:
            return os.write(self.write_fd, view)
        except BlockingIOError:
            return 0
        except (BrokenPipeError, ConnectionResetError):
            raise ChildGone() from None

    async def send(self, message: Mapping[str, Any], timeout_s: float) -> None:
        view = memoryview(self.encode(message))
        with self._lock:
            if self._closed:
                raise ChildGone()
            view = view[self._write_some(view) :]
        if not view:
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        remaining = [view]

        def on_writable() -> None:
            if future.done():
                return
            try:
                remaining[0] = remaining[0][self._write_some(remaining[0]) :]
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                future.set_exception(exc)
                return
            if not remaining[0]:
                future.set_result(None)

        with self._in_flight(future):
            loop.add_writer(self.write_fd, on_writable)
            try:
                await asyncio.wait_for(future, timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError() from None
            finally:
                loop.remove_writer(self.write_fd)


def _fail_with_child_gone(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(ChildGone())


def parse_query(message: Mapping[str, Any]) -> QueryRequest:
    function, prompts, contexts = message.get("function"), message.get("prompts"), message.get("contexts")
    if function not in QUERY_FUNCTIONS:
        raise ProtocolError(f"unknown query function {function!r}")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(prompt, str) for prompt in prompts):
        raise ProtocolError("a query needs a non-empty list of prompt strings")
    recursive = function.startswith("rlm_")
    if recursive != isinstance(contexts, list) or (recursive and len(contexts) != len(prompts)):
        raise ProtocolError("rlm queries carry one context per prompt, llm queries none")
    return QueryRequest(
        function=function,
        prompts=tuple(valid_text(prompt) for prompt in prompts),
        contexts=tuple(contexts) if recursive else None,
    )


def parse_result(message: Mapping[str, Any], max_output_chars: int, max_answer_chars: int) -> ReplResult:
    """The `ReplResult` a result frame describes, every text in it capped here, whatever the frame says: `stdout`
    and `error` to `max_output_chars` and the room of the sandbox's note (`cap_text`), the final answer to
    `max_answer_chars` (`answer_truncated`). The sandbox cuts its own output to the same limits (the first
    `max_output_chars` characters, then a note counting the rest); a frame forged by model code need not.

    Raises:
        ProtocolError: a field has the wrong type.
    """
    stdout, error, final_answer = message.get("stdout"), message.get("error"), message.get("final_answer")
    if not isinstance(stdout, str) or not isinstance(error, (str, type(None))):
        raise ProtocolError("a result needs a str 'stdout' and a str or null 'error'")
    if not isinstance(final_answer, (str, type(None))):
        raise ProtocolError("a result's 'final_answer' must be a str or null")
    truncated = final_answer is not None and len(final_answer) > max_answer_chars
    if truncated:
        final_answer = final_answer[:max_answer_chars]
    return ReplResult(
        stdout=valid_text(cap_text(stdout, max_output_chars + OUTPUT_NOTE_CHARS)),
        error=valid_text(cap_text(error, max_output_chars + OUTPUT_NOTE_CHARS)) if error is not None else None,
        final_answer=valid_text(final_answer) if final_answer is not None else None,
        answer_truncated=truncated,
    )


def cap_text(text: str, limit: int) -> str:
    """`text` cut to its first `limit` characters and a note counting the rest; `text` itself when it fits."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [{len(text) - limit} more characters not shown]"


def valid_text(text: str) -> str:
    """`text` with lone surrogates (which JSON can carry but tokenizers reject) replaced by "?"."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text
