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

import abc
import array
import errno
import fcntl
import functools
import itertools
import logging
import math
import os
import pickle
import select
import shutil
import signal
import site
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..fields import mirror_field

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

ISOLATION_MODES = ("auto", "strict", "process")

# Host directories every uid may write to: what a process-backend REPL leaves there is deleted at its close.
SHARED_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")


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


def remove_files_of_uid(uid: int, roots: Sequence[str] = SHARED_WRITABLE_DIRS) -> list[str]:
    """Delete what `uid` left in the host's world-writable directories; returns what could not be removed.

    The process backend shares ``/tmp`` and ``/dev/shm`` with the host: a REPL's files there would otherwise
    outlive it and be read by the next REPL that leases the same uid.
    """
    failed = []
    for root in roots:
        try:
            entries = list(os.scandir(root))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    force_rmtree(entry.path)
                else:
                    os.unlink(entry.path)
            except FileNotFoundError:
                continue
            except OSError:
                failed.append(entry.path)
            if os.path.lexists(entry.path):
                failed.append(entry.path)
    return failed


# ---------------------------------------------------------------------------------------------------- limits
def _limit(default: Any, help: str) -> Any:  # noqa: A002 - "help" as in TRL's field metadata
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class SandboxLimits:
    """Every limit and isolation setting of a sandboxed REPL, in one place.

    `PythonREPL`, the judge's Python tools and the RLM engine all take one of these; the trainer configs expose
    each field as ``repl_<name>`` (see `SandboxArguments`). docs/security.md says what each backend enforces.
    """

    isolation: str = _limit(
        "auto",
        "'auto': namespaces when the host allows them (no network, private file system and processes), else the "
        "process backend with a warning naming what is not isolated; 'strict': namespaces or refuse to start; "
        "'process': no namespaces.",
    )
    network: bool = _limit(
        False,
        "Give model code the host's network. It then reaches every service the trainer can, including the "
        "unauthenticated endpoints of `trl vllm-serve` that replace the policy's weights. Namespaces only.",
    )
    timeout_s: float = _limit(10.0, "Wall-clock limit of one cell (time waiting for query answers not counted).")
    startup_timeout_s: float = _limit(30.0, "Time allowed for a REPL to start and load its context and helpers.")
    memory_mb: int = _limit(
        1024,
        "Memory of one REPL: all its processes together with its /tmp, /dev/shm and memfd files (control group), "
        "and the address space of each process.",
    )
    max_processes: int = _limit(32, "Processes and threads model code may create in one REPL.")
    cpus: float = _limit(1.0, "CPU cores one REPL may use at once (control group quota).")
    cpu_time_s: float | None = _limit(None, "CPU time of each process of a REPL over its life; None: 20 x timeout_s.")
    disk_mb: int = _limit(
        256, "Writable space of one REPL: its home, /tmp and /dev/shm together; also the largest file."
    )
    max_open_files: int = _limit(256, "Open file descriptors per process.")
    max_output_chars: int = _limit(20_000, "Characters of a cell's output kept (the rest is counted in a note).")
    max_answer_chars: int = _limit(100_000, "Longest final answer accepted; longer ones are cut and counted.")
    max_message_bytes: int = _limit(64 * 2**20, "Largest message accepted from a REPL (a query or a result).")
    sandbox_uids: range = _limit(DEFAULT_SANDBOX_UIDS, "Unprivileged uids leased to REPLs when the trainer is root.")

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATION_MODES:
            raise ValueError(f"isolation must be one of {ISOLATION_MODES}, got {self.isolation!r}")
        if not isinstance(self.network, bool):
            raise TypeError(f"network must be True or False, got {self.network!r}")
        for name in ("timeout_s", "startup_timeout_s", "cpus"):
            _check_positive_number(name, getattr(self, name))
        if self.cpu_time_s is not None:
            _check_positive_number("cpu_time_s", self.cpu_time_s)
        minimums = {"memory_mb": 64, "max_processes": 0, "disk_mb": 1, "max_open_files": 16}
        minimums.update(max_output_chars=1, max_answer_chars=1, max_message_bytes=1024)
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                hint = " (the interpreter alone needs ~30 MB)" if name == "memory_mb" else ""
                raise ValueError(f"{name} must be an int >= {minimum}{hint}, got {value!r}")
        uids = self.sandbox_uids
        if not isinstance(uids, range) or len(uids) == 0 or uids.step != 1 or uids.start < 1000:
            raise ValueError(f"sandbox_uids must be a non-empty range of uids >= 1000 with step 1, got {uids!r}")

    @property
    def cpu_time_limit_s(self) -> float:
        return self.cpu_time_s if self.cpu_time_s is not None else 20 * self.timeout_s

    def with_overrides(self, **overrides: Any) -> SandboxLimits:
        """A copy with some fields changed; unknown names raise a `TypeError` that lists the valid ones."""
        unknown = sorted(set(overrides) - {f.name for f in fields(self)})
        if unknown:
            raise TypeError(f"Unknown sandbox limit(s) {unknown}; valid: {[f.name for f in fields(self)]}")
        return replace(self, **overrides) if overrides else self


