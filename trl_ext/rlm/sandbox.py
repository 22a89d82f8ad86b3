"""Operating-system isolation for the REPL: who the sandboxed interpreter runs as, what it sees, how it dies.

`PythonREPL` (in `repl.py`) uses these helpers; they hold no REPL logic. What they give, on Linux:

- **Identity.** When the trainer runs as root (containers, CI), every REPL gets its own unprivileged uid/gid
  from `DEFAULT_SANDBOX_UIDS`, leased with an ``flock`` so concurrent trainers on one host never share one.
  A private uid is what makes the other limits real: root ignores ``RLIMIT_NPROC`` and may raise any limit,
  read ``/proc/<trainer pid>/environ`` and the trainer's files, and signal the trainer. Under a private uid
  the sandbox can do none of that, and ``kill(-1)`` from inside reaches exactly the sandbox's own processes.
  A non-root trainer cannot switch uid: the REPL then shares the trainer's uid (weaker: see the docs page).
- **Environment.** An allow-list (`sandbox_environment`): no variable of the trainer reaches the sandbox
  unless listed there or passed explicitly.
- **Imports.** Only the interpreter's own stdlib and site-packages directories (`interpreter_import_paths`),
  not the trainer's ``sys.path`` (which may contain a project directory with secrets in it).
- **Namespaces (opt-in).** ``isolation="namespace"`` runs the interpreter under ``unshare`` in new network
  (no network at all), PID (no view of host processes, everything dies with the REPL) and mount namespaces.

Nothing here is a substitute for a VM: a kernel exploit escapes all of it.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import shutil
import signal
import site
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Unprivileged uids (and gids of the same number) handed to REPLs when the trainer runs as root. They belong to no
# account; the range sits far above the uids distributions give to people and services.
DEFAULT_SANDBOX_UIDS = range(1_900_000_000, 1_900_000_000 + 65_536)

# Variables copied from the trainer's environment when set. Everything else is dropped.
ENV_ALLOWLIST = ("LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ")

# Variables the sandbox always gets: a minimal PATH, a private HOME/TMPDIR, and single-threaded numeric
# libraries (each thread counts against the process limit, each malloc arena against the address space).
_FIXED_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MALLOC_ARENA_MAX": "2",
}

ISOLATION_MODES = ("process", "namespace")


class SandboxError(RuntimeError):
    """The sandbox could not be set up (missing isolation tool, unmapped uids, interpreter failed to start)."""


def sandbox_environment(home: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The complete environment of a sandboxed interpreter.

    Args:
        home: the sandbox's working directory, used as ``HOME`` and ``TMPDIR``.
        extra: variables to pass on purpose (e.g. a helper's configuration). Never put secrets here: model code
            can read and print every variable it gets.
    """
    env = dict(_FIXED_ENV)
    env.update({name: os.environ[name] for name in ENV_ALLOWLIST if name in os.environ})
    env.update(HOME=home, TMPDIR=home)
    for name, value in (extra or {}).items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"env must map str to str, got {name!r}: {value!r}")
        env[name] = value
    return env


@functools.cache
def interpreter_import_paths() -> tuple[str, ...]:
    """The interpreter's stdlib, lib-dynload and site-packages directories, in import order."""
    paths = sysconfig.get_paths()
    candidates = [
        os.path.join(sys.base_prefix, "lib", f"python{sys.version_info[0]}{sys.version_info[1]}.zip"),
        paths["stdlib"],
        paths["platstdlib"],
        os.path.join(paths["stdlib"], "lib-dynload"),
        paths["purelib"],
        paths["platlib"],
        *site.getsitepackages(),
    ]
    ordered: list[str] = []
    for path in candidates:
        if os.path.isdir(path) and path not in ordered:
            ordered.append(path)
    return tuple(ordered)


# ------------------------------------------------------------------------------------------------- identities
@dataclass
class UidLease:
    """An unprivileged uid/gid held exclusively (``flock``) until `release`."""

    uid: int
    gid: int
    _lock_fd: int

    def release(self) -> None:
        if self._lock_fd >= 0:
            with _lease_lock:
                os.close(self._lock_fd)  # closing the descriptor drops the flock
                self._lock_fd = -1
                _held_uids.discard(self.uid)


def _mapped_id_ranges(path: str) -> list[range]:
    """The ids usable in this user namespace (the "inside" column of /proc/self/{uid,gid}_map)."""
    try:
        with open(path) as handle:
            rows = [line.split() for line in handle if line.strip()]
    except OSError:  # no user namespaces compiled in: every id is usable
        return [range(0, 2**32 - 1)]
    return [range(int(inside), int(inside) + int(count)) for inside, _outside, count in rows]


def _check_ids_mapped(uids: range) -> None:
    for path in ("/proc/self/uid_map", "/proc/self/gid_map"):
        if not any(uids.start >= mapped.start and uids.stop <= mapped.stop for mapped in _mapped_id_ranges(path)):
            raise SandboxError(
                f"The sandbox ids {uids.start}..{uids.stop - 1} are not all mapped in this user namespace "
                f"({path}). Pass sandbox_uids=range(a, b) inside a mapped range, away from real accounts."
            )


