"""YAML recipes: ``trl-ext train CONFIG.yaml`` with TRL's conventions (`trl.TrlParser`, as in ``trl grpo --config``).

A recipe is one flat YAML mapping, exactly like the files TRL's scripts read, plus one key, ``trainer``, that picks
the config and trainer classes:

=================  =====================  ======================
``trainer:``       config class           trainer class
=================  =====================  ======================
``stepwise_rlm``   `StepwiseRLMConfig`    `StepwiseRLMTrainer`
``judge_credit``   `JudgeCreditConfig`    `JudgeCreditTrainer`
``rlmt``           `RLMTConfig`           `RLMTTrainer`
``grpo``           `ExtGRPOConfig`        `ExtGRPOTrainer`
=================  =====================  ======================

Every other key is a field of one of four dataclasses, parsed by `trl.TrlParser`: `TrainScriptArguments` (TRL's
``ScriptArguments`` — ``dataset_name``, splits — plus ``trainer``, ``reward_funcs``, ``reward_models`` and the
monitors), the config class (``learning_rate``, ``loss_type``, ``max_turns``, ...), `trl.ModelConfig`
(``model_name_or_path``, ``dtype``, ``use_peft``, ``lora_r``, ...) and `trl.DatasetMixtureConfig` (``datasets:``, a
list of ``load_dataset`` argument mappings, for local files and mixtures). ``env:`` sets environment variables.
Command-line ``--key value`` pairs after the file override it. Unknown keys are an error.

Data on the command line, with TRL's flags: ``--datasets train.jsonl [...]`` replaces the file's ``datasets:``, and so
does ``--dataset_name NAME`` (the command line wins over the file). A local data file (``.jsonl``, ``.json``,
``.csv``, ``.parquet``, ...) given as a ``datasets:`` path or as ``dataset_name`` is read with its `load_dataset`
builder (``json``, ``csv``, ...), and one that does not exist is an error naming it. ``model_name_or_path`` (and the
reward models) must name an existing folder or a model the Hub has (`check_model_source`): offline, a missing
folder is said to be missing, with ``trl-ext tiny-model DIR`` as the way to make a tiny one.

Reward functions (``reward_funcs``) are import paths, ``package.module:name`` or ``package.module.name`` (the
working directory is importable, so ``my_rewards:score`` finds ``./my_rewards.py``), or a built-in name (`REWARD
_REGISTRY`). A class is instantiated; a mapping ``{path: ..., kwargs: {...}}`` passes keyword arguments (to a class,
or bound to a function)::

    reward_funcs:
      - trl_ext.rewards.char_span_f1                   # built-in alias of CharSpanF1Reward()
      - my_rewards:exact_match                         # ./my_rewards.py
      - path: trl_ext.rewards.RubricJudgeReward
        kwargs: {base_url: "http://127.0.0.1:8001/v1", model: judge}

`train_from_recipe` runs it: build the trainer (`build_trainer`), train, save the adapter (or model), the trainer
state, ``trl_ext_run.json`` and the monitors plot in ``output_dir``, and push the adapter with a model card when
``push_to_hub`` is set (`trl_ext.hub.push_adapter`). It runs unchanged under ``accelerate launch -m trl_ext.cli
train CONFIG.yaml``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl import ScriptArguments

from .hub import PLOT_FILE
from .run_info import RunInfo, collect_monitor_alerts, is_setting_choice, last_logged_metrics
from .run_info import write_run_info as _write_run_info

logger = logging.getLogger(__name__)

__all__ = [
    "REWARD_REGISTRY",
    "TRAINERS",
    "Recipe",
    "RecipeError",
    "TrainScriptArguments",
    "build_trainer",
    "check_model_source",
    "config_summary",
    "load_recipe_datasets",
    "override_keys",
    "parse_recipe",
    "read_trainer_name",
    "resolve_reward_funcs",
    "train_from_recipe",
    "write_run_info",
]


# trainer name -> (module, config class, trainer class)
TRAINERS: dict[str, tuple[str, str, str]] = {
    "stepwise_rlm": ("trl_ext.trainers", "StepwiseRLMConfig", "StepwiseRLMTrainer"),
    "judge_credit": ("trl_ext.trainers", "JudgeCreditConfig", "JudgeCreditTrainer"),
    "rlmt": ("trl_ext.trainers", "RLMTConfig", "RLMTTrainer"),
    "grpo": ("trl_ext.trainers", "ExtGRPOConfig", "ExtGRPOTrainer"),
}

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


class RecipeError(ValueError):
    """A recipe that cannot be parsed or built; the message names the file, the key and the fix."""


@dataclass
class TrainScriptArguments(ScriptArguments):
    """TRL's ``ScriptArguments`` (dataset name, config and splits) plus what selects and feeds a trl-ext trainer.

    Parameters:
        trainer: ``stepwise_rlm``, ``judge_credit``, ``rlmt`` or ``grpo`` (see `TRAINERS`).
        reward_funcs: reward functions: import paths, built-in names or ``{path, kwargs}`` mappings (YAML).
        reward_models: sequence-classification reward models (Hub ids or paths) that TRL loads and scores the whole
            completion with (not for ``rlmt``: set ``reward_model_name_or_path``, which scores the response only).
        monitors: attach `trl_ext.default_monitors` (clip rate / IPO mask, entropy and KL, reward).
        monitor_action: the monitors' action: ``warn``, ``checkpoint`` or ``stop`` (collapses always stop).
        save_plot: draw ``monitors.png`` in ``output_dir`` after training (needs matplotlib).
    """

    trainer: str = field(
        default="grpo",
        metadata={"help": "Which trl-ext trainer: stepwise_rlm, judge_credit, rlmt or grpo (ExtGRPOTrainer)."},
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: import paths ('pkg.mod:func' or 'pkg.mod.func'), built-in names (char_span_f1, "
            "rubric_judge, accuracy_reward, think_format_reward, ...) or, in YAML, {path: ..., kwargs: {...}}."
        },
    )
    reward_models: list[str] | None = field(
        default=None,
        metadata={"help": "Sequence-classification reward models TRL loads (Hub ids or local paths)."},
    )
    monitors: bool = field(
        default=True, metadata={"help": "Attach trl_ext.default_monitors() (clip rate, entropy/KL, reward)."}
    )
    monitor_action: str = field(
        default="warn", metadata={"help": "Action of the monitors' rules: warn, checkpoint or stop."}
    )
    save_plot: bool = field(default=True, metadata={"help": "Draw output_dir/monitors.png after training."})


@dataclass
class Recipe:
    """A parsed recipe: the four argument dataclasses, and where they came from."""

    script_args: TrainScriptArguments
    training_args: Any
    model_args: Any
    dataset_args: Any
    source: Path | None = None
    set_keys: set[str] = field(default_factory=set)  # the keys the file and the command line set (user choices)

    @property
    def trainer(self) -> str:
        return self.script_args.trainer


# ----------------------------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------------------------
def read_trainer_name(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> str:
    """The ``trainer`` of a recipe file (a ``--trainer`` override wins); `RecipeError` if it is unknown."""
    mapping = _read_yaml(Path(path))
    name = mapping.get("trainer", "grpo")
    args = list(overrides)
    if "--trainer" in args and args.index("--trainer") + 1 < len(args):
        name = args[args.index("--trainer") + 1]
    if name not in TRAINERS:
        raise RecipeError(
            f"{path}: trainer={name!r} is not one of {', '.join(TRAINERS)}; set `trainer:` to one of them."
        )
    return name


def parse_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Recipe:
    """Parse a recipe file into its dataclasses, with ``--key value`` overrides, the way ``trl <cmd> --config`` does.

    Raises:
        RecipeError: missing/unreadable file, unknown trainer, unknown keys or invalid values (the config classes'
            own checks), with the file name.
    """
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

    path = Path(path)
    name = read_trainer_name(path, overrides)
    config_class = _config_class(name)
    dataclass_types = (TrainScriptArguments, config_class, ModelConfig, DatasetMixtureConfig)
    mapping = _read_yaml(path)
    _check_keys(path, name, mapping, dataclass_types)
    parser = TrlParser(dataclass_types)
    try:
        script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(
            ["--config", str(path), *overrides]
        )
    except (ValueError, TypeError) as error:  # the config classes' own checks (__post_init__)
        hint = ""
        if "bf16" in str(error) and "--bf16" not in overrides:
            hint = " (a GPU recipe on a machine without a GPU: add `--bf16 false --use_cpu true`, or run it on a GPU)"
        raise RecipeError(f"{path}: {error}{hint}") from None
    except SystemExit as error:  # argparse has printed what it could not parse
        raise RecipeError(f"{path}: invalid command-line override or value (see the message above).") from error
    given = override_keys(overrides)
    if "dataset_name" in given and "datasets" not in given and dataset_args.datasets:
        dataset_args.datasets = []  # the command line wins over the file: `--dataset_name` replaces its `datasets:`
    dataset_args.datasets = [_local_data_file_config(path, config) for config in dataset_args.datasets]
    set_keys = (set(mapping) | given) - {"env"}
    return Recipe(script_args, training_args, model_args, dataset_args, source=path, set_keys=set_keys)


def override_keys(overrides: Sequence[str]) -> set[str]:
    """The field names a list of ``--key value`` / ``--key=value`` command-line overrides sets."""
    return {token[2:].split("=", 1)[0] for token in overrides if token.startswith("--") and len(token) > 2}


# A local data file passed where `load_dataset` wants a dataset name or folder -> the packaged builder that reads it.
DATA_FILE_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".tsv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".txt": "text",
}


def _data_file_builder(name: str | None) -> str | None:
    """The `load_dataset` builder of ``name`` when it names a local data file (``train.jsonl``), else None."""
    if not isinstance(name, str):
        return None
    suffixes = [suffix.lower() for suffix in Path(name).suffixes]
    if suffixes and suffixes[-1] in (".gz", ".bz2", ".xz", ".zst", ".zip"):  # train.jsonl.gz
        suffixes = suffixes[:-1]
    return DATA_FILE_BUILDERS.get(suffixes[-1]) if suffixes else None


def _check_data_file(source: Path | None, name: str, flag: str) -> None:
    if not Path(name).is_file():
        raise RecipeError(
            f"{source}: {flag} {name!r}: no such data file (looked in {Path(name).absolute().parent}). Pass an "
            "existing JSON lines / JSON / CSV / Parquet file, a dataset folder, or a Hub dataset id."
        )


def _local_data_file_config(source: Path | None, config: Any) -> Any:
    """A ``datasets:`` entry whose ``path`` is a local data file (``--datasets train.jsonl``, as TRL's command line
    gives it) -> ``{path: json, data_files: train.jsonl}``, what `load_dataset` needs for a file."""
    builder = _data_file_builder(config.path)
    if builder is None:
        return config
    _check_data_file(source, config.path, "datasets entry")
    if config.data_files is not None:
        raise RecipeError(
            f"{source}: datasets entry path={config.path!r} is a file and also sets data_files; write "
            f"{{path: {builder}, data_files: {config.path}}}."
        )
    return dataclasses.replace(config, path=builder, data_files=config.path)


def _check_keys(path: Path, trainer: str, mapping: Mapping[str, Any], dataclass_types: Sequence[type]) -> None:
    """Unknown keys are a typo or another trainer's field: say which, with the closest known names."""
    import difflib

    known = {"env"} | {item.name for cls in dataclass_types for item in dataclasses.fields(cls)}
    unknown = [key for key in mapping if key not in known]
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1)
        owner = [other for other in TRAINERS if other != trainer and key in _field_names(_config_class(other))]
        if owner:
            hints.append(f"{key!r} (a field of trainer {owner[0]!r})")
        elif close:
            hints.append(f"{key!r} (did you mean {close[0]!r}?)")
        else:
            hints.append(repr(key))
    names = ", ".join(cls.__name__ for cls in dataclass_types)
    raise RecipeError(
        f"{path}: unknown key(s) for trainer {trainer!r}: {'; '.join(hints)}. Valid keys: fields of {names}."
    )