def _argument(name: str) -> Any:
    return mirror_field(SandboxLimits, name, "REPL sandbox")


@dataclass
class SandboxArguments:
    """The `SandboxLimits` fields as trainer-config fields (``repl_<name>``), so that each is one command-line flag
    or recipe key. Mixed into the configs of the trainers that run model or judge code."""

    repl_isolation: str = _argument("isolation")
    repl_network: bool = _argument("network")
    repl_timeout_s: float = _argument("timeout_s")
    repl_startup_timeout_s: float = _argument("startup_timeout_s")
    repl_memory_mb: int = _argument("memory_mb")
    repl_max_processes: int = _argument("max_processes")
    repl_cpus: float = _argument("cpus")
    repl_cpu_time_s: float | None = _argument("cpu_time_s")
    repl_disk_mb: int = _argument("disk_mb")
    repl_max_open_files: int = _argument("max_open_files")
    repl_max_output_chars: int = _argument("max_output_chars")
    repl_max_answer_chars: int = _argument("max_answer_chars")
    repl_max_message_bytes: int = _argument("max_message_bytes")

    def sandbox_limits(self) -> SandboxLimits:
        """The `SandboxLimits` these fields describe (raises the limit's own `ValueError` for a bad value)."""
        return SandboxLimits(**{f.name[len("repl_") :]: getattr(self, f.name) for f in fields(SandboxArguments)})


def _check_positive_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


# ------------------------------------------------------------------------------------------- host support
_NAMESPACE_PROBE = r"""
import ctypes, os, sys, tempfile
libc = ctypes.CDLL(None, use_errno=True)
def check(result, what):
    if result != 0:
        raise SystemExit(f"{what}: {os.strerror(ctypes.get_errno())}")
user = os.geteuid() != 0
uid, gid = os.getuid(), os.getgid()
check(libc.unshare((0x10000000 if user else 0) | 0x20000000), "unshare(user, pid)")
if user:
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as handle:
            handle.write(text)
pid = os.fork()
if pid:
    raise SystemExit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
check(libc.unshare(0x00020000 | 0x40000000 | 0x08000000 | 0x04000000), "unshare(mount, net, ipc, uts)")
check(libc.mount(None, b"/", None, 16384 | (1 << 18), None), "make / private")
root = sys.argv[1]
check(libc.mount(b"tmpfs", root.encode(), b"tmpfs", 6, b"size=1m"), "mount tmpfs")
os.mkdir(os.path.join(root, "proc"))
check(libc.mount(b"proc", os.path.join(root, "proc").encode(), b"proc", 14, None), "mount proc")
"""


@dataclass(frozen=True)
class HostSupport:
    """What this host lets the sandbox use (probed once per trainer process by `host_support`).

    Attributes:
        namespaces: None when new user/PID/mount/network namespaces and the mounts the namespace backend needs
            work here, else why not.
        cgroup_dirs: control-group controller ("memory", "pids", "freezer", "cpu") -> the directory REPL groups
            are created in (cgroup v1, under the trainer's own group); empty when not writable.
        cgroups: None when memory, pids and freezer groups can be created, else why not.
        seccomp: None when the syscall filter can be installed (x86_64 Linux), else why not.
        as_root: the trainer runs as root (REPLs then get private uids).
    """

    namespaces: str | None
    cgroup_dirs: Mapping[str, str]
    cgroups: str | None
    seccomp: str | None
    as_root: bool


_host_lock = threading.Lock()
_host: HostSupport | None = None


