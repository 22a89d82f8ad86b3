"""Which checkpoints a run can resume from, and a name for a full disk while one is saved.

A job killed while it writes ``checkpoint-N`` (``kill -9``, a preempted node, an out-of-memory kill) leaves a
folder that transformers' `get_last_checkpoint` still picks as the latest (it takes the highest number), and the
resumed run then fails on it. This module tells complete checkpoints from incomplete ones.

The contract (transformers 5.24's ``Trainer._save_checkpoint``, called through ``trl.GRPOTrainer``'s): the model
weights are written first, then the optimizer, scheduler, scaler and RNG states, then, by the main process and
*last*, ``trainer_state.json``. So a checkpoint is complete when

1. ``trainer_state.json`` exists and is valid JSON (a kill while it was written leaves it truncated);
2. its ``global_step`` is the folder's number (``checkpoint-N`` holds step N);
3. the model weights are there: ``model.safetensors``, ``adapter_model.safetensors``, ``pytorch_model.bin``,
   ``adapter_model.bin``, a sharded index (with every shard it lists), an FSDP or DeepSpeed model, or adapters in
   sub-folders (what ``Trainer._load_from_checkpoint`` accepts);
4. the ``required_files`` the caller names exist and, for ``.json`` files, parse. TRL writes one file *after*
   ``trainer_state.json``: ``entropy_ctrl_state.json`` under ``use_adaptive_entropy``; `required_checkpoint_files`
   names it from a config.

Not checked: the other ranks' ``rng_state_<rank>.pth`` (a checkpoint does not record the world size) and the
integrity of files written before ``trainer_state.json`` (the order above vouches for them).

Saving over an existing ``checkpoint-N`` (a run resumed from an earlier checkpoint) would leave the old
``trainer_state.json`` beside half-written new files: `trl_ext.trainers.trl_seam.TRLSeam._save_checkpoint` removes
it before it saves, so the contract holds there too.

`checkpoint_problem` says why one folder is incomplete (`checkpoint_step`: the step a complete one resumes at);
`resolve_resume_checkpoint` turns a ``resume_from_checkpoint`` argument into the checkpoint to load, skipping
incomplete ones with a warning; `name_disk_full` turns the error of a save that failed on a full disk (torch's zip
writer raises a RuntimeError without errno, "[enforce fail at inline_container.cc:...] unexpected pos ..." or
"PytorchStreamWriter failed writing file ...", safetensors a ``SafetensorError``) into an ``OSError(ENOSPC)`` that
says so (`TRLSeam._save_checkpoint` raises it).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "DISK_FULL_FREE_BYTES",
    "checkpoint_problem",
    "checkpoint_step",
    "complete_checkpoints",
    "name_disk_full",
    "required_checkpoint_files",
    "resolve_resume_checkpoint",
]

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")  # transformers.trainer_utils._re_checkpoint
WEIGHT_FILES = (
    "model.safetensors",
    "adapter_model.safetensors",
    "pytorch_model.bin",
    "adapter_model.bin",
)
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
WEIGHT_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# A save that fails while the filesystem has less than this free is taken for a full disk: a write that ran out of
# space leaves at most a few blocks free, and a disk this full cannot hold a checkpoint anyway.
DISK_FULL_FREE_BYTES = 1 << 20
_DISK_FULL_MESSAGE = "disk full while saving"
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# What libraries that wrap the OS error in their own exception keep of it (safetensors 0.8: "Error while serializing:
# I/O error: No space left on device (os error 28)"; older: "IoError(Os { code: 28, kind: StorageFull, ... })").
_DISK_FULL_TEXTS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), "StorageFull", "QuotaExceeded")


def checkpoint_problem(path: str | os.PathLike[str], required_files: Sequence[str] = ()) -> str | None:
    """Why the checkpoint folder ``path`` cannot be resumed from, or None when it is complete.

    Args:
        path: a checkpoint folder, e.g. ``output_dir/checkpoint-40``.
        required_files: files the run also needs in it (see `required_checkpoint_files`).

    Returns:
        One sentence naming the missing or broken file, e.g. ``"trainer_state.json is missing (written last: the
        save did not finish)"``; None for a complete checkpoint (see the module docstring for what is checked).
    """
    folder = Path(path)
    if not folder.is_dir():
        return f"{folder} is not a directory"
    state_file = folder / TRAINER_STATE
    if not state_file.is_file():
        return f"{TRAINER_STATE} is missing (written last: the save did not finish)"
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return f"{TRAINER_STATE} is not valid JSON ({error}; truncated: the save did not finish)"
    if not isinstance(state, dict):
        return f"{TRAINER_STATE} holds no trainer state (a JSON {type(state).__name__})"
    match = CHECKPOINT_NAME.match(folder.name)
    if match is not None and state.get("global_step") != int(match.group(1)):
        return (
            f"{TRAINER_STATE} is of global_step {state.get('global_step')!r}, not {match.group(1)} "
            f"(left from another save)"
        )
    problem = _weights_problem(folder)
    if problem is not None:
        return problem
    for name in required_files:
        problem = _file_problem(folder / name)
        if problem is not None:
            return problem
    return None


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """The ``global_step`` in the ``trainer_state.json`` of the checkpoint folder ``path`` (the step it resumes at)."""
    return int(json.loads((Path(path) / TRAINER_STATE).read_text(encoding="utf-8"))["global_step"])


def _weights_problem(folder: Path) -> str | None:
    """Why ``folder`` holds no loadable model weights, or None (the files ``Trainer._load_from_checkpoint`` takes)."""
    if any((folder / name).is_file() for name in WEIGHT_FILES):
        return None
    for name in WEIGHT_INDEX_FILES:
        index = folder / name
        if index.is_file():
            try:
                shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as error:
                return f"{name} is not a valid weight index ({error!r})"
            missing = sorted(shard for shard in shards if not (folder / shard).is_file())
            return f"the weight shards {missing} listed in {name} are missing" if missing else None
    for child in folder.iterdir():
        if child.name.startswith("pytorch_model_fsdp"):  # FSDP: a sharded state-dict folder or a full-state file
            return None
        if child.is_dir() and child.name.startswith("global_step"):  # DeepSpeed's engine checkpoint
            return None
        if child.is_dir() and any((child / name).is_file() for name in ADAPTER_FILES):  # one adapter per folder
            return None
    return f"the model weights are missing (none of {', '.join(WEIGHT_FILES)} or a sharded index)"


def _file_problem(path: Path) -> str | None:
    if not path.is_file():
        return f"{path.name} is missing"
    if path.suffix == ".json":
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as error:
            return f"{path.name} is not valid JSON ({error})"
    return None


def required_checkpoint_files(args: Any) -> tuple[str, ...]:
    """The files a run with the trainer config ``args`` needs in a checkpoint besides transformers' (see
    `checkpoint_problem`): ``entropy_ctrl_state.json`` under TRL's ``use_adaptive_entropy``."""
    return ("entropy_ctrl_state.json",) if getattr(args, "use_adaptive_entropy", False) else ()