def _field_names(cls: type) -> set[str]:
    return {item.name for item in dataclasses.fields(cls)}


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    if not path.is_file():
        raise RecipeError(
            f"{path}: no such recipe file. Pass a YAML file, e.g. recipes/judge_credit_math_4b_lambda025.yaml."
        )
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise RecipeError(f"{path}: not valid YAML ({error}).") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping of keys to values, got {type(data).__name__}.")
    return data


def _config_class(name: str) -> type:
    module, config_name, _ = TRAINERS[name]
    return getattr(importlib.import_module(module), config_name)


def _trainer_class(name: str) -> type:
    module, _, trainer_name = TRAINERS[name]
    return getattr(importlib.import_module(module), trainer_name)


# ----------------------------------------------------------------------------------------------------------------
# Rewards and data
# ----------------------------------------------------------------------------------------------------------------
def resolve_reward_funcs(specs: Sequence[Any] | None) -> list[Any]:
    """Reward functions from recipe entries (strings or ``{path, kwargs}`` mappings); see the module docstring."""
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
            name, builder = script_args.dataset_name, _data_file_builder(script_args.dataset_name)
            if builder is not None:  # a local file: load_dataset("train.jsonl") would look for it on the Hub
                _check_data_file(recipe.source, name, "--dataset_name")
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