def host_support(refresh: bool = False) -> HostSupport:
    """Probe (once) what isolation this host allows."""
    global _host
    with _host_lock:
        if _host is None or refresh:
            _host = HostSupport(
                namespaces=_probe_namespaces(),
                cgroup_dirs=(dirs := _probe_cgroups()),
                cgroups=None if {"memory", "pids", "freezer"} <= set(dirs) else _cgroup_problem(dirs),
                seccomp=_probe_seccomp(),
                as_root=os.geteuid() == 0,
            )
        return _host


def _probe_namespaces() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    root = tempfile.mkdtemp(prefix="trl_ext_probe_")
    try:
        probe = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _NAMESPACE_PROBE, root], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if probe.returncode == 0:
        return None
    return (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]


def _probe_seccomp() -> str | None:
    if os.uname().machine != "x86_64":
        return f"the syscall filter is written for x86_64, this is {os.uname().machine}"
    try:
        with open("/proc/self/status") as handle:
            if "Seccomp:" not in handle.read():
                return "the kernel has no seccomp support"
    except OSError as exc:
        return str(exc)
    return None


def _cgroup_problem(dirs: Mapping[str, str]) -> str:
    if os.path.isfile("/sys/fs/cgroup/cgroup.controllers"):
        return "the host uses cgroup v2 only, which trl-ext does not drive yet"
    missing = sorted({"memory", "pids", "freezer"} - set(dirs))
    return f"no writable cgroup v1 {', '.join(missing)} controller(s) (needs root and /sys/fs/cgroup mounted rw)"


def _probe_cgroups() -> dict[str, str]:
    """Writable cgroup v1 directories for the controllers the sandbox uses, under the trainer's own groups."""
    if os.geteuid() != 0:
        return {}
    try:
        with open("/proc/self/mounts") as handle:
            mounts = [line.split() for line in handle]
        with open("/proc/self/cgroup") as handle:
            memberships = [line.rstrip("\n").split(":", 2) for line in handle]
    except OSError:
        return {}
    own = {}
    for _hierarchy, controllers, path in memberships:
        for controller in controllers.split(","):
            own[controller] = path
    dirs = {}
    for _source, mountpoint, fstype, options, *_ in mounts:
        if fstype != "cgroup":
            continue
        for controller in set(options.split(",")) & {"memory", "pids", "freezer", "cpu"}:
            if controller in own and controller not in dirs:
                base = os.path.join(mountpoint, own[controller].lstrip("/"))
                probe = os.path.join(base, f"trl_ext_probe_{os.getpid()}")
                try:
                    os.mkdir(probe)
                    os.rmdir(probe)
                except OSError:
                    continue
                dirs[controller] = base
    return dirs


def resolve_isolation(limits: SandboxLimits) -> str:
    """The backend `limits` gets on this host: ``"namespace"`` or ``"process"``.

    Raises:
        SandboxError: ``isolation="strict"`` and namespaces are not available (the message says why).
    """
    host = host_support()
    if limits.isolation == "process":
        if limits.network is False:
            _warn_once("process-network", "isolation='process' cannot take the network away from model code.")
        return "process"
    if host.namespaces is None:
        return "namespace"
    if limits.isolation == "strict":
        raise SandboxError(
            f"isolation='strict' needs Linux namespaces, which this host does not allow ({host.namespaces}). Run "
            "as root or enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; a "
            "container needs CAP_SYS_ADMIN or a seccomp profile that allows unshare), or set isolation='auto' to "
            "accept the process backend."
        )
    _warn_once(
        "auto-fallback",
        f"REPL sandbox: Linux namespaces are not available here ({host.namespaces}); falling back to the process "
        f"backend. NOT isolated: {'; '.join(isolation_report(limits)['open'])}. Set isolation='strict' to refuse "
        "to start instead (docs/security.md).",
    )
    return "process"


