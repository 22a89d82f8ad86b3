"""The local backend: sandboxed interpreters on this host, forked from one zygote per trainer process, each under a
supervisor (`LocalBackend`, `LocalProcess`), and the choice between its two kinds (`select_backend`).

Threat model (docs/security.md, "How it is built"): ``namespace=True`` adds Linux namespaces (no network unless
asked, a root file system showing only the runtime, private /tmp, /dev/shm and /proc); both kinds get the
supervisor (it kills everything of the sandbox when the trainer closes the REPL or dies), control groups where
writable, rlimits, a private uid (root trainers), no_new_privs and the syscall filter (x86_64). The code that runs
inside is `trl_ext.rlm.sandbox.child`.
"""

from __future__ import annotations

import array
import logging
import math
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .backend import LaunchSpec, SandboxBackend, SandboxProcess
from .cgroups import ControlGroups
from .child import BOOT, server_code
from .disk import DiskUsage, measure_home
from .host import host_support, memory_folder, resolve_isolation
from .identity import SHARED_WRITABLE_DIRS, UidLease, count_tasks_of_uid, kill_uid, processes_of_uid
from .limits import SandboxError, SandboxLimits, sandbox_environment
from .runtime import NAMESPACE_HOME, interpreter_import_paths, readable_roots, runtime_paths

logger = logging.getLogger(__name__)