# ----------------------------------------------------------------------------------------------------------------
# Building and running
# ----------------------------------------------------------------------------------------------------------------
def build_trainer(
    recipe: Recipe,
    *,
    model: Any = None,
    processing_class: Any = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    reward_funcs: Sequence[Any] | None = None,
    callbacks: Sequence[Any] | None = None,
    **trainer_kwargs: Any,
) -> Any:
    """The recipe's trainer, as TRL's ``grpo`` script builds `GRPOTrainer`: the model by name (with the model
    arguments as ``model_init_kwargs``), the PEFT and quantization configs from `trl.ModelConfig`, the rewards, the
    data, and `default_monitors` unless ``monitors: false``.

    Every argument overrides what the recipe would build (tests pass a tiny in-memory model and dataset);
    ``trainer_kwargs`` go to the trainer (e.g. ``generator=`` for `StepwiseRLMTrainer`, ``judge=`` for
    `JudgeCreditTrainer`).
    """
    from trl import get_peft_config, get_quantization_config

    script_args, args, model_args = recipe.script_args, recipe.training_args, recipe.model_args
    name = recipe.trainer
    if model is None:
        if not model_args.model_name_or_path:
            raise RecipeError(f"{recipe.source}: set `model_name_or_path:` (a Hub model id or a local folder).")
        model = model_args.model_name_or_path
        check_model_source(model, "model_name_or_path", revision=model_args.model_revision, source=recipe.source)
        init_kwargs = {
            "revision": model_args.model_revision,
            "trust_remote_code": getattr(args, "trust_remote_code", False),
            "attn_implementation": model_args.attn_implementation,
            "dtype": model_args.dtype,
        }
        init_kwargs = {key: value for key, value in init_kwargs.items() if value is not None}
        args.model_init_kwargs = {**init_kwargs, **(args.model_init_kwargs or {})}
    if reward_funcs is None:
        reward_funcs = resolve_reward_funcs(script_args.reward_funcs)
        if script_args.reward_models:
            if name == "rlmt":
                raise RecipeError(
                    f"{recipe.source}: `reward_models` would score the plan with the response; for rlmt set "
                    "`reward_model_name_or_path:` (RLMTConfig), which scores the response only."
                )
            for reward_model in script_args.reward_models:
                check_model_source(reward_model, "reward_models", source=recipe.source)
            reward_funcs = [*script_args.reward_models, *reward_funcs]
        reward_model = getattr(args, "reward_model_name_or_path", None)
        if isinstance(reward_model, str):
            check_model_source(reward_model, "reward_model_name_or_path", source=recipe.source)
    reward_funcs = list(reward_funcs)
    if not reward_funcs and not (name == "rlmt" and getattr(args, "reward_model_name_or_path", None)):
        raise RecipeError(
            f"{recipe.source}: no reward. Set `reward_funcs:` (import paths or built-in names)"
            + (" or `reward_model_name_or_path:`." if name == "rlmt" else ".")
        )
    if train_dataset is None:
        train_dataset, loaded_eval = load_recipe_datasets(recipe)
        eval_dataset = loaded_eval if eval_dataset is None else eval_dataset
    callbacks = list(callbacks or [])
    if script_args.monitors:
        from .callbacks import MonitorCallback, default_monitors

        if not any(isinstance(cb, MonitorCallback) for cb in callbacks):
            callbacks.extend(default_monitors(action=script_args.monitor_action))
    trainer_class = _trainer_class(name)
    kwargs: dict[str, Any] = dict(
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=processing_class,
        callbacks=callbacks,
        peft_config=get_peft_config(model_args),
        **trainer_kwargs,
    )
    quantization = get_quantization_config(model_args)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    return trainer_class(model, reward_funcs if reward_funcs else None, **kwargs)


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


