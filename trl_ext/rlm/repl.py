"""A persistent, sandboxed Python REPL: one interpreter subprocess per rollout, variables kept between cells.

```python
from trl_ext.rlm import PythonREPL

with PythonREPL(context="a very long document ...", timeout_s=5) as repl:
    repl.execute("n = len(context.split())")
    result = repl.execute("print(n)\\nFINAL_VAR('n')")
    result.stdout, result.error, result.timed_out, result.final_answer  # ('5\\n', None, False, '5')
    repl.execute("while True: pass").timed_out                           # True (after timeout_s)
    repl.execute("n").stdout                                             # '[The REPL was restarted ...]\\n' + NameError
```

Inside the REPL the model's code finds:

- ``context``: the task input (str, list or dict; anything picklable works, but keep to those three).
- ``llm_query(prompt) -> str`` and ``llm_query_batched(prompts) -> list[str]``: plain completions.
- ``rlm_query(prompt, context=None) -> str`` and ``rlm_query_batched(prompts, context_list=None) -> list[str]``:
  child RLMs (a child's context must be JSON-serialisable).
- ``SHOW_VARS() -> dict`` (variable name -> type name) and ``FINAL_VAR(name)`` (sets `ReplResult.final_answer`
  to the variable's value as a string).
- Task helpers: source code passed as ``helpers`` runs in the namespace at start (define functions there), and
  ``helper_objects`` (name -> picklable object) are copied in; objects pickled by reference (functions,
  classes) must be importable from the interpreter's stdlib or site-packages.
- A trailing expression is echoed like in the interactive interpreter; stdout and stderr are captured together
  (the first `max_output_chars` characters), and so is output written to descriptors 1/2 by subprocesses.

The query functions block the model's code and send a request to the parent, which answers through
``on_query``: a callable ``QueryRequest -> list[str]`` for `execute`, or an async one for `aexecute` (the
rollout engine's). A handler refuses a request by raising `QueryRefused`; its message is raised inside the
model's code as ``RuntimeError``. Any other exception from a handler is a bug: it propagates to the caller.

Wire protocol (parent side here, child side in ``_sandbox_child.py``): framed messages on two pipes, a 4-byte
big-endian length then the payload; pickles from parent to child, JSON objects from child to parent (the
parent never unpickles anything the sandbox produced):

    zygote            the server's code, then each REPL's configuration     (see `trl_ext.rlm.sandbox`)
    parent -> child   {"kind": "init", "context", "helpers", "objects"}      once, at start
    child -> parent   {"kind": "ready"} | {"kind": "ready", "error": traceback}
    parent -> child   {"kind": "exec", "seq": n, "code": str}
    child -> parent   {"kind": "query", "seq": n, "function", "prompts", "contexts"}  zero or more times, each
    parent -> child   {"kind": "answer", "answers": [str]} | {"kind": "answer", "error": str}   answered by this
    child -> parent   {"kind": "result", "seq": n, "stdout", "error", "final_answer"}

Every frame from the child carries the sequence number of the cell it belongs to; a frame of another cell, or
bytes after a cell's result, is a protocol violation.

Sandbox (`trl_ext.rlm.sandbox`; threat model and guarantees in docs/security.md): every limit and isolation
setting is one `SandboxLimits`. By default the interpreter gets its own root file system (the runtime
read-only, private home, /tmp, /dev/shm and /proc), no network, its own PID namespace, a private unprivileged
uid (root trainers), control groups limiting memory, processes and CPU for the whole REPL and freezing it
between cells, rlimits, no_new_privs and a syscall filter; where the host cannot give namespaces it falls back
to the process backend with a warning (``isolation="strict"`` refuses instead). A cell that times out, or an
interpreter that dies, is killed with everything it started; the next cell runs in a fresh interpreter and its
output starts with `REPL_RESTART_NOTICE`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import marshal
import os
import pickle
import select
import stat
import struct
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

from .sandbox import (
    LaunchSpec,
    SandboxBackend,
    SandboxError,
    SandboxLimits,
    SandboxProcess,
    UidLease,
    acquire_uid,
    describe_exit,
    force_rmtree,
    processes_of_uid,
    remove_files_of_uid,
    sandbox_environment,
    select_backend,
)

logger = logging.getLogger(__name__)

__all__ = [
    "PythonREPL",
    "QueryRefused",
    "QueryRequest",
    "REPL_RESTART_NOTICE",
    "ReplResult",
    "SandboxError",
]

# Shown at the top of the first cell's output after the interpreter was lost (timeout, crash, protocol error).
REPL_RESTART_NOTICE = (
    "[The REPL was restarted because {reason}. Variables from earlier cells are lost; `context` and the helper "
    "functions were loaded again.]\n"
)

QUERY_FUNCTIONS = ("llm_query", "llm_query_batched", "rlm_query", "rlm_query_batched")
_HEADER = struct.Struct(">I")
# The sandbox server, compiled once here and sent to every new interpreter as its first message (marshal), so
# an interpreter start skips compiling it; `_BOOT` is the only code given on the command line.
_SERVER_FILENAME = "<sandbox>"
_SERVER_CODE = marshal.dumps(
    compile(Path(__file__).with_name("_sandbox_child.py").read_text(), _SERVER_FILENAME, "exec")
)
_BOOT = (
    "import marshal,os,sys\n"
    "def _read(n):\n"
    "    data = b''\n"
    "    while len(data) < n:\n"
    "        chunk = os.read(int(sys.argv[1]), n - len(data))\n"
    "        if not chunk: os._exit(0)\n"
    "        data += chunk\n"
    "    return data\n"
    "exec(marshal.loads(_read(int.from_bytes(_read(4), 'big'))))\n"
)
_T = TypeVar("_T")


# --------------------------------------------------------------------------------------------------- values
@dataclass(frozen=True)
class ReplResult:
    """What one cell produced.

    Attributes:
        stdout: captured stdout+stderr (at most `max_output_chars` characters, then a note), preceded by
            `REPL_RESTART_NOTICE` when the interpreter had to be restarted before this cell.
        error: the traceback the model reads (only its own frames), or a description of a timeout/crash.
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


