"""What a recipe names, resolved and checked: its reward functions (`resolve_reward_funcs`, built-in names in
`REWARD_REGISTRY`), its data (`load_recipe_datasets`) and its models (`check_model_source`). Each failure is a
`trl_ext.recipes.RecipeError` naming the recipe key, the value and the fix.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .recipes import Recipe, RecipeError, check_data_file, data_file_builder

logger = logging.getLogger(__name__)

__all__ = ["REWARD_REGISTRY", "check_model_source", "load_recipe_datasets", "resolve_reward_funcs"]

# name -> import path of a reward (a class is instantiated with the entry's kwargs). `trl_ext.rewards.char_span_f1`
# is the metric function (predicted spans, gold spans), not a TRL reward: as a reward its name means the reward class.
REWARD_REGISTRY: dict[str, str] = {
    "char_span_f1": "trl_ext.rewards:CharSpanF1Reward",
    "trl_ext.rewards.char_span_f1": "trl_ext.rewards:CharSpanF1Reward",
    "trl_ext.rewards:char_span_f1": "trl_ext.rewards:CharSpanF1Reward",
    "rubric_judge": "trl_ext.rewards:RubricJudgeReward",
    "accuracy_reward": "trl.rewards:accuracy_reward",
    "reasoning_accuracy_reward": "trl.rewards:reasoning_accuracy_reward",
    "think_format_reward": "trl.rewards:think_format_reward",
}


def resolve_reward_funcs(specs: Sequence[Any] | None) -> list[Any]:
    """Reward functions from recipe entries (strings or ``{path, kwargs}`` mappings; `trl_ext.recipes` shows them)."""
    rewards = []
    for spec in specs or []:
        if isinstance(spec, str):
            target, kwargs = spec, {}
        elif isinstance(spec, Mapping):
            unknown = set(spec) - {"path", "name", "kwargs"}
            target = spec.get("path") or spec.get("name")
            kwargs = dict(spec.get("kwargs") or {})
            if unknown or not isinstance(target, str):
                raise RecipeError(
                    f"reward_funcs entry {dict(spec)!r}: write {{path: 'pkg.module:name', kwargs: {{...}}}} "
                    f"(unknown keys: {sorted(unknown) or 'none'})."
                )
        else:
            raise RecipeError(
                f"reward_funcs entry {spec!r}: expected an import path string or a {{path, kwargs}} mapping."
            )
        rewards.append(_build_reward(target, kwargs))
    return rewards


def _build_reward(target: str, kwargs: dict[str, Any]) -> Any:
    obj = _import_object(REWARD_REGISTRY.get(target, target))
    if inspect.isclass(obj):
        reward = obj(**kwargs)
    elif kwargs:
        reward = functools.partial(obj, **kwargs)
        reward.__name__ = getattr(obj, "__name__", target.rsplit(":", 1)[-1].rsplit(".", 1)[-1])  # type: ignore[attr-defined]
    else:
        reward = obj
    if not callable(reward):
        raise RecipeError(f"reward_funcs entry {target!r} is a {type(reward).__name__}, not a reward function.")
    _check_reward_signature(target, reward)
    return reward


def _check_reward_signature(target: str, reward: Callable[..., Any]) -> None:
    """A TRL reward takes ``completions`` (and the dataset columns) as keyword arguments."""
    try:
        signature = inspect.signature(reward)
    except (TypeError, ValueError):
        return
    params = signature.parameters
    if "completions" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    raise RecipeError(
        f"reward_funcs entry {target!r} has the signature {signature}, not TRL's reward interface "
        "(prompts, completions, **columns) -> list[float]. Use a reward function or class, e.g. "
        "trl_ext.rewards:CharSpanF1Reward."
    )


def _import_object(path: str) -> Any:
    if ":" in path:
        module_name, attribute = path.split(":", 1)
    elif "." in path:
        module_name, attribute = path.rsplit(".", 1)
    else:
        raise RecipeError(
            f"reward {path!r}: not a built-in name ({', '.join(sorted(k for k in REWARD_REGISTRY if '.' not in k))}) "
            "nor an import path such as 'my_rewards:score' or 'my_package.rewards.score'."
        )
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # as TRL's scripts do: ./my_rewards.py is importable
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise RecipeError(f"reward {path!r}: cannot import module {module_name!r} ({error}).") from None
    try:
        obj: Any = module
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise RecipeError(f"reward {path!r}: module {module_name!r} has no attribute {attribute!r}.") from None
    return obj


def load_recipe_datasets(recipe: Recipe) -> tuple[Any, Any]:
    """``(train_dataset, eval_dataset or None)`` as TRL's scripts load them: the ``datasets:`` mixture when given,
    else ``dataset_name`` (with ``dataset_config``); the splits named by the script arguments."""
    from datasets import load_dataset
    from trl import get_dataset

    script_args, dataset_args = recipe.script_args, recipe.dataset_args
    try:
        if dataset_args.datasets:
            if script_args.dataset_name:
                logger.warning("The recipe sets both `datasets` and `dataset_name`; `datasets` is used.")
            dataset = get_dataset(dataset_args)
        elif script_args.dataset_name:
            name, builder = script_args.dataset_name, data_file_builder(script_args.dataset_name)
            if builder is not None:  # a local file: load_dataset("train.jsonl") would look for it on the Hub
                check_data_file(recipe.source, name, "--dataset_name")
                dataset = load_dataset(builder, data_files=name, streaming=script_args.dataset_streaming)
            else:
                dataset = load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)
        else:
            raise RecipeError(
                f"{recipe.source}: no data. Set `dataset_name:` (a Hub dataset, a local folder or file) or a "
                "`datasets:` list of load_dataset arguments, e.g. [{path: json, data_files: train.jsonl}]."
            )
    except (FileNotFoundError, ConnectionError) as error:  # a missing data file, or a Hub dataset out of reach
        names = [config.data_files or config.path for config in dataset_args.datasets] or [script_args.dataset_name]
        raise RecipeError(
            f"{recipe.source}: cannot load the dataset {', '.join(map(repr, names))} ({error}). Create the data the "
            "recipe names, or override it on the command line: `--datasets train.jsonl` (a local JSON lines file, "
            "or a Hub dataset id; several make a mixture) or `--dataset_name NAME` (a Hub dataset, a local folder "
            "or file)."
        ) from None
    train_split = script_args.dataset_train_split
    if train_split not in dataset:
        raise RecipeError(f"{recipe.source}: the dataset has no split {train_split!r} (splits: {list(dataset)}).")
    eval_dataset = None
    if getattr(recipe.training_args, "eval_strategy", "no") != "no":
        eval_dataset = dataset.get(script_args.dataset_test_split)
    return dataset[train_split], eval_dataset


_HUB_MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def check_model_source(
    name: str, key: str, *, revision: str | None = None, source: str | os.PathLike[str] | None = None
) -> None:
    """Fail early, with the fix, when a model setting names neither an existing folder nor a model the Hub has.

    A folder is taken as is. A name that cannot be a Hub id (``./tiny``, ``/abs/path``) or a file is an error. A Hub
    id is looked up as transformers would (its ``config.json``, from the cache first): offline
    (``HF_HUB_OFFLINE=1``) with no cached copy, unreachable, or not on the Hub, the error says which, and that
    ``trl-ext tiny-model DIR`` makes a local model folder, instead of transformers' "couldn't connect" deep inside
    the trainer.

    Raises:
        RecipeError: naming ``key``, the value and the fix.
    """
    import huggingface_hub
    from huggingface_hub import constants, errors

    where = f"{source}: " if source else ""
    path = Path(name).expanduser()
    if path.is_dir():
        return
    make = f"`trl-ext tiny-model {name}` makes a tiny offline model folder there"
    if path.exists():
        raise RecipeError(f"{where}{key}={name!r} is a file, not a model folder; pass the folder (or a Hub id).")
    if not _HUB_MODEL_ID.match(name) or ".." in name:
        raise RecipeError(
            f"{where}{key}={name!r}: no such folder ({path.absolute()}). Pass an existing model folder or a Hub "
            f"model id; {make} (for tests and dry runs)."
        )
    if isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json", revision=revision), str):
        return  # in the Hub cache: transformers loads it offline too
    if constants.HF_HUB_OFFLINE:
        raise RecipeError(
            f"{where}{key}={name!r}: no folder of that name ({path.absolute()} does not exist), and the Hub is "
            f"offline (HF_HUB_OFFLINE is set) with no cached copy of a model {name!r}. Pass an existing model folder "
            f"({make}), or unset HF_HUB_OFFLINE to download {name!r}."
        )
    unreachable = (
        f"{where}{key}={name!r}: no folder of that name ({path.absolute()} does not exist), and the Hub could not be "
        f"reached to look for a model {name!r} ({{}}). Pass an existing model folder ({make}), or check the network "
        "/ HF_ENDPOINT."
    )
    try:
        huggingface_hub.hf_hub_download(name, "config.json", revision=revision)
    except errors.LocalEntryNotFoundError as error:  # "cannot find the requested files in the local cache"
        raise RecipeError(unreachable.format(type(error).__name__)) from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError) as error:
        raise RecipeError(
            f"{where}{key}={name!r}: no folder of that name ({path.absolute()} does not exist) and no model "
            f"{name!r} on the Hub ({type(error).__name__}; a private or gated model needs HF_TOKEN or `hf auth "
            f"login`). Pass an existing model folder ({make}) or a Hub model id."
        ) from None
    except errors.EntryNotFoundError:
        return  # the repository exists but has no config.json at the root: let transformers say what it needs
    except (OSError, errors.HfHubHTTPError) as error:  # a connection or server error
        raise RecipeError(unreachable.format(f"{type(error).__name__}: {error}")) from None
