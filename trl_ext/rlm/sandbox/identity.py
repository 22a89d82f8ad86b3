"""Who a sandboxed interpreter runs as, and what that uid leaves behind: leases of private uids, ``/proc`` scans of
a uid's processes, and killing them and removing their files.

Threat model (docs/security.md, classes 3 and 7): when the trainer runs as root, every REPL gets its own
unprivileged uid/gid from `DEFAULT_SANDBOX_UIDS`, leased with an ``flock`` so concurrent trainers on one host never
share one. A private uid is what makes the other limits real: root ignores ``RLIMIT_NPROC`` and may raise any
limit, read ``/proc/<trainer pid>/environ`` and the trainer's files, and signal the trainer. Under a private uid
the sandbox can do none of that, and ``kill(-1)`` from inside reaches exactly the sandbox's own processes. A uid
goes back to the pool only once nothing of its last REPL remains (processes, files in shared directories). A
non-root trainer cannot switch uid: its REPLs share the trainer's uid (weaker: see the docs page).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .limits import DEFAULT_SANDBOX_UIDS, SandboxError

logger = logging.getLogger(__name__)

# Host directories every uid may write to: what a process-backend REPL leaves there is deleted at its close.
SHARED_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")


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