def isolation_report(limits: SandboxLimits) -> dict[str, Any]:
    """What the REPLs of `limits` get on this host: ``{"repl/isolation", "isolated", "open"}`` (for run info)."""
    host = host_support()
    backend = "process" if limits.isolation == "process" or host.namespaces is not None else "namespace"
    isolated = ["environment (allow-list)", "rlimits per process"]
    opened = []
    if host.as_root:
        isolated.append("private uid per REPL (other REPLs, the trainer's processes)")
    else:
        opened.append("REPLs share the trainer's uid: model code can signal and read the trainer's processes")
    if backend == "namespace":
        isolated += ["file system (runtime read-only, private home, /tmp, /dev/shm)", "PID namespace"]
        if limits.network:
            opened.append("the network (network=True: model code reaches the host's services)")
        else:
            isolated.append("network")
    else:
        opened += [
            "the host file system (world-readable files: datasets, checkpoints, the trainer's command line)",
            "the network and local services (e.g. trl vllm-serve's weight-update endpoints)",
            "/tmp and /dev/shm are the host's (files of a closed REPL are deleted, not hidden)",
        ]
    if host.cgroups is None:
        isolated.append("per-REPL memory, processes, CPU, freezing between cells (control groups)")
    else:
        opened.append(
            f"limits are per process, not per REPL, and nothing freezes REPLs between cells ({host.cgroups})"
        )
    if backend == "process":
        opened.append("disk use is capped per file, not per REPL")
    if host.seccomp is None:
        isolated.append("no_new_privs and a syscall filter (namespaces, mount, ptrace, keyctl, bpf...)")
    else:
        isolated.append("no_new_privs")
        opened.append(f"no syscall filter ({host.seccomp})")
    return {"repl/isolation": backend, "isolated": isolated, "open": opened}


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


# --------------------------------------------------------------------------------------------- control groups
_cgroup_counter = itertools.count()


class ControlGroups:
    """The cgroup v1 memory, pids, freezer (and cpu) groups of one interpreter life: the whole REPL, not each
    process, is limited, and it can be frozen between cells and killed as one."""

    def __init__(self, dirs: Mapping[str, str], limits: SandboxLimits) -> None:
        name = f"trl_ext_{os.getpid()}_{next(_cgroup_counter)}"
        self.paths: dict[str, str] = {}
        try:
            for controller, base in dirs.items():
                path = os.path.join(base, name)
                os.mkdir(path)
                self.paths[controller] = path
            memory = str(limits.memory_mb * 2**20)
            self._write("memory", "memory.limit_in_bytes", memory)
            if os.path.exists(os.path.join(self.paths["memory"], "memory.memsw.limit_in_bytes")):
                self._write("memory", "memory.memsw.limit_in_bytes", memory)  # no escape into swap
            self._write("pids", "pids.max", str(1 + limits.max_processes))
            if "cpu" in self.paths:
                self._write("cpu", "cpu.cfs_period_us", "100000")
                self._write("cpu", "cpu.cfs_quota_us", str(max(1000, int(limits.cpus * 100_000))))
        except BaseException:
            self.remove()
            raise

    def _write(self, controller: str, name: str, value: str) -> None:
        with open(os.path.join(self.paths[controller], name), "w") as handle:
            handle.write(value)

    def _read(self, controller: str, name: str) -> str:
        with open(os.path.join(self.paths[controller], name)) as handle:
            return handle.read()

    def tasks(self) -> int:
        """Processes and threads in the group now."""
        return int(self._read("pids", "pids.current"))

    def freeze(self) -> None:
        self._write("freezer", "freezer.state", "FROZEN")

    def thaw(self) -> None:
        self._write("freezer", "freezer.state", "THAWED")

    def pids(self) -> set[int]:
        found: set[int] = set()
        for controller in self.paths:
            try:
                found.update(int(line) for line in self._read(controller, "cgroup.procs").split())
            except OSError:
                continue
        return found

    def memory_peak_bytes(self) -> int:
        """Largest memory use of the REPL so far (all processes, tmpfs and memfd files, kernel memory)."""
        return int(self._read("memory", "memory.max_usage_in_bytes"))

    def out_of_memory(self) -> bool:
        """The kernel killed a process of the group for exceeding its memory limit."""
        if "memory" not in self.paths:
            return False
        try:
            for line in self._read("memory", "memory.oom_control").splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1]) > 0
            return int(self._read("memory", "memory.failcnt")) > 0
        except (OSError, ValueError):
            return False

    def kill(self, timeout_s: float = 5.0) -> bool:
        """SIGKILL every process of the groups (thawed first: a frozen task dies only once thawed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.pids()
            if not pids:
                return True
            if "freezer" in self.paths:
                try:
                    self.thaw()
                except OSError:
                    pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)

    def remove(self, timeout_s: float = 5.0) -> bool:
        """Remove the (empty) groups; returns False when one is still busy after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for controller in list(self.paths):
            while True:
                try:
                    os.rmdir(self.paths[controller])
                except FileNotFoundError:
                    pass
                except OSError:
                    if time.monotonic() < deadline:
                        time.sleep(0.002)
                        continue
                    logger.warning("Could not remove the REPL control group %s", self.paths[controller])
                    return False
                del self.paths[controller]
                break
        return True


