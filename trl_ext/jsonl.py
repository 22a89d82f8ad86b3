"""Append-only JSON-lines files that stay valid after any failed write, and JSON files replaced atomically.

trl-ext keeps its logs as JSON lines (one JSON object a line): the judge audit log (``judge_audit.jsonl``) and the
rollout trees (``rlm_trees/<mode>-v<NNNNNN>-<writer>.jsonl``, `trl_ext.rlm.tree_files`). A write that fails halfway
(disk full, file too large, a process killed) must never leave them unreadable. The contract:

* `append_jsonl` writes every record of a call or none: on an ``OSError`` it truncates the file back to its size
  before the write and re-raises the error with a message naming the file (and, when the disk is full, the fix).
  Before appending it cuts away a torn last line left by an earlier crash (with a warning), so a record is never
  glued onto a fragment.
* `read_jsonl` skips lines it cannot read (with one warning) instead of raising, and reads a missing file as ``[]``.
* `written_after` tells which records a resumed run writes again (those of the steps after its checkpoint), so a
  trainer cuts them away with `rewrite_jsonl` first.
* `rewrite_jsonl` and `write_json_atomic` write a temporary file in the same folder, fsync it and ``os.replace`` it
  over the target: a reader sees the old file or the new one, never a mix; a failed write leaves the old one.

The functions lock per path, so threads of one process may share a file. Processes must not: each rank writes its
own file.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["append_jsonl", "read_jsonl", "rewrite_jsonl", "write_json_atomic", "written_after"]

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()
# path -> ((inode, size, mtime_ns) after our last append, lines then): spares recounting a long log on every append.
_line_counts: dict[str, tuple[tuple[int, int, int], int]] = {}


def append_jsonl(path: str | os.PathLike[str], records: Iterable[dict[str, Any]], *, fsync: bool = True) -> int:
    """Append ``records`` to the JSON-lines file ``path``, one line each, all of them or none.

    Creates the folder and the file. A torn last line (no final newline: an earlier write failed or was killed) is
    cut away first, with a warning naming the file and the bytes dropped. Values JSON cannot hold are written as
    strings.

    Args:
        path: the ``.jsonl`` file.
        records: JSON objects to append.
        fsync: flush the file to the disk before returning (errors some file systems report only then roll back too).

    Returns:
        The 0-based line index of the first appended record (the number of lines before it), so record ``i`` of
        ``records`` is line ``start + i`` of the file.

    Raises:
        OSError: the write failed (same errno, e.g. ``ENOSPC``); the file holds exactly its lines before the call.
    """
    lines = [json.dumps(record, ensure_ascii=False, default=str) for record in records]
    data, count = "".join(line + "\n" for line in lines).encode("utf-8"), len(lines)
    path = Path(path)
    with _lock_for(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+b", buffering=0) as handle:
            size = _drop_torn_tail(handle, path)
            start = _count_lines(handle, path)
            try:
                _write_all(handle, data)
                if fsync:
                    os.fsync(handle.fileno())
            except OSError as error:
                _roll_back(handle, size, path)
                action = f"append {count} record(s) to"
                raise _write_error(error, path, action, "rolled back to its last complete record") from error
            _line_counts[_key(path)] = (_signature(os.fstat(handle.fileno())), start + count)
    return start


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The JSON objects of the JSON-lines file ``path``, in order; ``[]`` when the file does not exist.

    Lines that are not JSON objects (a record torn by a failed write, stray text) are skipped, with one warning
    giving their count and 1-based line numbers; blank lines are ignored.
    """
    path = Path(path)
    with _lock_for(path):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return []
    return [record for _, record in _parse(data, path)]


def rewrite_jsonl(path: str | os.PathLike[str], keep: Callable[[dict[str, Any]], bool]) -> int:
    """Keep only the records of the JSON-lines file ``path`` for which ``keep(record)`` is true, atomically.

    Kept lines are copied byte for byte; unreadable lines (see `read_jsonl`) are dropped as well. A missing file is
    left missing.

    Returns:
        How many readable records were dropped.

    Raises:
        OSError: the new file could not be written; the old one is left as it was.
    """
    path = Path(path)
    with _lock_for(path):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return 0
        lines = _parse(data, path)
        kept = b"".join(line + b"\n" for line, record in lines if keep(record))
        if kept == data:
            return 0  # nothing to drop, nothing unreadable: leave the file alone
        _replace(path, kept)
        _line_counts.pop(_key(path), None)
    return len(lines) - kept.count(b"\n")


