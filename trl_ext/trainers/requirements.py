"""What a trainer's datasets and reward functions need, checked when the trainer is built instead of minutes into
training: dataset columns named in a setting (`require_columns`), the columns and prompt format a reward function
reads, and the packages it imports (`check_reward_requirements`).

Every check raises with the offending value and the fix. A dataset whose columns cannot be known (a torch dataset,
a list) is not checked; an `datasets.IterableDataset` without features is checked on its first row.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from datasets import IterableDataset
from torch import nn
from trl.data_utils import is_conversational
from trl.import_utils import is_math_verify_available

from ..rollouts import reward_name

logger = logging.getLogger(__name__)

# The keyword arguments TRL passes every reward function besides the dataset columns (GRPOTrainer._calculate_rewards).
TRL_REWARD_KWARGS = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}
)
# TRL's reward functions that read ``completion[0]["content"]`` (conversational completions only) and, for those in
# `trl.rewards.accuracy_rewards`, import math-verify when called.
_TRL_CONVERSATIONAL_REWARD_MODULES = ("trl.rewards.accuracy_rewards", "trl.rewards.format_rewards")
_TRL_MATH_VERIFY_MODULE = "trl.rewards.accuracy_rewards"
MATH_VERIFY_INSTALL = "pip install math-verify (or pip install 'trl-ext[math]')"


def dataset_columns(dataset: Any) -> list[str] | None:
    """The column names of a `datasets.Dataset` or `datasets.IterableDataset` (read from its first row when it has
    no features), or ``None`` when they cannot be known."""
    names = getattr(dataset, "column_names", None)
    if names is not None:
        return list(names)
    row = first_row(dataset)
    return None if row is None else list(row)


def first_row(dataset: Any) -> Mapping[str, Any] | None:
    """The first example of a dataset as a mapping, or ``None`` (empty, or a kind of dataset not read here)."""
    try:
        if isinstance(dataset, IterableDataset):
            row = next(iter(dataset.take(1)), None)
        elif hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
            row = dataset[0] if len(dataset) else None
        else:
            return None
    except Exception as error:  # a dataset that cannot be read here is read (and fails) where TRL reads it
        logger.debug("Could not read the first row of a %s: %r", type(dataset).__name__, error)
        return None
    return row if isinstance(row, Mapping) else None


def named_datasets(train_dataset: Any, eval_dataset: Any) -> list[tuple[str, Any]]:
    """``(split name, dataset)`` of the datasets given (an ``eval_dataset`` dict gives one entry per key)."""
    named = [("train", train_dataset)] if train_dataset is not None else []
    if isinstance(eval_dataset, Mapping):
        named += [(f"eval ({key!r})", value) for key, value in eval_dataset.items() if value is not None]
    elif eval_dataset is not None:
        named.append(("eval", eval_dataset))
    return named


def changed_settings(args: Any, names: Iterable[str]) -> dict[str, Any]:
    """The settings among ``names`` whose value differs from the config's default (an explicit choice), by name."""
    defaults = {f.name: f.default for f in dataclasses.fields(args) if f.default is not dataclasses.MISSING}
    return {
        name: getattr(args, name) for name in names if name not in defaults or getattr(args, name) != defaults[name]
    }


def missing_column(datasets: Sequence[tuple[str, Any]], column: str) -> tuple[str, list[str]] | None:
    """``(split name, its columns)`` of the first dataset that lacks ``column``; ``None`` when none does (datasets
    whose columns cannot be known are skipped)."""
    for split, dataset in datasets:
        available = dataset_columns(dataset)
        if available is not None and column not in available:
            return split, available
    return None


def _did_you_mean(column: str, available: Sequence[str]) -> str:
    close = difflib.get_close_matches(column, available, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def require_columns(datasets: Sequence[tuple[str, Any]], settings: Mapping[str, str | None], *, owner: str) -> None:
    """Raise a `ValueError` when a dataset lacks the column a setting names.

    Args:
        datasets: ``(split name, dataset)`` pairs (`named_datasets`).
        settings: setting name (e.g. ``"context_column"``) -> the column it names; ``None`` values are skipped.
        owner: the trainer, for the message (e.g. ``"StepwiseRLMTrainer"``).
    """
    for setting, column in settings.items():
        if column is None:
            continue
        missing = missing_column(datasets, column)
        if missing is not None:
            split, available = missing
            raise ValueError(
                f"{owner}: {setting}={column!r}, but the {split} dataset has no column {column!r} (its columns: "
                f"{available}).{_did_you_mean(column, available)} Set {setting} to the dataset's column, or add a "
                f"{column!r} column to the dataset."
            )


def reward_column_arguments(func: Callable[..., Any]) -> list[str]:
    """The dataset columns a reward function cannot run without: the parameters of its signature with no default,
    other than those TRL always passes (`TRL_REWARD_KWARGS`), plus the ones it declares in ``required_columns``."""
    columns = list(getattr(func, "required_columns", ()) or ())
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return columns
    for name, parameter in signature.parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD, parameter.POSITIONAL_ONLY):
            continue
        if parameter.default is parameter.empty and name not in TRL_REWARD_KWARGS and name not in columns:
            columns.append(name)
    return columns