def _numbered_checkpoints(folder: str | os.PathLike[str]) -> list[Path]:
    """The ``checkpoint-N`` folders in ``folder``, latest (highest N) first."""
    found = []
    for name in os.listdir(folder):  # a missing folder raises, as in transformers' get_last_checkpoint
        match = CHECKPOINT_NAME.match(name)
        if match is not None and os.path.isdir(os.path.join(folder, name)):
            found.append((int(match.group(1)), Path(folder) / name))
    return [path for _, path in sorted(found, reverse=True)]


def complete_checkpoints(
    output_dir: str | os.PathLike[str], required_files: Sequence[str] = ()
) -> list[tuple[Path, str | None]]:
    """Every ``checkpoint-N`` of ``output_dir``, latest first, with its `checkpoint_problem` (None: complete)."""
    return [(path, checkpoint_problem(path, required_files)) for path in _numbered_checkpoints(output_dir)]


def resolve_resume_checkpoint(
    resume_from_checkpoint: str | os.PathLike[str] | bool | None,
    output_dir: str | os.PathLike[str],
    required_files: Sequence[str] = (),
) -> str | None:
    """The checkpoint to resume from, for ``Trainer.train``'s ``resume_from_checkpoint`` argument.

    Args:
        resume_from_checkpoint: None or False: no resume. True: the latest *complete* ``checkpoint-N`` of
            ``output_dir``; the incomplete ones after it are skipped, each named with its problem in a warning. A
            path: that checkpoint, which must be complete.
        output_dir: the run's ``args.output_dir``.
        required_files: files the run needs in a checkpoint besides transformers' (`required_checkpoint_files`).

    Returns:
        The checkpoint's path, or None for no resume.

    Raises:
        ValueError: True and ``output_dir`` has no checkpoint (transformers' own error: "No valid checkpoint found
            in output directory (...)") or only incomplete ones (named, with the fix); a path that does not exist
            (said so, with the checkpoints found in ``output_dir``); a path that is incomplete (named with its
            problem and the complete checkpoints next to it).
        FileNotFoundError: True and ``output_dir`` does not exist (as transformers).
    """
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        checked = complete_checkpoints(output_dir, required_files)
        if not checked:
            raise ValueError(f"No valid checkpoint found in output directory ({output_dir})")
        for path, problem in checked:
            if problem is None:
                return str(path)
            logger.warning("Skipping the incomplete checkpoint %s on resume: %s.", path, problem)
        raise ValueError(
            f"No complete checkpoint in output directory ({output_dir}) to resume from: "
            + "; ".join(f"{path.name}: {problem}" for path, problem in checked)
            + ". The run was killed while saving each of them; resume from a checkpoint of another output "
            "directory (resume_from_checkpoint=<path>) or train from the start (remove these folders, or set "
            "resume_from_checkpoint=None)."
        )
    path = Path(resume_from_checkpoint)
    if not path.exists():
        raise ValueError(f"Cannot resume from {path}: it does not exist. {_checkpoints_found(output_dir, path)}")
    if not path.is_dir():
        raise ValueError(
            f"Cannot resume from {path}: it is a file, not a checkpoint folder. {_checkpoints_found(output_dir, path)}"
        )
    problem = checkpoint_problem(path, required_files)
    if problem is None:
        return str(resume_from_checkpoint)
    if path.parent.is_dir():
        others = [str(other) for other, trouble in complete_checkpoints(path.parent, required_files) if not trouble]
    else:
        others = []
    fix = (
        f"resume from an earlier complete checkpoint: {', '.join(others)}"
        if others
        else f"there is no complete checkpoint next to it in {path.parent}: train from the start"
    )
    raise ValueError(f"Cannot resume from {path}: {problem}. The checkpoint is incomplete; {fix}.")