class _ChildGone(Exception):
    """The interpreter closed its end of the pipe (it exited or was killed)."""


class _ProtocolError(Exception):
    """The interpreter sent something that is not a valid message."""


# ------------------------------------------------------------------------------------------------- the wire
class _Wire:
    """Framed messages over two non-blocking pipes: pickles out, JSON objects in."""

    def __init__(self, read_fd: int, write_fd: int, max_message_bytes: int) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd
        self.max_message_bytes = max_message_bytes
        self._buffer = bytearray()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass

    @staticmethod
    def encode(message: Mapping[str, Any]) -> bytes:
        payload = pickle.dumps(dict(message), protocol=pickle.HIGHEST_PROTOCOL)
        return _HEADER.pack(len(payload)) + payload

    def _next_frame(self) -> dict[str, Any] | None:
        if len(self._buffer) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(self._buffer)
        if size > self.max_message_bytes:
            raise _ProtocolError(f"a {size}-byte message exceeds max_message_bytes={self.max_message_bytes}")
        if len(self._buffer) < _HEADER.size + size:
            return None
        payload = bytes(self._buffer[_HEADER.size : _HEADER.size + size])
        del self._buffer[: _HEADER.size + size]
        try:
            message = json.loads(payload)
        except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser's stack
            raise _ProtocolError(f"malformed message ({exc})") from None
        if not isinstance(message, dict) or not isinstance(message.get("kind"), str):
            raise _ProtocolError("a message must be a JSON object with a string 'kind'")
        return message

    def pending(self) -> bool:
        """Bytes are waiting: buffered, or readable on the pipe right now."""
        if self._buffer:
            return True
        poller = select.poll()  # not select.select: descriptors past 1023 are common with hundreds of REPLs
        poller.register(self.read_fd, select.POLLIN)
        return bool(poller.poll(0))

    def _read_available(self) -> bool:
        try:
            data = os.read(self.read_fd, 1 << 16)
        except BlockingIOError:
            return False
        if not data:
            raise _ChildGone()
        self._buffer += data
        return True

    async def recv(self, timeout_s: float) -> dict[str, Any]:
        """The next message; raises TimeoutError after `timeout_s`, `_ChildGone` on end of file."""
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
            raise _ChildGone() from None

    async def send(self, message: Mapping[str, Any], timeout_s: float) -> None:
        view = memoryview(self.encode(message))
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

        loop.add_writer(self.write_fd, on_writable)
        try:
            await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError() from None
        finally:
            loop.remove_writer(self.write_fd)