def train_from_recipe(recipe: Recipe, **build_kwargs: Any) -> Any:
    """Build, train, save (adapter or model, trainer state, ``trl_ext_run.json``, ``monitors.png``) and, when
    ``push_to_hub`` is set, push the adapter with a model card (`trl_ext.hub.push_adapter`); returns the trainer.
    What ``trl-ext train`` runs.

    ``push_to_hub`` is handled here, not by `transformers.Trainer` (which would push every checkpoint with its own
    card): one commit at the end, adapter files only, to ``hub_model_id`` (default: the output folder's name under
    your account).
    """
    args = recipe.training_args
    push_repo = None
    if args.push_to_hub:
        push_repo = args.hub_model_id or Path(args.output_dir).name
        args.push_to_hub = False
    trainer = build_trainer(recipe, **build_kwargs)
    resume = args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "latest"):  # the command line gives strings
        resume = True  # the latest complete checkpoint of output_dir (ExtGRPOTrainer.train)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(args.output_dir)
    trainer.save_state()
    if trainer.accelerator.is_main_process:
        output_dir = Path(args.output_dir)
        write_run_info(output_dir, recipe, trainer)
        if recipe.script_args.save_plot:
            try:
                from .callbacks import plot_run

                plot_run(output_dir, out=output_dir / PLOT_FILE)
            except (ImportError, ValueError, FileNotFoundError) as error:
                logger.warning("No monitors plot: %s", error)
        if push_repo is not None:
            from .hub import push_adapter

            if "/" not in push_repo:
                from huggingface_hub import HfApi

                from .hub import HubUploadError, describe_hub_error

                try:
                    push_repo = f"{HfApi(token=args.hub_token).whoami()['name']}/{push_repo}"
                except Exception as error:  # noqa: BLE001 - offline, unreachable or a refused token: say which
                    raise HubUploadError(
                        f"finding your Hub user name for hub_model_id={push_repo!r} failed: {describe_hub_error(error)}"
                    ) from error
            info = push_adapter(
                output_dir, push_repo, private=bool(getattr(args, "hub_private_repo", False)), token=args.hub_token
            )
            logger.info("Pushed the adapter to %s", getattr(info, "commit_url", push_repo))
    trainer.accelerator.wait_for_everyone()
    return trainer