def _checkpoints_found(output_dir: str | os.PathLike[str], path: Path) -> str:
    """What to resume from instead of the missing ``path``: the checkpoints of ``output_dir`` (and of the folder
    ``path`` names, when it is another), each complete or with its problem."""
    folders = list(dict.fromkeys(Path(folder) for folder in (output_dir, path.parent) if Path(folder).is_dir()))
    found = [(checkpoint, problem) for folder in folders for checkpoint, problem in complete_checkpoints(folder)]
    if not found:
        where = " or ".join(str(folder) for folder in folders) or f"output_dir ({output_dir}, which does not exist)"
        return (
            f"There is no checkpoint-N folder in {where}: check the path, or train from the start "
            "(resume_from_checkpoint=None)."
        )
    listed = ", ".join(
        f"{checkpoint}" + ("" if problem is None else f" (incomplete: {problem})") for checkpoint, problem in found
    )
    return (
        f"Checkpoints found: {listed}. Pass one of the complete ones, or resume_from_checkpoint=true for the latest "
        "complete one of output_dir."
    )


def name_disk_full(error: BaseException, folder: str | os.PathLike[str]) -> OSError | None:
    """An ``OSError(ENOSPC)`` saying "disk full" for an error raised while saving into ``folder``, or None.

    The error is taken for a full disk when it (or an exception it was raised from) is an ``OSError`` with errno
    ENOSPC or EDQUOT, or mentions "No space left on device" / "Disk quota exceeded" (libraries that wrap the OS error,
    like safetensors), or when it is an ``OSError``, a ``RuntimeError`` (torch's zip writer: "PytorchStreamWriter
    failed writing file ...", no errno) or a wrapped error while the filesystem of ``folder`` has less than
    `DISK_FULL_FREE_BYTES` free. Raise the result ``from error`` so the original stays in the traceback.

    Args:
        error: what the save raised.
        folder: the folder being written (need not exist: its nearest existing parent is measured).

    Returns:
        ``OSError(errno.ENOSPC, "disk full while saving <folder>: <free> bytes free on <mount>; ...")``, or None when
        the error is not a full disk (or already is this module's message).
    """
    if not isinstance(error, Exception) or str(getattr(error, "strerror", "")).startswith(_DISK_FULL_MESSAGE):
        return None
    chain = _exception_chain(error)
    said_full = any(isinstance(item, OSError) and item.errno in _DISK_FULL_ERRNOS for item in chain) or any(
        text in str(item) for item in chain for text in _DISK_FULL_TEXTS
    )
    usage = _free_space(folder)
    if not said_full:
        io_like = isinstance(error, (OSError, RuntimeError)) or type(error).__name__ == "SafetensorError"
        if not io_like or usage is None or usage[0] >= DISK_FULL_FREE_BYTES:
            return None
    free = f"{usage[0]} bytes free on {usage[1]}" if usage is not None else "free space unknown"
    return OSError(
        errno.ENOSPC,
        f"{_DISK_FULL_MESSAGE} {folder}: {free}; free space, lower save_total_limit or set save_only_model=True; "
        "the incomplete checkpoint is skipped on resume (trl_ext.checkpoints)",
    )


def _exception_chain(error: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _free_space(folder: str | os.PathLike[str]) -> tuple[int, str] | None:
    """``(free bytes, mount point)`` of the filesystem holding ``folder`` (its nearest existing parent)."""
    path = Path(os.path.abspath(folder))
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return None
    mount = path
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    return free, str(mount)
