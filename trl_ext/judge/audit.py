"""JSONL audit log of every judge verdict, so users can read what the judge said about each rollout.

One line per rollout: step, rank, row, hashes of the prompt and completion (SHA-256, hex, first 16 characters), the
verdict the judge was given, status, valid spans, dropped spans with their reasons, latency, requests and tool calls.
Never the API key, never the full prompt (the hash identifies it; the completion's spans carry their quotes).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterable
from typing import Any


def text_hash(text: str) -> str:
    """First 16 hex characters of the SHA-256 of ``text`` (UTF-8)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class JudgeAuditLog:
    """Appends JSON records to ``path`` (one per line); thread-safe; creates the folder.

    Args:
        path: the ``.jsonl`` file, e.g. ``<output_dir>/judge_audit.jsonl``.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self._lock = threading.Lock()

    def write(self, records: Iterable[dict[str, Any]]) -> None:
        lines = [json.dumps(record, ensure_ascii=False, default=str) for record in records]
        if not lines:
            return
        with self._lock:
            folder = os.path.dirname(self.path)
            if folder:
                os.makedirs(folder, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write("\n".join(lines) + "\n")

    def read(self) -> list[dict[str, Any]]:
        """All records written so far (for tests and notebooks)."""
        if not os.path.exists(self.path):
            return []
        with open(self.path, encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]
