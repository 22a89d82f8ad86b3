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
- A trailing expression is echoed like in the interactive interpreter; stdout and stderr are captured together,
  and so is output written to descriptors 1/2 by subprocesses (to a file inside the REPL's `disk_mb`, emptied
  after each cell): the first `max_output_chars` characters of it all are kept, cut again on the trainer's side.

The query functions block the model's code and send a request to the parent, which answers through
``on_query``: a callable ``QueryRequest -> list[str]`` for `execute`, or an async one for `aexecute` (the
rollout engine's). A handler refuses a request by raising `QueryRefused`; its message is raised inside the
model's code as ``RuntimeError``. Any other exception from a handler is a bug: it propagates to the caller.

The frames on the interpreter's pipes are `trl_ext.rlm.repl_protocol`; what a REPL owns (folder, log, uid,
interpreter) is `trl_ext.rlm.repl_resources`.

Sandbox (`trl_ext.rlm.sandbox`; threat model and guarantees in docs/security.md): every limit and isolation
setting is one `SandboxLimits`. By default the interpreter gets its own root file system (the runtime
read-only, private home, /tmp, /dev/shm and /proc), no network, its own PID namespace, a private unprivileged
uid (root trainers), control groups limiting memory, processes and CPU for the whole REPL and freezing it
between cells, rlimits, no_new_privs and a syscall filter; where the host cannot give namespaces it falls back
to the process backend with a warning (``isolation="strict"`` refuses instead). A cell that times out, or an
interpreter that dies, is killed with everything it started; the next cell runs in a fresh interpreter and its
output starts with `REPL_RESTART_NOTICE`. Where the backend cannot bound the REPL's disk itself (the process backend),
its files are measured during and after every cell: past ``disk_mb`` the REPL is stopped the same way, its home
emptied, and the cell's error says "disk budget exceeded".
"""

from __future__ import annotations

import asyncio
import os
import pickle
import sys
import time
import weakref
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

from .repl_protocol import (
    QUERY_FUNCTIONS,
    AsyncQueryHandler,
    ChildGone,
    ProtocolError,
    QueryHandler,
    QueryRefused,
    QueryRequest,
    ReplResult,
    Wire,
    cap_text,
    parse_query,
    parse_result,
)
from .repl_resources import Interpreter, Resources, make_folder
from .sandbox import (
    LaunchSpec,
    SandboxBackend,
    SandboxError,
    SandboxLimits,
    acquire_uid,
    describe_exit,
    select_backend,
)
from .sandbox.backend import quote_sandbox_text
from .sandbox.disk import DiskUsage, disk_file_limit

__all__ = ["REPL_RESTART_NOTICE", "PythonREPL"]

# Shown at the top of the first cell's output after the interpreter was lost (timeout, crash, protocol error).
REPL_RESTART_NOTICE = (
    "[The REPL was restarted because {reason}. Variables from earlier cells are lost; `context` and the helper "
    "functions were loaded again.]\n"
)

# The error of a cell during which another thread closed the REPL (`PythonREPL.close`).
_CLOSED_DURING_CELL = "The REPL was closed while this cell ran (PythonREPL.close); the cell did not finish."

_T = TypeVar("_T")

# How often a running cell's files are measured where the backend cannot bound its disk (the process backend): at
# most this long apart, and sooner while they grow, down to the minimum (`PythonREPL._recv`).
DISK_CHECK_INTERVAL_S = 0.02
DISK_CHECK_MIN_INTERVAL_S = 0.002


class _DiskBudgetExceeded(Exception):
    """The REPL's files took more than ``disk_mb`` during a cell (`PythonREPL._recv`)."""

    def __init__(self, usage: DiskUsage) -> None:
        super().__init__(usage)
        self.usage = usage


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
        backend: where the interpreter runs (a `trl_ext.rlm.sandbox.SandboxBackend`; docs/security.md says how to
            write one); default: the local backend `limits.isolation` resolves to on this host.
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
        try:
            folder = make_folder(self.backend, lease)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        self._extra_env = env
        self._resources = Resources(
            folder.root_dir, folder.home, folder.log_fd, lease, shared_dirs=self.backend.shared_dirs
        )
        self._finalizer = weakref.finalize(self, self._resources.release)
        self._lost_reason: str | None = None
        # An interpreter was ready in the current folder: a later start that fails there is a restart the REPL's
        # own code may have broken (its files persist across lives), so the REPL is replaced instead of raising.
        self._folder_used = False
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
        """The name of the backend this REPL runs on (`SandboxBackend.name`; the local one's: ``"namespace"`` or
        ``"process"``)."""
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
        return interpreter.process.memory_peak_bytes() if interpreter is not None else None

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
        """Kill the interpreter and everything it started, and remove the working directory.

        Idempotent and safe from any thread, also during a cell: every caller returns once all of it is gone, and
        the running cell returns a crashed `ReplResult` (no exception reaches its caller).
        """
        self._finalizer.detach()
        self._resources.release()

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
        """Spawn a fresh interpreter and send it the init payload (blocking; run off the event loop).

        Raises:
            SandboxError: the REPL is closed (a `close` from another thread: no interpreter may start after it).
        """
        resources = self._resources
        with resources.lock:
            if resources.released:
                raise SandboxError("This PythonREPL is closed; create a new one.")
            spec = LaunchSpec(
                limits=self.limits,
                lease=resources.lease,
                root_dir=resources.root_dir,
                home=resources.home,
                log_fd=resources.log_fd,
                env=self.backend.environment(resources.home, self._extra_env),
                init_payload=self._init_payload,
            )
            process = self.backend.start(spec)
            resources.interpreter = Interpreter(
                process, Wire(process.read_fd, process.write_fd, self.limits.max_message_bytes)
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
        except (ChildGone, ProtocolError):
            problem = "failed to start"
        else:
            if message.get("kind") == "ready" and message.get("error") is None:
                interpreter.ready = True
                self._folder_used = True
                # Not frozen here: the caller sends its cell right away (no model code has run in this interpreter
                # yet; from this cell on, it is frozen between cells).
                return notice
            error = quote_sandbox_text(cap_text(str(message.get("error")), self.limits.max_output_chars))
            problem = f"could not load `context` or the helpers:\n{error}"
        returncode = await self._lose_interpreter("it failed to start")
        raise SandboxError(
            f"The sandboxed interpreter {problem} ({describe_exit(returncode)}). Its output:\n{self._log_tail()}"
        )

    async def _execute(self, code: str, on_query: AsyncQueryHandler | None) -> ReplResult:
        try:
            notice = await self._ensure_ready()
        except SandboxError as exc:
            if self.closed:
                return ReplResult(stdout="", error=_CLOSED_DURING_CELL, crashed=True)
            if not self._folder_used:  # the first start in a fresh folder: the host or the helpers, not the REPL
                raise
            return await self._replace_after_failed_restart(exc)
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
                message = await self._recv(interpreter, budget)
                budget -= time.monotonic() - started
                if message.get("seq") != seq:
                    raise ProtocolError(f"a frame of cell {message.get('seq')!r:.20} arrived during cell {seq}")
                if message["kind"] == "result":
                    process.freeze()
                    if wire.pending():
                        raise ProtocolError("extra bytes after the cell's result")
                    result = parse_result(message, self.limits.max_output_chars, self.limits.max_answer_chars)
                    usage, over = None, False
                    if process.measures_disk:  # what the cell left behind, against disk_mb
                        usage, over = await asyncio.get_running_loop().run_in_executor(
                            None, self._check_disk, interpreter
                        )
                    if over and usage is not None:
                        return await self._stop_disk_overrun(usage, notice, result.stdout)
                    return replace(result, stdout=notice + result.stdout, restarted=bool(notice))
                if message["kind"] != "query":
                    raise ProtocolError(f"unexpected message kind {message['kind']!r:.40}")
                request = parse_query(message)
                process.freeze()  # nothing of the REPL runs while the policy generates the answer
                answer = await self._answer(request, on_query)
                process.thaw()
                await wire.send(answer, timeout_s)
        except _DiskBudgetExceeded as exc:
            return await self._stop_disk_overrun(exc.usage, notice, "")
        except TimeoutError:
            await self._lose_interpreter(f"the previous cell exceeded the {timeout_s:g} s time limit")
            error = (
                f"TimeoutError: the cell did not finish within {timeout_s:g} s. The REPL process was killed and "
                "its variables are lost; the next cell starts a fresh REPL."
            )
            return ReplResult(stdout=notice, error=error, timed_out=True, restarted=bool(notice))
        except (ChildGone, ProtocolError) as exc:
            returncode = await self._lose_interpreter(None)
            if self.closed:
                return ReplResult(stdout=notice, error=_CLOSED_DURING_CELL, crashed=True, restarted=bool(notice))
            if isinstance(exc, ProtocolError):
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

    async def _recv(self, interpreter: Interpreter, timeout_s: float) -> dict[str, Any]:
        """The sandbox's next frame (`Wire.recv`). Meanwhile, where the backend cannot bound the REPL's disk itself
        (`SandboxProcess.disk_usage`: the process backend), its files are measured: first after
        `DISK_CHECK_MIN_INTERVAL_S`, then twice as long apart each time up to `DISK_CHECK_INTERVAL_S`, and sooner
        while they grow (at their last rate, half the time they would take to fill the rest of ``disk_mb``, never
        under the minimum); past ``disk_mb`` the REPL is frozen at once and `_DiskBudgetExceeded` raised."""
        if not interpreter.process.measures_disk:
            return await interpreter.wire.recv(timeout_s)
        receiving = asyncio.ensure_future(interpreter.wire.recv(timeout_s))
        loop = asyncio.get_running_loop()
        budget = self.limits.disk_mb * 2**20
        wait, last = DISK_CHECK_MIN_INTERVAL_S, None
        try:
            while True:
                done, _ = await asyncio.wait({receiving}, timeout=wait)
                if done:
                    return receiving.result()
                usage, over = await loop.run_in_executor(None, self._check_disk, interpreter)
                if over:  # the REPL is frozen: no more writes
                    raise _DiskBudgetExceeded(usage)
                if usage is None:
                    return await receiving
                now, wait = time.monotonic(), min(2 * wait, DISK_CHECK_INTERVAL_S)
                if last is not None and usage.bytes > last[1]:
                    rate = (usage.bytes - last[1]) / max(now - last[0], 1e-6)
                    wait = max(DISK_CHECK_MIN_INTERVAL_S, min(wait, (budget - usage.bytes) / rate / 2))
                last = (now, usage.bytes)
        finally:
            if not receiving.done():
                receiving.cancel()
                await asyncio.wait({receiving})  # lets go of the pipes before the interpreter is killed

    def _check_disk(self, interpreter: Interpreter) -> tuple[DiskUsage | None, bool]:
        """What the REPL's files take (`SandboxProcess.disk_usage`), and whether that is past ``disk_mb`` or its file
        count, the REPL then frozen and its usage counted in full for the message (blocking: a walk of its home)."""
        budget, files = self.limits.disk_mb * 2**20, disk_file_limit(self.limits.disk_mb)
        process = interpreter.process
        usage = process.disk_usage(budget, files)
        if usage is None or (usage.bytes <= budget and usage.files <= files):
            return usage, False
        process.freeze()  # no more writes; then all its bytes (the walk still stops past `files`)
        return process.disk_usage(2**62, files) or usage, True

    async def _stop_disk_overrun(self, usage: DiskUsage, notice: str, stdout: str) -> ReplResult:
        """The REPL's files took more than ``disk_mb``: like a memory overrun, the interpreter is killed (its
        variables lost), and its home is emptied, a new folder replacing the old one, so that the next cell starts a
        fresh interpreter under its budget. The cell reports why, in an error the model reads."""
        disk_mb, files = self.limits.disk_mb, disk_file_limit(self.limits.disk_mb)
        if usage.files > files:
            what = f"its home held more than {files} files and folders (the limit for disk_mb={disk_mb})"
        else:
            more = "" if usage.complete else "at least "
            what = f"its files took {more}{usage.bytes / 2**20:.1f} MB of disk_mb={disk_mb}"
        await self._lose_interpreter(f"the previous cell exceeded its disk budget ({what})")
        folder = await asyncio.get_running_loop().run_in_executor(
            None, make_folder, self.backend, self._resources.lease
        )
        if not self._resources.replace_folder(folder):
            return ReplResult(stdout=notice + stdout, error=_CLOSED_DURING_CELL, crashed=True, restarted=bool(notice))
        self._folder_used = False
        error = (
            f"disk budget exceeded: {what} (all files beneath its home together, removed files still open "
            "included). The REPL process was killed: its variables and files are lost and the next cell starts a "
            "fresh REPL in an empty home."
        )
        return ReplResult(stdout=notice + stdout, error=error, crashed=True, restarted=bool(notice))

    async def _replace_after_failed_restart(self, failure: SandboxError) -> ReplResult:
        """A restart failed where an interpreter ran before: the REPL's own code may have broken it (its folder
        outlives each interpreter: a home made unusable, a log filled). The REPL is replaced: a new folder, the
        next cell starts a fresh interpreter there, and this cell reports a crash instead of raising."""
        folder = await asyncio.get_running_loop().run_in_executor(
            None, make_folder, self.backend, self._resources.lease
        )
        if not self._resources.replace_folder(folder):
            return ReplResult(stdout="", error=_CLOSED_DURING_CELL, crashed=True)
        self._folder_used = False
        self._lost_reason = (
            "its restart failed, so it was replaced by a fresh REPL in a new folder (its files are lost)"
        )
        error = (
            "The REPL could not be restarted, so it was replaced by a fresh one in a new folder: its variables and "
            f"files are lost and this cell did not run. {failure}"
        )
        return ReplResult(stdout="", error=error, crashed=True)

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
        """Kill the current interpreter (the next cell starts a fresh one); returns its exit status."""
        resources = self._resources
        interpreter = resources.interpreter
        if reason is not None:
            self._lost_reason = reason
        if interpreter is None:
            return None
        # Killed before it is dropped: a concurrent `close` then still finds it, and waits for the same kill.
        returncode = await asyncio.get_running_loop().run_in_executor(None, interpreter.kill)
        if resources.interpreter is interpreter:
            resources.interpreter = None
        return returncode

    def _log_tail(self, limit: int = 2000) -> str:
        """The last `limit` bytes the sandbox wrote before it confined itself (its start-up errors), as text made
        safe for the trainer's log (`quote_sandbox_text`: a REPL that shares the trainer's uid can write there)."""
        resources = self._resources
        if not resources.lock.acquire(blocking=False):
            return ""  # being closed by another thread: the log is going away
        try:
            if resources.released:
                return ""
            size = os.fstat(resources.log_fd).st_size
            data = os.pread(resources.log_fd, limit, max(0, size - limit))
        except OSError:
            return ""
        finally:
            resources.lock.release()
        tail = data.decode("utf-8", "replace").strip()
        return quote_sandbox_text(tail) if tail else ""

    def _run_sync(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:  # called from inside an event loop (e.g. a notebook): run on a helper thread with its own loop
            with ThreadPoolExecutor(max_workers=1) as pool:
                return pool.submit(asyncio.run, coroutine).result()
        resources = self._resources
        with resources.lock:
            if resources.released:
                coroutine.close()
                raise RuntimeError("This PythonREPL is closed; create a new one.")
            if resources.loop is None:
                resources.loop = asyncio.new_event_loop()
            loop = resources.loop
            resources.loop_in_use = True
        try:
            return loop.run_until_complete(coroutine)
        finally:
            with resources.lock:
                resources.loop_in_use = False
                if resources.released:  # closed by another thread during this cell: the loop is ours to close
                    loop.close()


def _format_log_tail(tail: str) -> str:
    return f"\nLast output of the process:\n{tail}" if tail else ""