class LocalProcess(SandboxProcess):
    """An interpreter under its supervisor (see `trl_ext.rlm.sandbox.child.supervisor`) on this host.

    Freezing stops every process of the sandbox, the server included, whatever it runs (docs/security.md, class 4):
    with control groups, the cgroup freezer; without them, SIGSTOP to the server (through a pidfd) and to its
    process group. The supervisor reports on the status pipe its own pid (4 bytes, read by `LocalBackend.start`),
    the server's pid (4 bytes, right after the fork), then the server's wait status (4 bytes, when it is done).

    `kill` may come from another thread while a cell freezes or thaws the sandbox: `_lock` orders the two, and
    once killed, freezing and thawing do nothing (its control groups are gone).
    """

    def __init__(
        self,
        pid: int,
        read_fd: int,
        write_fd: int,
        lifeline: int,
        status: int,
        cgroups: ControlGroups | None,
        uid: int | None,
        disk_home: str | None = None,
    ) -> None:
        self.pid, self.read_fd, self.write_fd = pid, read_fd, write_fd
        self._disk_home = disk_home  # the process backend's home on the host's disk (`disk_usage`); None: a tmpfs
        self._lifeline, self._status, self._cgroups, self._uid = lifeline, status, cgroups, uid
        try:  # to wait for the supervisor's exit, although it is the zygote's child, not ours
            self._pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = -1
        self._oom = False
        self._frozen = False
        self._server_pid: int | None = None  # read from the status pipe when first needed
        self._server_pidfd = -1
        self._lock = threading.Lock()
        self._killed = False

    def freeze(self) -> None:
        # Always, even when the server is the REPL's only task: its one thread waits on its pipe, but a signal
        # handler of model code (a timer's) runs in that thread whenever the signal interrupts the wait.
        with self._lock:
            if not self._killed:
                if self._cgroups is not None:
                    self._cgroups.freeze()
                else:
                    self._signal_server(signal.SIGSTOP)
                self._frozen = True

    def thaw(self) -> None:
        with self._lock:
            if self._frozen and not self._killed:
                if self._cgroups is not None:
                    self._cgroups.thaw()
                else:
                    self._signal_server(signal.SIGCONT)
                self._frozen = False

    def _signal_server(self, signum: int) -> None:
        """Send `signum` to the server's process group (what the cell started and left in it) and to the server
        itself, through a pidfd (model code may have moved the server to another group; a pid may be reused)."""
        if self._server_pid is None:
            report = self._read_report(4, timeout_s=10)
            if report is None:
                return  # the supervisor is gone: so is the sandbox
            self._server_pid = int.from_bytes(report, "big")
            try:
                self._server_pidfd = os.pidfd_open(self._server_pid)
            except (AttributeError, OSError):
                self._server_pidfd = -1
        try:
            os.killpg(self._server_pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
        if self._server_pidfd >= 0:
            try:
                signal.pidfd_send_signal(self._server_pidfd, signum)
            except ProcessLookupError:
                pass

    def out_of_memory(self) -> bool:
        return self._oom or (self._cgroups is not None and self._cgroups.out_of_memory())

    def memory_peak_bytes(self) -> int | None:
        return self._cgroups.memory_peak_bytes() if self._cgroups is not None else None

    @property
    def measures_disk(self) -> bool:
        return self._disk_home is not None

    def disk_usage(self, max_bytes: int, max_files: int) -> DiskUsage | None:
        """The process backend: the blocks of its home on the host's disk and of the files its processes hold open
        after removing them (`measure_home`); the namespace backend's tmpfs bounds itself (None)."""
        if self._disk_home is None:
            return None
        return measure_home(self._disk_home, self._processes(), max_bytes, max_files)

    def _processes(self) -> list[int]:
        """The sandbox's processes: its control groups' members, else its private uid's, else its server."""
        if self._cgroups is not None:
            return sorted(self._cgroups.pids(("pids",)))
        if self._uid is not None:
            return processes_of_uid(self._uid)
        return [self._server_pid] if self._server_pid is not None else []

    def kill(self) -> int | None:
        with self._lock:  # after a freeze or thaw in progress; none starts from now on
            self._killed = True
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
        if self._server_pidfd >= 0:
            os.close(self._server_pidfd)
            self._server_pidfd = -1
        if self._cgroups is not None:  # no process can leave its control groups: they hold all of the sandbox
            self._oom = self._cgroups.out_of_memory()
            self._cgroups.kill()
            self._cgroups.remove()
        elif self._uid is not None:
            kill_uid(self._uid)
        return returncode

    def _read_status(self, timeout_s: float) -> int | None:
        """The server's exit status as the supervisor reports it when it is done (None: no report in time)."""
        deadline = time.monotonic() + timeout_s
        if self._server_pid is None and self._read_report(4, timeout_s) is None:  # the pid comes first
            data = None
        else:
            data = self._read_report(4, max(0.0, deadline - time.monotonic()))
        if self._status >= 0:
            os.close(self._status)
            self._status = -1
        return os.waitstatus_to_exitcode(int.from_bytes(data, "big")) if data is not None else None

    def _read_report(self, size: int, timeout_s: float) -> bytes | None:
        """The next `size` bytes of the supervisor's report (None: the pipe ended or stayed silent `timeout_s`)."""
        return _read_exactly(self._status, size, timeout_s) if self._status >= 0 else None

    @property
    def contained(self) -> bool:
        """Everything this interpreter started was in its control groups (now empty and removed)."""
        return self._cgroups is not None and not self._cgroups.paths


def _read_exactly(fd: int, size: int, timeout_s: float) -> bytes | None:
    """The next `size` bytes of `fd` (None: end of file, or silence for `timeout_s`)."""
    data = b""
    deadline = time.monotonic() + timeout_s
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while len(data) < size and poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
        chunk = os.read(fd, size - len(data))
        if not chunk:
            break
        data += chunk
    return data if len(data) == size else None


def _poll_one(fd: int, timeout_s: float) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


class _Zygote:
    """One pre-started interpreter per trainer process that forks the supervisors of new REPLs (see
    `trl_ext.rlm.sandbox.child.zygote`): a fork of a loaded interpreter instead of a new one per REPL."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.lock = threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        boot_read, boot_write = os.pipe2(os.O_CLOEXEC)
        life_read, self.lifeline = os.pipe2(os.O_CLOEXEC)  # only this process holds the write end
        config = {"zygote": True, "socket_fd": theirs.fileno(), "lifeline_fd": life_read}
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", "-c", BOOT, str(boot_read), str(theirs.fileno())],
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
        _send_startup(boot_write, [server_code(), pickle.dumps(config)], 30)
        os.close(boot_write)
        self.socket = ours

    def spawn(self, request: Mapping[str, Any], fds: Sequence[int]) -> None:
        """Ask the zygote to fork a REPL with `fds`; the child reports its pid on its status pipe. No reply is
        awaited, so concurrent starts follow one another through the zygote without a round trip each."""
        payload = pickle.dumps(dict(request), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self.lock:
                self.socket.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except OSError as error:
            raise SandboxError(
                f"The REPL zygote (pid {self.popen.pid}) is gone ({self.popen.poll()}): {error}"
            ) from None

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.popen.poll() is None

    def close(self) -> None:
        os.close(self.lifeline)
        self.socket.close()
        self.popen.wait(timeout=10)


_zygote_lock = threading.Lock()
_zygote: _Zygote | None = None


def _get_zygote() -> _Zygote:
    global _zygote
    with _zygote_lock:
        if _zygote is None or not _zygote.alive():  # none yet, it died, or this is a forked copy of the trainer
            if _zygote is not None and _zygote.owner == os.getpid():
                logger.warning("The REPL zygote exited (%s); starting a new one", _zygote.popen.poll())
            _zygote = _Zygote()
        return _zygote


class LocalBackend(SandboxBackend):
    """Sandboxed interpreters on this host: ``namespace=True`` adds Linux namespaces (no network unless asked,
    a root file system showing only the runtime, private /tmp, /dev/shm and /proc); both kinds get the
    supervisor, control groups where writable, rlimits, a private uid (root trainers), no_new_privs and the
    syscall filter (x86_64)."""

    def __init__(self, namespace: bool) -> None:
        self.namespace = namespace
        self.name = "namespace" if namespace else "process"
        # Namespaced REPLs have /tmp and /dev/shm of their own; the process backend shares the host's.
        self.shared_dirs = () if namespace else SHARED_WRITABLE_DIRS

    @property
    def folder_parent(self) -> str | None:
        """A namespaced REPL's folder holds only its root's mount point and its start-up log: on a tmpfs
        (`memory_folder`) where there is one. The process backend's holds the REPL's home, its files on disk."""
        return memory_folder() if self.namespace else None

    def environment(self, home: str, extra: Mapping[str, str] | None) -> dict[str, str]:
        env = sandbox_environment(home, extra)
        if self.namespace:
            env["TMPDIR"] = "/tmp"  # the REPL's own tmpfs
        return env

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
        zygote = _get_zygote()
        shared_uid = lease is None and not self.namespace
        tasks = 2 if not shared_uid else count_tasks_of_uid(os.getuid()) + 2
        cgroups = ControlGroups(host.cgroup_dirs, limits) if host.cgroups is None else None
        config = {
            "max_output_chars": limits.max_output_chars,
            "max_answer_chars": limits.max_answer_chars,
            "trainer_pid": os.getpid(),
            "root_dir": spec.root_dir,
            "uid": lease.uid if lease is not None else None,
            "gid": lease.gid if lease is not None else None,
            "cgroups": dict(cgroups.paths) if cgroups is not None else {},
            "namespace": self.namespace,
            # The process backend where the host allows it: SysV IPC and ptys of its own (docs/security.md, class 8).
            "private_ipc_and_ptys": not self.namespace and host.namespaces is None and host.as_root,
            "user_namespace": self.namespace and not host.as_root,
            "network": limits.network,
            "rootfs": os.path.join(spec.root_dir, "rootfs"),
            "home": spec.home,
            "bind_paths": list(runtime_paths()),
            "disk_mb": limits.disk_mb,
            "seccomp": host.seccomp is None,
            # The process backend shares the host's file system and network: Landlock keeps its writes in its home,
            # its reads there and beneath the runtime's roots, TCP away unless limits.network, and its signals and
            # abstract sockets inside it (docs/security.md).
            "landlock": not self.namespace and host.landlock_abi > 0,
            "read_roots": list(readable_roots()),  # and its home: nothing else to read (output_dir, checkout)
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
            zygote.spawn(request, [cmd_read, evt_write, life_read, status_write, spec.log_fd])
            _send_startup(cmd_write, [spec.init_payload], spec.limits.startup_timeout_s)
            report = _read_exactly(status_read, 4, spec.limits.startup_timeout_s)  # the supervisor's pid
            if report is None:
                raise SandboxError(
                    f"The REPL zygote (pid {zygote.popen.pid}, {zygote.popen.poll() or 'running'}) did not start a "
                    f"REPL within startup_timeout_s={spec.limits.startup_timeout_s:g} s."
                )
        except BaseException:
            for fd in (cmd_write, evt_read, life_write, status_read):  # a child already forked ends with its lifeline
                os.close(fd)
            if cgroups is not None:
                cgroups.remove()
            raise
        finally:  # the child has its own copies of its ends
            for fd in (cmd_read, evt_write, life_read, status_write):
                os.close(fd)
        pid = int.from_bytes(report, "big")
        disk_home = None if self.namespace else spec.home  # a namespaced REPL's home is a tmpfs of disk_mb
        return LocalProcess(pid, evt_read, cmd_write, life_write, status_read, cgroups, config["uid"], disk_home)


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