# ------------------------------------------------------------------------------------------------- backends
# What the namespace backend shows of the host, read-only (when present): the system's programs and libraries and
# the few /etc files they read. The interpreter's own directories are added by `_runtime_paths`.
RUNTIME_BIND_PATHS = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/passwd",
    "/etc/group",
    "/etc/hosts",
    "/etc/resolv.conf",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/mime.types",
)
NAMESPACE_HOME = "/home/repl"


@functools.cache
def _runtime_paths() -> tuple[str, ...]:
    """Host paths bound read-only into a namespaced REPL: the system paths above and the interpreter's own."""
    candidates = [*RUNTIME_BIND_PATHS, sys.base_prefix, *interpreter_import_paths()]
    chosen: list[str] = []
    for path in sorted({os.path.normpath(path) for path in candidates}, key=len):
        if path == "/" or any(path.startswith(parent.rstrip("/") + "/") for parent in chosen):
            continue  # already visible through a parent
        if os.path.lexists(path):
            chosen.append(path)
    return tuple(chosen)


@dataclass
class LaunchSpec:
    """One interpreter for `SandboxBackend.start` to run.

    Attributes:
        limits: the REPL's limits and isolation settings.
        lease: the private uid (root trainers) or None.
        root_dir: the REPL's private host directory (0711 when leased, removed by the REPL at close).
        home: the sandbox's working directory as the backend prepared it (`SandboxBackend.prepare`).
        log_fd: where the interpreter's stdout and stderr go.
        env: the interpreter's complete environment.
        server_code: the compiled server (marshal), sent first; server_options: its settings; init_payload: the
            pickled ``{"kind": "init", ...}`` message sent after the configuration.
        boot: the ``-c`` stub that reads and runs the server code.
    """

    limits: SandboxLimits
    lease: UidLease | None
    root_dir: str
    home: str
    log_fd: int
    env: Mapping[str, str]
    server_code: bytes
    server_options: Mapping[str, Any]
    init_payload: bytes
    boot: str


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


class SandboxBackend(abc.ABC):
    """Where sandboxed interpreters run. `LocalBackend` runs them on this host; another backend (e.g. one
    container per REPL on a remote host) implements `prepare` and `start` and returns a `SandboxProcess` whose
    descriptors carry the same wire protocol (a socket pair works)."""

    name: str

    @abc.abstractmethod
    def prepare(self, root_dir: str, lease: UidLease | None) -> str:
        """Set up a new REPL's private directory; returns its home as model code sees it."""

    @abc.abstractmethod
    def start(self, spec: LaunchSpec) -> SandboxProcess:
        """Start one interpreter and send it the server, its configuration and the init payload."""