def write_run_info(output_dir: Path, recipe: Recipe, trainer: Any) -> Path:
    """``trl_ext_run.json`` of a recipe run (`trl_ext.run_info.RunInfo`): what ``trl-ext push`` puts in the model
    card (trainer, base model, config, metrics, alerts); ``extra`` holds the recipe's path."""
    alerts, alert_log = collect_monitor_alerts(trainer)
    info = RunInfo(
        source="trl-ext train",
        method=recipe.trainer,
        trainer=type(trainer).__name__,
        base_model=_model_reference(
            recipe.model_args.model_name_or_path or getattr(trainer.model.config, "_name_or_path", None)
        ),
        dataset=_dataset_reference(recipe),
        reward_funcs=[getattr(f, "__name__", str(f)) for f in trainer.reward_funcs],
        config=config_summary(recipe.training_args, recipe.set_keys or None),
        peft=_peft_summary(recipe.model_args),
        metrics=last_logged_metrics(trainer.state.log_history),
        steps=trainer.state.global_step,
        alerts=alerts,
        alert_log=alert_log,
        sandbox=getattr(trainer, "sandbox_info", None),  # what the REPLs of this run were isolated from
        extra={"recipe": str(recipe.source)} if recipe.source else {},
    )
    return _write_run_info(output_dir, info)


