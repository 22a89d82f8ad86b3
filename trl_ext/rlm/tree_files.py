"""Where rollout trees are written: one naming scheme for the synchronous and the asynchronous trainer.

Trees go, one JSON line each (`RolloutTree.to_dict`), to ``<output_dir>/rlm_trees/<mode>-v<version>-<writer>.jsonl``:
``mode`` is ``train`` or ``eval``; ``version`` is the policy version the trees were sampled from (six digits): the
optimizer steps taken before sampling, which is the global step in `StepwiseRLMTrainer` and the published version in
`AsyncStepwiseRLMTrainer`; ``writer`` is who wrote the file: ``rank<k>`` (each process of the synchronous trainer) or
``run<NNNNNN>`` (each run of the asynchronous rollout worker, numbered past the folder's files so that a resumed run
never writes into an earlier run's file).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..jsonl import append_jsonl

__all__ = ["TREES_FOLDER", "TreeFile", "next_run", "save_trees", "tree_file"]

TREES_FOLDER = "rlm_trees"  # under output_dir
_NAME = re.compile(r"(?P<mode>train|eval)-v(?P<version>\d+)-(?P<writer>rank\d+|run\d+)\.jsonl")


@dataclass(frozen=True)
class TreeFile:
    """A tree file's name, read back: its mode, policy version and writer (``rank<k>`` or ``run<NNNNNN>``)."""

    mode: str
    version: int
    writer: str

    @classmethod
    def parse(cls, name: str) -> TreeFile | None:
        """The parts of a tree file's name; None for another file."""
        match = _NAME.fullmatch(name)
        return None if match is None else cls(match["mode"], int(match["version"]), match["writer"])

    @property
    def run(self) -> int | None:
        """The rollout worker's run number (None for a rank's file)."""
        return int(self.writer[3:]) if self.writer.startswith("run") else None


def tree_file(folder: str | os.PathLike[str], mode: str, version: int, writer: str) -> Path:
    """The file the trees of ``mode`` sampled from policy ``version`` by ``writer`` go to (module docstring)."""
    return Path(folder) / f"{mode}-v{version:06d}-{writer}.jsonl"


def save_trees(path: Path, trees: Sequence[Any], tokenizer: Any) -> int:
    """Append the trees to ``path`` (`trl_ext.jsonl.append_jsonl`: all or none); returns the line the first one is on.

    Raises:
        OSError: the file could not be written (the caller warns; training goes on).
    """
    return append_jsonl(path, [tree.to_dict(tokenizer) for tree in trees])


def next_run(folder: str | os.PathLike[str] | None) -> int:
    """The number after the highest rollout-worker run of the tree files in ``folder`` (0 for none, or no folder)."""
    if folder is None or not Path(folder).is_dir():
        return 0
    runs = [parsed.run for path in Path(folder).iterdir() if (parsed := TreeFile.parse(path.name)) is not None]
    return max((run for run in runs if run is not None), default=-1) + 1
