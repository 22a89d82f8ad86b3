"""What a REPL owns for its whole life, and where: its folder (`repl_parent_dir`), its log, its private uid, its
current interpreter (`Interpreter`), all freed at once by `Resources.release` (also run by a GC finalizer).

Threat model (docs/security.md, class 3): a uid goes back to the pool only when nothing of its last REPL remains
under it (processes, files in the directories the backend shares with the host); else it stays out of use until
the trainer exits.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import stat
import tempfile
import threading
from dataclasses import dataclass, field

from .repl_protocol import Wire
from .sandbox import (
    SandboxBackend,
    SandboxError,
    SandboxProcess,
    UidLease,
    force_rmtree,
    processes_of_uid,
    remove_files_of_uid,
)

logger = logging.getLogger(__name__)

__all__ = ["Folder", "Interpreter", "Resources", "make_folder", "repl_parent_dir", "traversable_by_others"]


@dataclass(frozen=True)
class Folder:
    """A REPL's private folder on the host: `root_dir` (removed at close), the sandbox's `home` in it as model code
    sees it (`SandboxBackend.prepare`), and `log_fd`, the sandbox's start-up log there (``stdio.log``)."""

    root_dir: str
    home: str
    log_fd: int


def make_folder(backend: SandboxBackend, lease: UidLease | None) -> Folder:
    """A new private folder for a REPL on `backend`, in its `SandboxBackend.folder_parent` or the temporary folder
    (mode 0711 under a private uid: traversable, not listable)."""
    parent = backend.folder_parent or (repl_parent_dir() if lease is not None else None)
    root_dir = tempfile.mkdtemp(prefix="trl_ext_repl_", dir=parent)
    try:
        if lease is not None:
            os.chmod(root_dir, 0o711)
        home = backend.prepare(root_dir, lease)
        log_fd = os.open(
            os.path.join(root_dir, "stdio.log"), os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
        )
    except BaseException:
        force_rmtree(root_dir)
        raise
    return Folder(root_dir, home, log_fd)


@dataclass
class Interpreter:
    """One sandboxed interpreter (a REPL replaces it after a timeout or crash)."""

    process: SandboxProcess
    wire: Wire
    ready: bool = False
    _kill_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _killed: bool = False
    _returncode: int | None = None

    def kill(self) -> int | None:
        """Kill everything of this interpreter (the backend waits until nothing is left); returns its status.

        Safe from any thread, any number of times: the first call kills, the others wait for it and return the
        same status (a cell that loses its interpreter and a `close` from another thread both call this).
        """
        with self._kill_lock:
            if not self._killed:
                self._killed = True
                try:
                    self._returncode = self.process.kill()
                finally:
                    self.wire.close()
            return self._returncode


@dataclass
class Resources:
    """Everything a REPL owns for its whole life; `release` frees it all (also run by a GC finalizer).

    `lock` orders the REPL's life against its end: `release` holds it while it frees everything, and an
    interpreter is started only under it, so none starts once the REPL is released. `loop_in_use`: a synchronous
    `execute` runs `loop` now, so `release` leaves closing it to that call.
    """

    root_dir: str
    home: str
    log_fd: int
    lease: UidLease | None
    shared_dirs: tuple[str, ...]  # host directories the backend shares with others (`SandboxBackend.shared_dirs`)
    interpreter: Interpreter | None = None
    loop: asyncio.AbstractEventLoop | None = None
    loop_in_use: bool = False
    released: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def replace_folder(self, folder: Folder) -> bool:
        """Move the REPL into `folder` (made by `make_folder`) and remove its old one, between interpreter lives;
        returns False, and removes `folder`, if the REPL was released meanwhile."""
        with self.lock:
            if self.released:
                old = folder
            else:
                old = Folder(self.root_dir, self.home, self.log_fd)
                self.root_dir, self.home, self.log_fd = folder.root_dir, folder.home, folder.log_fd
        os.close(old.log_fd)
        force_rmtree(old.root_dir)
        return old is not folder

    def release(self) -> None:
        with self.lock:
            if self.released:
                return
            self.released = True
            contained = False
            interpreter = self.interpreter  # a cell on another thread may drop it meanwhile: kill is idempotent
            if interpreter is not None:
                interpreter.kill()
                contained = interpreter.process.contained
                self.interpreter = None
            if self.lease is not None:
                self._release_uid(self.lease, contained)
            os.close(self.log_fd)
            self.log_fd = -1
            force_rmtree(self.root_dir)
            if self.loop is not None and not self.loop_in_use:
                self.loop.close()

    def _release_uid(self, lease: UidLease, contained: bool) -> None:
        """Hand the uid back only when nothing of this REPL remains under it (else keep it out of use)."""
        left = [] if contained else [f"process {pid}" for pid in processes_of_uid(lease.uid)]
        if self.shared_dirs:
            left += remove_files_of_uid(lease.uid, self.shared_dirs)
        if left:
            logger.warning(
                "Sandbox uid %d is not handed to another REPL: %s of its last REPL remain", lease.uid, left[:5]
            )
            return  # the lock stays held until this process exits
        lease.release()


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