def _module_of(func: Any) -> str:
    module = getattr(func, "__module__", None)
    if not isinstance(module, str) or not inspect.isroutine(func):
        module = type(func).__module__  # a callable object, e.g. TRL's cosine-scaled reward
    return module


def check_reward_requirements(
    reward_funcs: Sequence[Any],
    datasets: Sequence[tuple[str, Any]],
    *,
    owner: str,
    extra_columns: Iterable[str] | None = (),
) -> None:
    """Fail at construction where a reward function would fail at its first call.

    - TRL's math rewards (`trl.rewards.accuracy_reward`, `reasoning_accuracy_reward`, `get_cosine_scaled_reward`)
      need math-verify: an `ImportError` naming the install command when it is missing.
    - TRL's rewards read conversational completions only (``completion[0]["content"]``): a dataset of string prompts
      (whose completions are strings) is a `ValueError` saying how to make the prompts conversational.
    - A reward argument with no default (e.g. accuracy_reward's ``solution``) or a column it declares in
      ``required_columns`` must be a dataset column (``extra_columns``: the columns a rollout function adds;
      ``None`` when they are unknown, which skips this check).

    Reward models (`torch.nn.Module`) are not checked.
    """
    extra = set(extra_columns or ())
    for func in reward_funcs:
        if isinstance(func, nn.Module) or not callable(func):
            continue
        name, module = reward_name(func), _module_of(func)
        if module == _TRL_MATH_VERIFY_MODULE and not is_math_verify_available():
            raise ImportError(
                f"{owner}: the reward function '{name}' (trl.rewards) verifies answers with math-verify, which is not "
                f"installed; it would fail at the first batch. Install it: {MATH_VERIFY_INSTALL}."
            )
        if module in _TRL_CONVERSATIONAL_REWARD_MODULES:
            for split, dataset in datasets:
                row = first_row(dataset)
                if row is not None and "prompt" in row and not is_conversational(row):
                    raise ValueError(
                        f"{owner}: the reward function '{name}' (trl.rewards) reads conversational completions "
                        f"(completion[0]['content']), but the {split} dataset's prompts are strings (first prompt: "
                        f"{str(row['prompt'])[:60]!r}), so its completions would be strings too. Make the prompts "
                        "conversational, e.g. dataset = dataset.map(lambda row: {'prompt': [{'role': 'user', "
                        "'content': row['prompt']}]}), or use a reward function that takes string completions."
                    )
        if extra_columns is None:  # a rollout function may add columns: they are not known yet
            continue
        for column in reward_column_arguments(func):
            missing = None if column in extra else missing_column(datasets, column)
            if missing is not None:
                split, available = missing
                raise ValueError(
                    f"{owner}: the reward function '{name}' needs the dataset column {column!r} (TRL passes the "
                    f"columns to reward functions by name), but the {split} dataset has none (its columns: "
                    f"{available}).{_did_you_mean(column, available)} Add a {column!r} column to the dataset, e.g. "
                    f"dataset = dataset.rename_column(<your column>, {column!r})."
                )


def check_trainer_inputs(
    owner: str,
    reward_funcs: Any,
    pargs: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    column_settings: Mapping[str, str | None] | None = None,
    extra_columns: Iterable[str] = (),
) -> None:
    """The checks of this module on what a trainer's ``__init__`` got, before the model is loaded.

    Args:
        owner: the trainer's name, for the messages.
        reward_funcs: as passed to the trainer (one or a list).
        pargs, kwargs: the trainer's arguments after ``args`` (`trl.GRPOTrainer`'s order: ``train_dataset``,
            ``eval_dataset``, ...).
        column_settings: setting -> the dataset column it names, which every dataset must have (`require_columns`).
        extra_columns: the columns the trainer's own rollout function adds; a ``rollout_func`` passed by the user
            may add any, so the reward columns are then not checked.
    """
    train_dataset = pargs[0] if len(pargs) > 0 else kwargs.get("train_dataset")
    eval_dataset = pargs[1] if len(pargs) > 1 else kwargs.get("eval_dataset")
    datasets = named_datasets(train_dataset, eval_dataset)
    require_columns(datasets, column_settings or {}, owner=owner)
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    user_rollout = kwargs.get("rollout_func") is not None
    check_reward_requirements(
        [func for func in funcs if func is not None and not isinstance(func, str)],
        datasets,
        owner=owner,
        extra_columns=None if user_rollout else extra_columns,
    )