# -------------------------------------------------------------------------------------------- the processes
@dataclass
class _Interpreter:
    """One sandboxed interpreter (a REPL replaces it after a timeout or crash)."""

    process: SandboxProcess
    wire: _Wire
    ready: bool = False

    def kill(self) -> int | None:
        """Kill everything of this interpreter (the backend waits until nothing is left); returns its status."""
        try:
            return self.process.kill()
        finally:
            self.wire.close()


@dataclass
class _Resources:
    """Everything a REPL owns for its whole life; `release` frees it all (also run by a GC finalizer)."""

    root_dir: str
    home: str
    log_fd: int
    lease: UidLease | None
    clean_shared_dirs: bool  # the process backend shares /tmp and /dev/shm with the host
    interpreter: _Interpreter | None = None
    loop: asyncio.AbstractEventLoop | None = None
    released: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def release(self) -> None:
        with self.lock:
            if self.released:
                return
            self.released = True
            contained = False
            if self.interpreter is not None:
                self.interpreter.kill()
                contained = getattr(self.interpreter.process, "contained", False)
                self.interpreter = None
            if self.lease is not None:
                self._release_uid(self.lease, contained)
            os.close(self.log_fd)
            force_rmtree(self.root_dir)
            if self.loop is not None and not self.loop.is_closed() and not self.loop.is_running():
                self.loop.close()

    def _release_uid(self, lease: UidLease, contained: bool) -> None:
        """Hand the uid back only when nothing of this REPL remains under it (else keep it out of use)."""
        left = [] if contained else [f"process {pid}" for pid in processes_of_uid(lease.uid)]
        if self.clean_shared_dirs:
            left += remove_files_of_uid(lease.uid)
        if left:
            logger.warning(
                "Sandbox uid %d is not handed to another REPL: %s of its last REPL remain", lease.uid, left[:5]
            )
            return  # the lock stays held until this process exits
        lease.release()


# ---------------------------------------------------------------------------------------------------- REPL


def traversable_by_others(path: str) -> bool:
    """Whether a process of another uid can reach files below ``path`` (every folder on the way has o+x)."""
    path = os.path.realpath(path)
    while True:
        try:
            if not os.stat(path).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


def repl_parent_dir() -> str:
    """Where a REPL that runs under a private uid gets its folder: the temporary folder (``$TMPDIR``) when that uid
    can reach into it, else ``/tmp``.

    A ``$TMPDIR`` of mode 0700 (a per-user runtime folder, ``mktemp -d``) keeps every other uid out, so a sandbox
    uid could not reach its own working directory there and the interpreter would fail to start.
    """
    return _repl_parent_dir(tempfile.gettempdir())


