"""The process backend's disk budget: what a REPL's files take on the host's disk (`measure_home`), which
`PythonREPL` compares with ``disk_mb`` during and after every cell.

Threat model (docs/security.md, class 4): the namespace backend's home is a tmpfs of ``disk_mb`` (the kernel refuses
a write past it); the process backend's home is a folder on the host's disk, where ``RLIMIT_FSIZE`` caps each file
but not their sum (one REPL with ``disk_mb=32`` wrote 384 MB in 8 MB files). Without root or mounts there is no
quota to set, so the supervising side measures: the blocks of every file and folder beneath the home (a file with
several links counted once) and of every file the REPL's processes hold open after removing it (an unlinked file
still takes its blocks), stopping early once past the budget. The measurement runs outside the sandbox, so model
code can delay it only by making its home big or deep, which is what it stops on.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class DiskUsage:
    """What a REPL's files take: `bytes` (allocated blocks), `files` (files and folders beneath its home), and
    `complete`: False when the count stopped early, past a limit (the true figures are larger)."""

    bytes: int
    files: int
    complete: bool = True


def disk_file_limit(disk_mb: int) -> int:
    """The files and folders a REPL may keep for `disk_mb`: the namespace backend's tmpfs gets as many inodes."""
    return max(1024, disk_mb * 64)


def measure_home(home: str, pids: Iterable[int], max_bytes: int, max_files: int) -> DiskUsage:
    """The blocks taken beneath `home` and by the files `pids` hold open after removing them from it.

    Stops once past `max_bytes` or `max_files` (``complete=False``): the walk of a hostile home costs at most that
    many ``lstat`` calls. A folder the REPL made unreadable (``chmod 000``, under the trainer's own uid) is opened
    again after a ``chmod``; one nested too deep for a path (``ENAMETOOLONG``) counts as past the budget.
    """
    seen: set[tuple[int, int]] = set()  # files with several links: each counted once
    total = files = 0
    try:
        home_dev = os.lstat(home).st_dev
    except OSError:
        return DiskUsage(0, 0)
    stack = [home]
    while stack:
        folder = stack.pop()
        try:
            entries = _scandir(folder)
        except OSError as exc:
            if exc.errno == errno.ENAMETOOLONG:
                return DiskUsage(total, max_files + 1, complete=False)
            continue  # removed meanwhile
        with entries:  # read as it goes: a folder of a million entries is not listed past the limit
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                files += 1
                if stat.S_ISDIR(info.st_mode):
                    stack.append(entry.path)
                elif info.st_nlink > 1:
                    if (info.st_dev, info.st_ino) in seen:
                        continue
                    seen.add((info.st_dev, info.st_ino))
                total += info.st_blocks * 512
                if total > max_bytes or files > max_files:
                    return DiskUsage(total, files, complete=False)
    for pid in pids:
        try:
            descriptors = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone meanwhile
        for name in descriptors:
            try:
                info = os.stat(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            key = (info.st_dev, info.st_ino)
            if stat.S_ISREG(info.st_mode) and info.st_nlink == 0 and info.st_dev == home_dev and key not in seen:
                seen.add(key)
                total += info.st_blocks * 512
                if total > max_bytes:
                    return DiskUsage(total, files, complete=False)
    return DiskUsage(total, files)


def _scandir(folder: str) -> os._ScandirIterator[str]:
    try:
        return os.scandir(folder)
    except PermissionError:  # made unreadable by the REPL itself (a shared uid): the trainer owns it too
        os.chmod(folder, 0o700)
        return os.scandir(folder)