class LocalProcess(SandboxProcess):
    """An interpreter under its supervisor (see `_sandbox_child._supervise`) on this host."""

    def __init__(
        self,
        pid: int,
        read_fd: int,
        write_fd: int,
        lifeline: int,
        status: int,
        cgroups: ControlGroups | None,
        uid: int | None,
    ) -> None:
        self.pid, self.read_fd, self.write_fd = pid, read_fd, write_fd
        self._lifeline, self._status, self._cgroups, self._uid = lifeline, status, cgroups, uid
        try:  # to wait for the supervisor's exit, although it is the zygote's child, not ours
            self._pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = -1
        self._oom = False
        self._frozen = False

    def freeze(self) -> None:
        # The server's own thread waits on its pipe between cells: only a REPL that holds other threads or
        # processes has something to stop (this check saves the freezer's cost on most cells).
        if self._cgroups is not None and self._cgroups.tasks() > 1:
            self._cgroups.freeze()
            self._frozen = True

    def thaw(self) -> None:
        if self._frozen:
            self._cgroups.thaw()
            self._frozen = False

    def out_of_memory(self) -> bool:
        return self._oom or (self._cgroups is not None and self._cgroups.out_of_memory())

    def memory_peak_bytes(self) -> int | None:
        return self._cgroups.memory_peak_bytes() if self._cgroups is not None else None

    def kill(self) -> int | None:
        if self._lifeline >= 0:  # end of file on the lifeline: the supervisor kills the sandbox and exits
            try:
                os.write(self._lifeline, b"x")  # "closed on purpose": the supervisor leaves the REPL's directory
            except OSError:
                pass
            os.close(self._lifeline)
            self._lifeline = -1
        returncode = self._read_status(timeout_s=10)
        if returncode is None:
            logger.warning("The supervisor of sandboxed interpreter %d did not report within 10 s", self.pid)
            try:
                os.kill(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._pidfd >= 0:  # it exits right after its report
            _poll_one(self._pidfd, 5)
            os.close(self._pidfd)
            self._pidfd = -1
        if self._cgroups is not None:  # no process can leave its control groups: they hold all of the sandbox
            self._oom = self._cgroups.out_of_memory()
            self._cgroups.kill()
            self._cgroups.remove()
        elif self._uid is not None:
            kill_uid(self._uid)
        return returncode

    def _read_status(self, timeout_s: float) -> int | None:
        """The server's exit status as the supervisor reports it when it is done (None: no report in time)."""
        if self._status < 0:
            return None
        data = b""
        deadline = time.monotonic() + timeout_s
        poller = select.poll()
        poller.register(self._status, select.POLLIN)
        try:
            while len(data) < 4 and poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
                chunk = os.read(self._status, 4 - len(data))
                if not chunk:
                    break
                data += chunk
        finally:
            os.close(self._status)
            self._status = -1
        return os.waitstatus_to_exitcode(int.from_bytes(data, "big")) if len(data) == 4 else None

    @property
    def contained(self) -> bool:
        """Everything this interpreter started was in its control groups (now empty and removed)."""
        return self._cgroups is not None and not self._cgroups.paths


def _poll_one(fd: int, timeout_s: float) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


class _Zygote:
    """One pre-started interpreter per trainer process that forks the supervisors of new REPLs (see
    `_sandbox_child._zygote`): a fork of a loaded interpreter instead of a new one per REPL."""

    def __init__(self, server_code: bytes, boot: str) -> None:
        self.owner = os.getpid()
        self.lock = threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        boot_read, boot_write = os.pipe2(os.O_CLOEXEC)
        life_read, self.lifeline = os.pipe2(os.O_CLOEXEC)  # only this process holds the write end
        config = {"zygote": True, "socket_fd": theirs.fileno(), "lifeline_fd": life_read}
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", "-c", boot, str(boot_read), str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                env=sandbox_environment("/"),
                cwd="/",
                pass_fds=(boot_read, theirs.fileno(), life_read),
                start_new_session=True,
            )
        finally:
            theirs.close()
            os.close(boot_read)
            os.close(life_read)
        _send_startup(boot_write, [server_code, pickle.dumps(config)], 30)
        os.close(boot_write)
        self.socket = ours

    def spawn(self, request: Mapping[str, Any], fds: Sequence[int]) -> int:
        """Fork a REPL from the zygote; returns its supervisor's pid."""
        payload = pickle.dumps(dict(request), protocol=pickle.HIGHEST_PROTOCOL)
        with self.lock:
            self.socket.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            reply = self.socket.recv(4)
        if len(reply) != 4:
            raise SandboxError(f"The REPL zygote (pid {self.popen.pid}) stopped answering ({self.popen.poll()}).")
        return int.from_bytes(reply, "big")

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.popen.poll() is None

    def close(self) -> None:
        os.close(self.lifeline)
        self.socket.close()
        self.popen.wait(timeout=10)


_zygote_lock = threading.Lock()
_zygote: _Zygote | None = None


def _get_zygote(server_code: bytes, boot: str) -> _Zygote:
    global _zygote
    with _zygote_lock:
        if _zygote is None or not _zygote.alive():  # none yet, it died, or this is a forked copy of the trainer
            if _zygote is not None and _zygote.owner == os.getpid():
                logger.warning("The REPL zygote exited (%s); starting a new one", _zygote.popen.poll())
            _zygote = _Zygote(server_code, boot)
        return _zygote


