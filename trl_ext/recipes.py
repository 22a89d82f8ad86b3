"""YAML recipes (``trl-ext train CONFIG.yaml``), the format and its parsing: TRL's conventions (`trl.TrlParser`, as
in ``trl grpo --config``).

A recipe is one flat YAML mapping, exactly like the files TRL's scripts read, plus one key, ``trainer``, that picks
the method (`trl_ext.methods.METHODS`, written with underscores: ``stepwise_rlm``, ``judge_credit``, ``rlmt``,
``grpo``) and so its config and trainer classes.

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
reward models) must name an existing folder or a model the Hub has (`trl_ext.recipe_inputs.check_model_source`):
offline, a missing folder is said to be missing, with ``trl-ext tiny-model DIR`` as the way to make a tiny one.

Reward functions (``reward_funcs``) are import paths, ``package.module:name`` or ``package.module.name`` (the
working directory is importable, so ``my_rewards:score`` finds ``./my_rewards.py``), or a built-in name
(`trl_ext.recipe_inputs.REWARD_REGISTRY`). A class is instantiated; a mapping ``{path: ..., kwargs: {...}}`` passes
keyword arguments (to a class, or bound to a function)::

    reward_funcs:
      - trl_ext.rewards.char_span_f1                   # built-in alias of CharSpanF1Reward()
      - my_rewards:exact_match                         # ./my_rewards.py
      - path: trl_ext.rewards.RubricJudgeReward
        kwargs: {base_url: "http://127.0.0.1:8001/v1", model: judge}

This module reads a recipe (`parse_recipe`: the `Recipe`); `trl_ext.recipe_inputs` resolves what it names (reward
functions, data, models) and `trl_ext.recipe_training` runs it (`build_trainer`, `train_from_recipe`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl import ScriptArguments

from .methods import METHODS, Method, method_for_recipe

__all__ = [
    "DATA_FILE_BUILDERS",
    "Recipe",
    "RecipeError",
    "TrainScriptArguments",
    "check_data_file",
    "config_class",
    "data_file_builder",
    "override_keys",
    "parse_recipe",
    "read_trainer_name",
    "trainer_class",
]

_RECIPE_NAMES = ", ".join(method.recipe_name for method in METHODS.values())


class RecipeError(ValueError):
    """A recipe that cannot be parsed or built; the message names the file, the key and the fix."""


@dataclass
class TrainScriptArguments(ScriptArguments):
    """TRL's ``ScriptArguments`` (dataset name, config and splits) plus what selects and feeds a trl-ext trainer.

    Parameters:
        trainer: the method, ``stepwise_rlm``, ``judge_credit``, ``rlmt`` or ``grpo`` (`trl_ext.methods.METHODS`).
        reward_funcs: reward functions: import paths, built-in names or ``{path, kwargs}`` mappings (YAML).
        reward_models: sequence-classification reward models (Hub ids or paths) that TRL loads and scores the whole
            completion with (not for ``rlmt``: set ``reward_model_name_or_path``, which scores the response only).
        monitors: attach `trl_ext.default_monitors` (clip rate / IPO mask, entropy and KL, reward).
        monitor_action: the monitors' action: ``warn``, ``checkpoint`` or ``stop`` (collapses always stop).
        save_plot: draw ``monitors.png`` in ``output_dir`` after training (needs matplotlib).
    """

    trainer: str = field(
        default="grpo",
        metadata={"help": f"Which trl-ext trainer: {_RECIPE_NAMES} (grpo: ExtGRPOTrainer)."},
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
        """The recipe's ``trainer:`` value (``stepwise_rlm``)."""
        return self.script_args.trainer

    @property
    def method(self) -> Method:
        """The method ``trainer:`` names (`trl_ext.methods.METHODS`)."""
        return method_for_recipe(self.trainer)


def read_trainer_name(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> str:
    """The ``trainer`` of a recipe file (a ``--trainer`` override wins); `RecipeError`, naming the choices, if it is
    not a method's recipe name (`trl_ext.methods.Method.recipe_name`)."""
    mapping = _read_yaml(Path(path))
    name = mapping.get("trainer", "grpo")
    args = list(overrides)
    if "--trainer" in args and args.index("--trainer") + 1 < len(args):
        name = args[args.index("--trainer") + 1]
    try:
        method_for_recipe(name)
    except ValueError as error:
        raise RecipeError(f"{path}: {error}") from None
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
    config = config_class(method_for_recipe(name))
    dataclass_types = (TrainScriptArguments, config, ModelConfig, DatasetMixtureConfig)
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


def data_file_builder(name: str | None) -> str | None:
    """The `load_dataset` builder of ``name`` when it names a local data file (``train.jsonl``), else None."""
    if not isinstance(name, str):
        return None
    suffixes = [suffix.lower() for suffix in Path(name).suffixes]
    if suffixes and suffixes[-1] in (".gz", ".bz2", ".xz", ".zst", ".zip"):  # train.jsonl.gz
        suffixes = suffixes[:-1]
    return DATA_FILE_BUILDERS.get(suffixes[-1]) if suffixes else None


def check_data_file(source: Path | None, name: str, flag: str) -> None:
    """`RecipeError` unless the data file ``name`` (given as ``flag`` in the recipe ``source``) exists."""
    if not Path(name).is_file():
        raise RecipeError(
            f"{source}: {flag} {name!r}: no such data file (looked in {Path(name).absolute().parent}). Pass an "
            "existing JSON lines / JSON / CSV / Parquet file, a dataset folder, or a Hub dataset id."
        )


def _local_data_file_config(source: Path | None, config: Any) -> Any:
    """A ``datasets:`` entry whose ``path`` is a local data file (``--datasets train.jsonl``, as TRL's command line
    gives it) -> ``{path: json, data_files: train.jsonl}``, what `load_dataset` needs for a file."""
    builder = data_file_builder(config.path)
    if builder is None:
        return config
    check_data_file(source, config.path, "datasets entry")
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
        owner = [
            method.recipe_name
            for method in METHODS.values()
            if method.recipe_name != trainer and key in _field_names(config_class(method))
        ]
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


def config_class(method: Method) -> type:
    """The config class of ``method`` (imports `trl_ext.trainers`)."""
    return getattr(importlib.import_module("trl_ext.trainers"), method.config)


def trainer_class(method: Method) -> type:
    """The trainer class of ``method`` (imports `trl_ext.trainers`)."""
    return getattr(importlib.import_module("trl_ext.trainers"), method.trainer)