def _lock_directory() -> str:
    directory = os.path.join(tempfile.gettempdir(), "trl_ext_sandbox_uids")
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise SandboxError(
            f"{directory} must be a directory owned by uid {os.geteuid()} with mode 0700 (it holds the sandbox uid "
            "leases); remove it and retry."
        )
    return directory


_lease_lock = threading.Lock()
_held_uids: set[int] = set()  # leased by this process (skipped without a system call)


def acquire_uid(uids: range = DEFAULT_SANDBOX_UIDS) -> UidLease:
    """Lease a uid of `uids` that no other REPL on this host holds (gid = uid).

    Each trainer process probes from its own sixteenth of the range, lowest uid first, so concurrent trainers
    rarely contend and a few lock files get reused rather than one per uid ever leased.
    """
    if not isinstance(uids, range) or len(uids) == 0 or uids.step != 1 or uids.start < 1000:
        raise ValueError(f"sandbox_uids must be a non-empty range of uids >= 1000 with step 1, got {uids!r}")
    _check_ids_mapped(uids)
    directory = _lock_directory()
    start = (os.getpid() % 16) * (len(uids) // 16)
    with _lease_lock:
        for offset in range(len(uids)):
            uid = uids[(start + offset) % len(uids)]
            if uid in _held_uids:
                continue
            path = os.path.join(directory, f"{uid}.lock")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EAGAIN, errno.EACCES):
                    continue
                raise
            _held_uids.add(uid)
            return UidLease(uid=uid, gid=uid, _lock_fd=fd)
    raise SandboxError(f"All {len(uids)} sandbox uids are in use; pass a larger sandbox_uids range.")


def processes_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real, effective, saved or filesystem uid is `uid`.

    Reads ``/proc/<pid>/status`` rather than the owner of ``/proc/<pid>``: a process can hide its owner there by
    making itself non-dumpable, not its credentials here.
    """
    found = []
    needle = str(uid).encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{name}/status", os.O_RDONLY)
        except OSError:
            continue
        try:
            status = os.read(fd, 4096)
        except OSError:
            continue
        finally:
            os.close(fd)
        uid_line = status[status.find(b"\nUid:") + 5 :].split(b"\n", 1)[0]
        state = status[status.find(b"\nState:") + 7 :].lstrip()[:1]
        if needle in uid_line.split() and state not in (b"Z", b"X"):  # zombies cannot run
            found.append(int(name))
    return found


def count_tasks_of_uid(uid: int) -> int:
    """Processes and threads of `uid` (what ``RLIMIT_NPROC`` counts), from the owners of ``/proc/<pid>``."""
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{name}/task"))
            except OSError:
                continue
    return count


def kill_uid(uid: int, timeout_s: float = 5.0) -> bool:
    """SIGKILL every process of `uid` until none is left; returns False if some survived `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = processes_of_uid(uid)
        if not pids:
            return True
        if time.monotonic() > deadline:
            logger.warning("Sandbox uid %d still has processes %s after %.1f s", uid, pids, timeout_s)
            return False
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.001)


# ------------------------------------------------------------------------------------------------- isolation
_probe_results: dict[tuple[str, bool], str | None] = {}


def isolation_command(isolation: str, as_root: bool) -> list[str]:
    """The command prefix that puts the interpreter in its isolation mode (empty for ``"process"``).

    Raises:
        ValueError: unknown mode.
        SandboxError: ``"namespace"`` was asked for but ``unshare`` is missing or not permitted here.
    """
    if isolation not in ISOLATION_MODES:
        raise ValueError(f"isolation must be one of {ISOLATION_MODES}, got {isolation!r}")
    if isolation == "process":
        return []
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SandboxError(
            "isolation='namespace' needs the `unshare` tool (util-linux), which is not on PATH. Install util-linux "
            "or use isolation='process'."
        )
    command = [unshare, "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
    if not as_root:
        command += ["--user", "--map-root-user"]
    key = (unshare, as_root)
    if key not in _probe_results:
        try:
            probe = subprocess.run([*command, "true"], capture_output=True, text=True, timeout=30)
            _probe_results[key] = (
                None if probe.returncode == 0 else (probe.stderr.strip() or f"exit {probe.returncode}")
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            _probe_results[key] = str(exc)
    failure = _probe_results[key]
    if failure is not None:
        raise SandboxError(
            f"isolation='namespace' is not available here: `{' '.join(command)} true` failed ({failure}). It needs "
            "root or unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, and a container "
            "runtime that allows unshare). Use isolation='process' instead."
        )
    return command


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


def force_rmtree(path: str) -> None:
    """Remove a directory the sandbox may have made unreadable (``chmod 000``) before it was closed."""

    def _retry(function, failed_path, _exc_info):
        parent = os.path.dirname(failed_path)
        for target in (parent, failed_path):
            try:
                os.chmod(target, 0o700, follow_symlinks=False)
            except (OSError, NotImplementedError):
                pass
        try:
            function(failed_path)
        except FileNotFoundError:
            pass
        except OSError:
            if os.path.isdir(failed_path) and not os.path.islink(failed_path):
                shutil.rmtree(failed_path, ignore_errors=True)

    if not os.path.lexists(path):
        return
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=_retry)
    else:
        shutil.rmtree(path, onerror=_retry)
