"""The interface between a REPL and where its interpreter runs: `SandboxBackend` (prepare a REPL's directory,
start an interpreter), `SandboxProcess` (the running interpreter: the two descriptors of the wire protocol, its
life cycle) and `LaunchSpec` (what to start).

Threat model (docs/security.md): a backend decides what the interpreter is isolated from; `PythonREPL` asks it
(`environment`, `shared_dirs`, `SandboxProcess.contained`) and never branches on which backend it is. Whatever
the backend, the parent side is the same: it never unpickles anything the sandbox sends (JSON frames, size-capped).
`trl_ext.rlm.sandbox.local.LocalBackend` runs interpreters on this host; another backend (e.g. one container per
REPL on a remote host) implements `prepare` and `start` and returns a `SandboxProcess` whose descriptors carry the
same wire protocol (a socket pair works).
"""

from __future__ import annotations

import abc
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from .disk import DiskUsage
from .identity import UidLease
from .limits import SandboxLimits, sandbox_environment


@dataclass
class LaunchSpec:
    """One interpreter for `SandboxBackend.start` to run.

    Attributes:
        limits: the REPL's limits and isolation settings (the server's output and answer caps among them).
        lease: the private uid (root trainers) or None.
        root_dir: the REPL's private host directory (0711 when leased, removed by the REPL at close).
        home: the sandbox's working directory as the backend prepared it (`SandboxBackend.prepare`).
        log_fd: where the interpreter's stdout and stderr go.
        env: the interpreter's complete environment (`SandboxBackend.environment`).
        init_payload: the pickled ``{"kind": "init", ...}`` message, sent once the server runs.
    """

    limits: SandboxLimits
    lease: UidLease | None
    root_dir: str
    home: str
    log_fd: int
    env: Mapping[str, str]
    init_payload: bytes


class SandboxProcess(abc.ABC):
    """A running sandboxed interpreter as its REPL sees it: two pipes of the wire protocol and its life cycle."""

    read_fd: int  # messages from the sandbox
    write_fd: int  # messages to the sandbox
    pid: int

    @abc.abstractmethod
    def freeze(self) -> None:
        """Stop every process of the sandbox (no-op where the backend cannot)."""

    @abc.abstractmethod
    def thaw(self) -> None:
        """Let it run again."""

    @abc.abstractmethod
    def kill(self) -> int | None:
        """Kill everything of this interpreter and wait until nothing is left; returns its exit status."""

    def out_of_memory(self) -> bool:
        """The sandbox's memory limit killed one of its processes."""
        return False

    def memory_peak_bytes(self) -> int | None:
        """Peak memory of this interpreter life, all its processes and files together (None: not measured)."""
        return None

    @property
    def measures_disk(self) -> bool:
        """The backend cannot bound the REPL's disk itself (the process backend's home on the host's disk), so
        `PythonREPL` asks `disk_usage` during and after every cell and stops a REPL past its ``disk_mb``. False:
        the backend bounds it (the namespace backend's tmpfs)."""
        return False

    def disk_usage(self, max_bytes: int, max_files: int) -> DiskUsage | None:
        """What the REPL's files take where `measures_disk`, counted up to just past `max_bytes` or `max_files`
        (`trl_ext.rlm.sandbox.disk.DiskUsage`); None where not."""
        return None

    @property
    def contained(self) -> bool:
        """After `kill`: nothing this interpreter started can remain under its uid (so the REPL need not scan for
        leftovers before handing the uid back). False unless the backend can tell."""
        return False


class SandboxBackend(abc.ABC):
    """Where sandboxed interpreters run: `trl_ext.rlm.sandbox.local.LocalBackend` runs them on this host; another
    backend (e.g. one container per REPL on a remote host) implements `prepare` and `start` and returns a
    `SandboxProcess` whose descriptors carry the same wire protocol (a socket pair works), and is passed as
    ``PythonREPL(..., backend=...)`` or ``RLMEngine(..., sandbox_backend=...)``.

    Attributes:
        name: what `PythonREPL.isolation` and the logs call this backend (e.g. ``"namespace"``).
        shared_dirs: host directories the sandbox's uid can write to and others can see (the process backend's
            ``/tmp``, ``/dev/shm``...): what a closed REPL's uid left there is deleted before the uid is reused.
            Empty where the sandbox's writable directories are its own.
        folder_parent: where its REPLs' private folders are made (`trl_ext.rlm.repl_resources.make_folder`); None:
            the temporary folder.
    """

    name: str
    shared_dirs: tuple[str, ...] = ()
    folder_parent: str | None = None

    def environment(self, home: str, extra: Mapping[str, str] | None) -> dict[str, str]:
        """The complete environment of an interpreter whose home is `home` (`sandbox_environment`: the allow-list,
        ``HOME`` and ``TMPDIR`` set to `home`, then `extra`)."""
        return sandbox_environment(home, extra)

    @abc.abstractmethod
    def prepare(self, root_dir: str, lease: UidLease | None) -> str:
        """Set up a new REPL's private directory; returns its home as model code sees it."""

    @abc.abstractmethod
    def start(self, spec: LaunchSpec) -> SandboxProcess:
        """Start one interpreter and send it the server, its configuration and the init payload."""


def quote_sandbox_text(text: str) -> str:
    """`text` from a sandbox (its start-up log, a message) made safe for the trainer's log and exceptions: every
    character that is not printable (terminal escapes, carriage returns, Unicode line and direction controls) is
    written as its Python escape (``\\x1b``), and every line starts with ``| ``, so that no line of it can pass
    for a record of the trainer's own log (``WARNING trl_ext: ...``). The one helper for every such string."""
    return "\n".join(
        "| " + "".join(char if char.isprintable() else char.encode("unicode_escape").decode("ascii") for char in line)
        for line in text.split("\n")
    )


def describe_exit(returncode: int | None) -> str:
    """Why a sandboxed interpreter stopped, in words the model can act on."""
    if returncode is None:
        return "stopped responding"
    if returncode >= 0:
        return f"exited with status {returncode}"
    number = -returncode
    reasons = {
        signal.SIGXCPU: "exceeded its CPU-time limit",
        signal.SIGKILL: "was killed (out of memory or over its CPU-time limit)",
        signal.SIGSEGV: "crashed (segmentation fault)",
        signal.SIGXFSZ: "exceeded the file-size limit",
        signal.SIGABRT: "aborted",
    }
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    return reasons.get(number, f"was killed by {name}")