def write_json_atomic(path: str | os.PathLike[str], content: Any) -> Path:
    """Write the JSON file ``path`` atomically: a failed write leaves the previous file (if any) intact.

    Args:
        path: the file; its folder must exist.
        content: JSON text (a ``str``, written as is) or a JSON-able object (written indented; values JSON cannot
            hold, such as paths, as strings).

    Returns:
        ``path`` as a `Path`.

    Raises:
        OSError: the file could not be written; the previous one is left as it was.
    """
    path = Path(path)
    text = content if isinstance(content, str) else json.dumps(content, indent=2, default=str) + "\n"
    with _lock_for(path):
        _replace(path, text.encode("utf-8"))
    return path


# ----------------------------------------------------------------------------------------------------- helpers
def written_after(mode: str, record_step: int, start_step: int) -> bool:
    """Whether a record written at global step ``record_step`` in ``mode`` comes after a checkpoint at ``start_step``.

    A training batch for step g+1 is generated (and its records written) while the global step is still g, so the
    training records of steps >= ``start_step`` are redone after resuming; evaluation at step S runs before
    checkpoint-S is saved, so only evaluation records of steps > ``start_step`` are.
    """
    return record_step >= start_step if mode == "train" else record_step > start_step


def _key(path: Path) -> str:
    return os.path.abspath(path)


def _lock_for(path: Path) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(_key(path), threading.Lock())


def _signature(stat: os.stat_result) -> tuple[int, int, int]:
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _drop_torn_tail(handle: io.FileIO, path: Path) -> int:
    """Cut the file after its last newline when it does not end with one; returns the (new) size."""
    size = handle.seek(0, os.SEEK_END)
    if size == 0 or _read_at(handle, size - 1, 1) == b"\n":
        return size
    end = size
    while end > 0:
        start = max(0, end - _CHUNK)
        newline = _read_at(handle, start, end - start).rfind(b"\n")
        if newline >= 0:
            end = start + newline + 1
            break
        end = start
    handle.truncate(end)
    logger.warning(
        "%s ended with an incomplete record (a write that failed or was killed); dropped its last %d byte(s) "
        "before appending.",
        path,
        size - end,
    )
    return end


def _count_lines(handle: io.FileIO, path: Path) -> int:
    cached = _line_counts.get(_key(path))
    if cached is not None and cached[0] == _signature(os.fstat(handle.fileno())):
        return cached[1]
    handle.seek(0)
    count = 0
    while chunk := handle.read(_CHUNK):
        count += chunk.count(b"\n")
    return count


def _read_at(handle: io.FileIO, offset: int, length: int) -> bytes:
    handle.seek(offset)
    return handle.read(length)


def _write_all(handle: io.FileIO, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[handle.write(view) :]


def _roll_back(handle: io.FileIO, size: int, path: Path) -> None:
    try:
        handle.truncate(size)
    except OSError as error:  # the next append cuts the torn line away
        logger.warning("Could not roll %s back to %d bytes after a failed write: %s", path, size, error)


def _replace(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file next to ``path``, fsync it and rename it over ``path``."""
    temporary = None
    try:
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with open(descriptor, "wb", buffering=0) as handle:
            _write_all(handle, data)
            os.fsync(handle.fileno())
        os.chmod(temporary, path.stat().st_mode & 0o7777 if path.exists() else 0o644)
        os.replace(temporary, path)
    except BaseException as error:
        if temporary is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
        if isinstance(error, OSError):
            raise _write_error(error, path, "write", "left as it was") from error
        raise


def _parse(data: bytes, path: Path) -> list[tuple[bytes, dict[str, Any]]]:
    """``(line, record)`` for every line of ``data`` that is a JSON object; one warning for the others."""
    parsed, unreadable = [], []
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except ValueError:  # json.JSONDecodeError and UnicodeDecodeError
            record = None
        if isinstance(record, dict):
            parsed.append((line, record))
        else:
            unreadable.append(number)
    if unreadable:
        shown = ", ".join(map(str, unreadable[:10])) + (", ..." if len(unreadable) > 10 else "")
        logger.warning(
            "Skipped %d unreadable line(s) of %s (line %s, 1-based): a record torn by a failed write, or not a JSON "
            "object.",
            len(unreadable),
            path,
            shown,
        )
    return parsed


def _write_error(error: OSError, path: Path, action: str, outcome: str) -> OSError:
    """The ``OSError`` to raise for a failed write: same errno, a message naming the file, what was kept, the fix."""
    if error.errno == errno.ENOSPC:
        reason = "disk full (ENOSPC); free space on that disk (or write elsewhere) and retry"
    elif error.errno in (errno.EFBIG, errno.EDQUOT):
        reason = f"{error.strerror} (file size or disk quota limit); free space or raise the limit and retry"
    else:
        reason = error.strerror or str(error)
    return OSError(error.errno, f"Could not {action} {path}: {reason}. The file was {outcome}.")