@functools.cache  # one look (and one log line) per temporary folder
def _repl_parent_dir(preferred: str) -> str:
    if traversable_by_others(preferred):
        return preferred
    if traversable_by_others("/tmp"):
        logger.info(
            "The temporary folder %s is closed to other users, so the REPLs' private uids could not reach their "
            "folders there: REPL folders go to /tmp instead.",
            preferred,
        )
        return "/tmp"
    raise SandboxError(
        f"Neither the temporary folder {preferred} nor /tmp can be traversed by other users, so a REPL running "
        "under a private uid could not reach its own folder: set TMPDIR to a folder every user can traverse "
        "(mode 0711 or 0755 on it and every folder above it)."
    )


class PythonREPL:
    """A sandboxed, persistent Python interpreter for one rollout.

    Args:
        context: the value of the ``context`` variable (the task input: str, list or dict).
        limits: every limit and isolation setting (`SandboxLimits`; docs/security.md says what each backend
            enforces). Its fields can also be given as keyword arguments, which override `limits`:
            ``PythonREPL(ctx, timeout_s=5, memory_mb=512)``.
        helpers: Python source run in the namespace at start (and after every restart): task helper functions.
        helper_objects: name -> picklable object copied into the namespace at start.
        on_query: answers the query functions in `execute` (see the module docstring). Without it they raise.
        env: extra environment variables for the sandbox (it gets none of the trainer's otherwise). Never put
            secrets here: model code reads every variable it gets.
        backend: where the interpreter runs; default: the local backend `limits.isolation` resolves to.
        **overrides: `SandboxLimits` fields.

    Raises:
        SandboxError: the sandbox cannot be set up (``isolation="strict"`` without namespaces, no Linux...).
    """

    def __init__(
        self,
        context: Any = None,
        *,
        limits: SandboxLimits | None = None,
        helpers: str | Sequence[str] | None = None,
        helper_objects: Mapping[str, Any] | None = None,
        on_query: QueryHandler | None = None,
        env: Mapping[str, str] | None = None,
        backend: SandboxBackend | None = None,
        **overrides: Any,
    ) -> None:
        if limits is not None and not isinstance(limits, SandboxLimits):
            raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
        self.limits = (limits or SandboxLimits()).with_overrides(**overrides)
        if isinstance(helpers, str):
            helpers = [helpers]
        self.helpers = list(helpers or [])
        if not all(isinstance(source, str) for source in self.helpers):
            raise TypeError("helpers must be Python source: a str or a sequence of str")
        self.helper_objects = dict(helper_objects or {})
        reserved = {"context", "SHOW_VARS", "FINAL_VAR", *QUERY_FUNCTIONS}
        if clash := sorted(reserved & set(self.helper_objects)):
            raise ValueError(f"helper_objects may not redefine the REPL's own names {clash}; rename them")
        self.context = context
        self.on_query = on_query
        self._init_payload = pickle.dumps(
            {"kind": "init", "context": context, "helpers": self.helpers, "objects": self.helper_objects},
            protocol=pickle.HIGHEST_PROTOCOL,
        )  # pickled once here, so an unpicklable context fails in the constructor, not in the sandbox

        if not sys.platform.startswith("linux"):
            raise SandboxError(f"PythonREPL needs Linux (rlimits, /proc, pipe2); this is {sys.platform}.")
        self.backend = backend if backend is not None else select_backend(self.limits)
        lease = acquire_uid(self.limits.sandbox_uids) if os.geteuid() == 0 else None
        root_dir = tempfile.mkdtemp(prefix="trl_ext_repl_", dir=repl_parent_dir() if lease is not None else None)
        try:
            if lease is not None:
                os.chmod(root_dir, 0o711)  # traversable by the sandbox uid, not listable
            home = self.backend.prepare(root_dir, lease)
            log_fd = os.open(
                os.path.join(root_dir, "stdio.log"), os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
            )
        except BaseException:
            force_rmtree(root_dir)
            if lease is not None:
                lease.release()
            raise
        self._env = sandbox_environment(home, env)
        if self.backend.name == "namespace":
            self._env["TMPDIR"] = "/tmp"
        self._resources = _Resources(root_dir, home, log_fd, lease, clean_shared_dirs=self.backend.name == "process")
        self._finalizer = weakref.finalize(self, self._resources.release)
        self._lost_reason: str | None = None
        self._executing = False
        self._seq = 0
        self.restarts = 0
        try:
            self._start_interpreter()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------ properties
    @property
    def workdir(self) -> str:
        """The sandbox's private working directory (also its HOME) as model code sees it; gone after `close`."""
        return self._resources.home

    @property
    def isolation(self) -> str:
        """The backend this REPL runs on: ``"namespace"`` or ``"process"``."""
        return self.backend.name

    @property
    def timeout_s(self) -> float:
        return self.limits.timeout_s

    @property
    def uid(self) -> int | None:
        """The private uid the sandbox runs as, or None when it shares the trainer's (non-root trainer)."""
        return self._resources.lease.uid if self._resources.lease is not None else None

    @property
    def pid(self) -> int | None:
        """Process id of the current interpreter's supervisor (see `trl_ext.rlm.sandbox`), None between lives."""
        interpreter = self._resources.interpreter
        return interpreter.process.pid if interpreter is not None else None

    def memory_peak_bytes(self) -> int | None:
        """Peak memory of the current interpreter life, all its processes and files together (None without
        control groups)."""
        interpreter = self._resources.interpreter
        peak = getattr(interpreter.process, "memory_peak_bytes", None) if interpreter is not None else None
        return peak() if peak is not None else None

    @property
    def closed(self) -> bool:
        return self._resources.released

    # --------------------------------------------------------------------------------------- public calls
    def execute(self, code: str) -> ReplResult:
        """Run one cell and wait for its result (query functions are answered by ``on_query``)."""
        if self.closed:
            raise RuntimeError("This PythonREPL is closed; create a new one.")
        handler = self.on_query

        async def answer(request: QueryRequest) -> Sequence[str]:
            if handler is None:
                raise QueryRefused(f"{request.function} is not available in this REPL (it has no query handler)")
            return handler(request)

        return self._run_sync(self.aexecute(code, on_query=answer))

    async def aexecute(self, code: str, on_query: AsyncQueryHandler | None = None) -> ReplResult:
        """Run one cell without blocking the event loop; `on_query` answers the query functions."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        if self.closed:
            raise RuntimeError("This PythonREPL is closed; create a new one.")
        if self._executing:
            raise RuntimeError("execute() called while another cell is running on this REPL; await it first.")
        self._executing = True
        try:
            return await self._execute(code, on_query)
        finally:
            self._executing = False

    def close(self) -> None:
        """Kill the interpreter and everything it started, and remove the working directory. Idempotent."""
        self._finalizer()

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def __enter__(self) -> PythonREPL:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"pid={self.pid}"
        return f"PythonREPL({state}, uid={self.uid}, isolation={self.isolation!r}, timeout_s={self.timeout_s:g})"

    # ------------------------------------------------------------------------------------------ internals
    def _start_interpreter(self) -> None:
        """Spawn a fresh interpreter and send it the init payload (blocking; run off the event loop)."""
        resources = self._resources
        spec = LaunchSpec(
            limits=self.limits,
            lease=resources.lease,
            root_dir=resources.root_dir,
            home=resources.home,
            log_fd=resources.log_fd,
            env=self._env,
            server_code=_SERVER_CODE,
            server_options={
                "max_output_chars": self.limits.max_output_chars,
                "max_answer_chars": self.limits.max_answer_chars,
            },
            init_payload=self._init_payload,
            boot=_BOOT,
        )
        process = self.backend.start(spec)
        resources.interpreter = _Interpreter(
            process, _Wire(process.read_fd, process.write_fd, self.limits.max_message_bytes)
        )

    async def _ensure_ready(self) -> str:
        """Start or restart the interpreter if needed and wait until it is ready; returns a restart notice."""
        loop = asyncio.get_running_loop()
        notice = ""
        if self._resources.interpreter is None:
            notice = REPL_RESTART_NOTICE.format(reason=self._lost_reason or "it was lost")
            await loop.run_in_executor(None, self._start_interpreter)
            self.restarts += 1
        interpreter = self._resources.interpreter
        assert interpreter is not None
        if interpreter.ready:
            return notice
        startup_timeout_s = self.limits.startup_timeout_s
        try:
            message = await interpreter.wire.recv(startup_timeout_s)
        except TimeoutError:
            problem = f"did not start within startup_timeout_s={startup_timeout_s:g} s"
        except (_ChildGone, _ProtocolError):
            problem = "failed to start"
        else:
            if message.get("kind") == "ready" and message.get("error") is None:
                interpreter.ready = True
                interpreter.process.freeze()  # nothing of the REPL runs between cells
                return notice
            problem = f"could not load `context` or the helpers:\n{message.get('error')}"
        returncode = await loop.run_in_executor(None, interpreter.kill)
        self._resources.interpreter = None
        self._lost_reason = "it failed to start"
        raise SandboxError(
            f"The sandboxed interpreter {problem} ({describe_exit(returncode)}). Its output:\n{self._log_tail()}"
        )

    async def _execute(self, code: str, on_query: AsyncQueryHandler | None) -> ReplResult:
        notice = await self._ensure_ready()
        interpreter = self._resources.interpreter
        assert interpreter is not None
        wire, process = interpreter.wire, interpreter.process
        timeout_s = self.limits.timeout_s
        budget = timeout_s
        # Every frame of this cell must carry its sequence number: a frame forged by model code (it can write
        # to the interpreter's descriptors) gets no further than the model's own FINAL_VAR could, and a stray,
        # missing or late frame breaks the protocol instead of answering a later cell.
        self._seq += 1
        seq = self._seq
        try:
            process.thaw()
            await wire.send({"kind": "exec", "seq": seq, "code": code}, timeout_s)
            while True:
                started = time.monotonic()
                message = await wire.recv(budget)
                budget -= time.monotonic() - started
                if message.get("seq") != seq:
                    raise _ProtocolError(f"a frame of cell {message.get('seq')!r:.20} arrived during cell {seq}")
                if message["kind"] == "result":
                    process.freeze()
                    if wire.pending():
                        raise _ProtocolError("extra bytes after the cell's result")
                    result = _parse_result(message, self.limits.max_answer_chars)
                    return replace(result, stdout=notice + result.stdout, restarted=bool(notice))
                if message["kind"] != "query":
                    raise _ProtocolError(f"unexpected message kind {message['kind']!r:.40}")
                request = _parse_query(message)
                process.freeze()  # nothing of the REPL runs while the policy generates the answer
                answer = await self._answer(request, on_query)
                process.thaw()
                await wire.send(answer, timeout_s)
        except TimeoutError:
            await self._lose_interpreter(f"the previous cell exceeded the {timeout_s:g} s time limit")
            error = (
                f"TimeoutError: the cell did not finish within {timeout_s:g} s. The REPL process was killed and "
                "its variables are lost; the next cell starts a fresh REPL."
            )
            return ReplResult(stdout=notice, error=error, timed_out=True, restarted=bool(notice))
        except (_ChildGone, _ProtocolError) as exc:
            returncode = await self._lose_interpreter(None)
            if isinstance(exc, _ProtocolError):
                what = f"broke the REPL protocol ({exc})"
            elif process.out_of_memory():
                what = (
                    f"ran out of memory (the REPL's limit is memory_mb={self.limits.memory_mb} for all its processes)"
                )
            else:
                what = describe_exit(returncode)
            self._lost_reason = f"the REPL process {what}"
            error = (
                f"The REPL process {what}; its variables are lost and the next cell starts a fresh REPL."
                + _format_log_tail(self._log_tail())
            )
            return ReplResult(stdout=notice, error=error, crashed=True, restarted=bool(notice))
        except BaseException:
            # A failing handler or a cancellation leaves the interpreter waiting for an answer: it cannot go on.
            await asyncio.shield(self._lose_interpreter("the previous cell was interrupted"))
            raise

    async def _answer(self, request: QueryRequest, on_query: AsyncQueryHandler | None) -> dict[str, Any]:
        if on_query is None:
            return {"kind": "answer", "error": f"{request.function} is not available in this REPL"}
        try:
            answers = list(await on_query(request))
        except QueryRefused as exc:
            return {"kind": "answer", "error": str(exc)}
        if len(answers) != len(request.prompts) or not all(isinstance(answer, str) for answer in answers):
            raise TypeError(
                f"The query handler must return one str per prompt ({len(request.prompts)}), got {answers!r:.200}"
            )
        return {"kind": "answer", "answers": answers}

    async def _lose_interpreter(self, reason: str | None) -> int | None:
        interpreter = self._resources.interpreter
        self._resources.interpreter = None
        if reason is not None:
            self._lost_reason = reason
        if interpreter is None:
            return None
        return await asyncio.get_running_loop().run_in_executor(None, interpreter.kill)

    def _log_tail(self, limit: int = 2000) -> str:
        try:
            size = os.fstat(self._resources.log_fd).st_size
            data = os.pread(self._resources.log_fd, limit, max(0, size - limit))
        except OSError:
            return ""
        return data.decode("utf-8", "replace").strip()

    def _run_sync(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:  # called from inside an event loop (e.g. a notebook): run on a helper thread with its own loop
            with ThreadPoolExecutor(max_workers=1) as pool:
                return pool.submit(asyncio.run, coroutine).result()
        if self._resources.loop is None:
            self._resources.loop = asyncio.new_event_loop()
        return self._resources.loop.run_until_complete(coroutine)


# ---------------------------------------------------------------------------------------- message parsing
def _parse_query(message: Mapping[str, Any]) -> QueryRequest:
    function, prompts, contexts = message.get("function"), message.get("prompts"), message.get("contexts")
    if function not in QUERY_FUNCTIONS:
        raise _ProtocolError(f"unknown query function {function!r}")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(prompt, str) for prompt in prompts):
        raise _ProtocolError("a query needs a non-empty list of prompt strings")
    recursive = function.startswith("rlm_")
    if recursive != isinstance(contexts, list) or (recursive and len(contexts) != len(prompts)):
        raise _ProtocolError("rlm queries carry one context per prompt, llm queries none")
    return QueryRequest(
        function=function,
        prompts=tuple(_valid_text(prompt) for prompt in prompts),
        contexts=tuple(contexts) if recursive else None,
    )


def _parse_result(message: Mapping[str, Any], max_answer_chars: int) -> ReplResult:
    stdout, error, final_answer = message.get("stdout"), message.get("error"), message.get("final_answer")
    if not isinstance(stdout, str) or not isinstance(error, (str, type(None))):
        raise _ProtocolError("a result needs a str 'stdout' and a str or null 'error'")
    if not isinstance(final_answer, (str, type(None))):
        raise _ProtocolError("a result's 'final_answer' must be a str or null")
    truncated = final_answer is not None and len(final_answer) > max_answer_chars
    if truncated:
        final_answer = final_answer[:max_answer_chars]
    return ReplResult(
        stdout=_valid_text(stdout),
        error=_valid_text(error) if error is not None else None,
        final_answer=_valid_text(final_answer) if final_answer is not None else None,
        answer_truncated=truncated,
    )


def _valid_text(text: str) -> str:
    """`text` with lone surrogates (which JSON can carry but tokenizers reject) replaced by "?"."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def _format_log_tail(tail: str) -> str:
    return f"\nLast output of the process:\n{tail}" if tail else ""
