"""JSONL audit log of every judge verdict, so users can read what the judge said about each rollout.

One line per rollout: step, rank, row, hashes of the prompt and completion (SHA-256, hex, first 16 characters), the
verdict the judge was given, status, valid spans, dropped spans with their reasons, latency, requests and tool calls.
Never the API key, never the full prompt (the hash identifies it; the completion's spans carry their quotes).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from typing import Any

from ..jsonl import append_jsonl, read_jsonl


def audit_record(
    *,
    step: int,
    mode: str,
    rank: int,
    row: int,
    prompt_hash: str,
    trace: Any,
    verdict_given: str,
    judge_model: str,
    verdict: Any,
    **extra: Any,
) -> dict[str, Any]:
    """One line of the audit log, the one layout both judge-credit trainers write: where the rollout was (``step``,
    ``mode``, ``rank``, ``row``, and ``extra`` such as the asynchronous trainer's ``model_version`` and
    ``group_id``), its prompt's hash, its marked ``trace``'s hash and token count, the verdict the judge was given,
    the judge model, then the verdict's own record (`JudgeVerdict.to_record`)."""
    return {
        "step": step,
        "mode": mode,
        "rank": rank,
        "row": row,
        **extra,
        "prompt_hash": prompt_hash,
        "completion_hash": text_hash(trace.text),
        "num_tokens": trace.num_tokens,
        "verdict_given": verdict_given,
        "judge_model": judge_model,
        **verdict.to_record(),
    }


def text_hash(text: str) -> str:
    """First 16 hex characters of the SHA-256 of ``text`` (UTF-8)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class JudgeAuditLog:
    """Appends JSON records to ``path`` (one per line); thread-safe; creates the folder; a failed write leaves the
    file valid JSON lines (`trl_ext.jsonl`).

    Args:
        path: the ``.jsonl`` file, e.g. ``<output_dir>/judge_audit.jsonl``.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)

    def write(self, records: Iterable[dict[str, Any]]) -> None:
        """Append ``records``, all or none (`trl_ext.jsonl.append_jsonl`: a torn line left by an earlier failed
        write is cut away first).

        Raises:
            OSError: the write failed (e.g. disk full); the log holds exactly its records before the call.
        """
        records = list(records)
        if records:
            append_jsonl(self.path, records)  # locks per file: threads may share the log

    def read(self) -> list[dict[str, Any]]:
        """All records written so far (for tests and notebooks); a torn line is skipped with a warning."""
        return read_jsonl(self.path)