class LocalBackend(SandboxBackend):
    """Sandboxed interpreters on this host: ``namespace=True`` adds Linux namespaces (no network unless asked,
    a root file system showing only the runtime, private /tmp, /dev/shm and /proc); both kinds get the
    supervisor, control groups where writable, rlimits, a private uid (root trainers), no_new_privs and the
    syscall filter (x86_64)."""

    def __init__(self, namespace: bool) -> None:
        self.namespace = namespace
        self.name = "namespace" if namespace else "process"

    def prepare(self, root_dir: str, lease: UidLease | None) -> str:
        if self.namespace:
            os.mkdir(os.path.join(root_dir, "rootfs"), 0o700)
            return NAMESPACE_HOME
        workdir = os.path.join(root_dir, "work")
        os.mkdir(workdir, 0o700)
        if lease is not None:
            os.chown(workdir, lease.uid, lease.gid)
        return workdir

    def start(self, spec: LaunchSpec) -> LocalProcess:
        host = host_support()
        limits, lease = spec.limits, spec.lease
        # RLIMIT_NPROC counts every task of the uid. A private uid has only the sandbox; a uid shared with the
        # trainer (non-root trainer, process backend) has all of the trainer's tasks too, which must stay allowed.
        zygote = _get_zygote(spec.server_code, spec.boot)
        shared_uid = lease is None and not self.namespace
        tasks = 2 if not shared_uid else count_tasks_of_uid(os.getuid()) + 2
        cgroups = ControlGroups(host.cgroup_dirs, limits) if host.cgroups is None else None
        config = {
            **spec.server_options,
            "trainer_pid": os.getpid(),
            "root_dir": spec.root_dir,
            "uid": lease.uid if lease is not None else None,
            "gid": lease.gid if lease is not None else None,
            "cgroups": dict(cgroups.paths) if cgroups is not None else {},
            "namespace": self.namespace,
            "user_namespace": self.namespace and not host.as_root,
            "network": limits.network,
            "rootfs": os.path.join(spec.root_dir, "rootfs"),
            "home": spec.home,
            "bind_paths": list(_runtime_paths()),
            "disk_mb": limits.disk_mb,
            "seccomp": host.seccomp is None,
            # Killing every other process of the sandbox is only safe with a private uid or PID namespace.
            "reap_strays": lease is not None or self.namespace,
            "import_paths": list(interpreter_import_paths()),
            "limits": {
                "RLIMIT_AS": limits.memory_mb * 2**20,
                "RLIMIT_CPU": max(1, math.ceil(limits.cpu_time_limit_s)),
                "RLIMIT_NPROC": tasks + limits.max_processes,
                "RLIMIT_FSIZE": limits.disk_mb * 2**20,
                "RLIMIT_NOFILE": limits.max_open_files,
                "RLIMIT_CORE": 0,
            },
        }
        cmd_read, cmd_write = os.pipe2(os.O_CLOEXEC)  # parent -> child
        evt_read, evt_write = os.pipe2(os.O_CLOEXEC)  # child -> parent
        life_read, life_write = os.pipe2(os.O_CLOEXEC)  # only this process holds the write end
        status_read, status_write = os.pipe2(os.O_CLOEXEC)  # the supervisor's report when it is done
        request = {
            "config": config,
            "env": dict(spec.env),
            "cwd": spec.root_dir if self.namespace else spec.home,
        }
        try:
            pid = zygote.spawn(request, [cmd_read, evt_write, life_read, status_write, spec.log_fd])
        except BaseException:
            for fd in (cmd_write, evt_read, life_write, status_read):
                os.close(fd)
            if cgroups is not None:
                cgroups.remove()
            raise
        finally:  # the child has its own copies of its ends
            for fd in (cmd_read, evt_write, life_read, status_write):
                os.close(fd)
        process = LocalProcess(pid, evt_read, cmd_write, life_write, status_read, cgroups, config["uid"])
        _send_startup(cmd_write, [spec.init_payload], spec.limits.startup_timeout_s)
        return process


def _send_startup(fd: int, parts: Sequence[bytes], timeout_s: float) -> None:
    """Write the length-prefixed startup messages; a child that dies or stalls is reported by the first read."""
    view = memoryview(b"".join(len(part).to_bytes(4, "big") + part for part in parts))
    deadline = time.monotonic() + timeout_s
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    blocking = os.get_blocking(fd)
    os.set_blocking(fd, False)
    try:
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                return
            if view:
                if time.monotonic() > deadline:
                    return
                poller.poll(100)
    finally:
        os.set_blocking(fd, blocking)


_backends = {"namespace": LocalBackend(namespace=True), "process": LocalBackend(namespace=False)}


def select_backend(limits: SandboxLimits) -> SandboxBackend:
    """The local backend `limits` resolves to on this host (`resolve_isolation`)."""
    return _backends[resolve_isolation(limits)]


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