def _model_reference(name: str | None) -> str | None:
    """A model as the run file records it: a local folder as its absolute path (so `trl-ext push` knows it is not a
    Hub id and keeps it out of the card), a Hub id as is."""
    if name and Path(name).expanduser().is_dir():
        return str(Path(name).expanduser().resolve())
    return name


def _dataset_reference(recipe: Recipe) -> str | list[str] | None:
    """The training data as the run file records it: ``dataset_name``, or per ``datasets:`` entry its data files
    (a local file) or its path (a Hub dataset or folder)."""
    if not recipe.dataset_args.datasets:
        return recipe.script_args.dataset_name
    references: list[str] = []
    for config in recipe.dataset_args.datasets:
        files = config.data_files
        if config.path in DATA_FILE_BUILDERS.values() and files:
            if isinstance(files, Mapping):  # {split: files}
                files = [item for value in files.values() for item in ([value] if isinstance(value, str) else value)]
            references += [files] if isinstance(files, str) else [str(item) for item in files]
        else:
            references.append(config.path)
    return references


def _peft_summary(model_args: Any) -> dict[str, Any] | None:
    if not model_args.use_peft:
        return None
    return {
        "r": model_args.lora_r,
        "lora_alpha": model_args.lora_alpha,
        "lora_dropout": model_args.lora_dropout,
        "target_modules": model_args.lora_target_modules,
    }


def config_summary(config: Any, set_keys: Collection[str] | None = None) -> dict[str, Any]:
    """The training choices of a trainer config: the fields that differ from the class defaults (JSON-safe), without
    bookkeeping (`trl_ext.run_info.is_setting_choice`: folders, logging, saving, the Hub, endpoints, secrets, the
    machine, derived values). With ``set_keys`` (the keys a recipe file and its command line set), only those:
    values the config computed itself are not choices. ``loss_type`` is always kept. The "config" of the run file
    and the model card."""
    summary = {}
    for item in dataclasses.fields(config):
        if not is_setting_choice(item.name):
            continue
        if set_keys is not None and item.name not in set_keys and item.name != "loss_type":
            continue
        value = getattr(config, item.name)
        if item.default is not dataclasses.MISSING:
            default = item.default
        elif item.default_factory is not dataclasses.MISSING:
            default = item.default_factory()
        else:
            default = dataclasses.MISSING
        if value == default and item.name != "loss_type":
            continue
        try:
            json.dumps(value)
        except TypeError:
            value = str(value)
        summary[item.name] = value
    return summary
