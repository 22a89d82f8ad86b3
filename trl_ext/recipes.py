"""YAML recipes (``trl-ext train CONFIG.yaml``), the format and its parsing: TRL's conventions (`trl.TrlParser`, as
in ``trl grpo --config``).

A recipe is one flat YAML mapping, exactly like the files TRL's scripts read, plus one key, ``trainer``, that picks
the method (`trl_ext.methods.METHODS`, written with underscores: ``stepwise_rlm``, ``judge_credit``, ``rlmt``,
``grpo``) and so its config and trainer classes. ``asynchronous: true`` picks the method's asynchronous classes
instead (on TRL's experimental `AsyncGRPOTrainer`, docs/async.md: ``grpo`` -> `ExtAsyncGRPOConfig` /
`ExtAsyncGRPOTrainer`, ``stepwise_rlm`` -> `AsyncStepwiseRLMConfig` / `AsyncStepwiseRLMTrainer`, ...); the config
keys are then that config's fields (``max_staleness``, ``vllm_server_base_url``, ...).

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
    "read_asynchronous",
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
        asynchronous: train with the method's asynchronous trainer (TRL's experimental ``AsyncGRPOTrainer``, against
            a running ``vllm serve``; docs/async.md); its config's fields (``max_staleness``,
            ``vllm_server_base_url``, ...) become recipe keys.
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
    asynchronous: bool = field(
        default=False,
        metadata={
            "help": "Train with the method's asynchronous trainer (grpo: ExtAsyncGRPOTrainer, stepwise_rlm: "
            "AsyncStepwiseRLMTrainer, ...; TRL's experimental AsyncGRPOTrainer): a rollout worker generates against "
            "a running `vllm serve` (vllm_server_base_url) while the trainer trains, on samples up to max_staleness "
            "policy versions old (docs/async.md). The config is then the asynchronous one: its fields "
            "(max_staleness, vllm_server_base_url, weight_sync_steps, ...) are recipe keys."
        },
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

    @property
    def asynchronous(self) -> bool:
        """Whether the recipe trains with the method's asynchronous trainer (``asynchronous: true``)."""
        return self.script_args.asynchronous


def read_trainer_name(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> str:
    """The ``trainer`` of a recipe file (a ``--trainer`` override wins); `RecipeError`, naming the choices, if it is
    not a method's recipe name (`trl_ext.methods.Method.recipe_name`)."""
    mapping = _read_yaml(Path(path))
    name = _override_value(overrides, "trainer", mapping.get("trainer", "grpo"))
    try:
        method_for_recipe(name)
    except ValueError as error:
        raise RecipeError(f"{path}: {error}") from None
    return name


def read_asynchronous(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> bool:
    """The ``asynchronous`` of a recipe file (an ``--asynchronous [true|false]`` override wins; the flag alone means
    true, as TRL's parser reads it); `RecipeError` unless it is a boolean."""
    value = _override_value(overrides, "asynchronous", _read_yaml(Path(path)).get("asynchronous", False))
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _BOOLEANS:
        return _BOOLEANS[value.lower()]
    raise RecipeError(f"{path}: asynchronous={value!r} is not a boolean; write `asynchronous: true` or `false`.")


# The strings TRL's parser reads as booleans (transformers' string_to_bool).
_BOOLEANS = {"yes": True, "true": True, "t": True, "y": True, "1": True}
_BOOLEANS |= {"no": False, "false": False, "f": False, "n": False, "0": False}


def _override_value(overrides: Sequence[str], key: str, default: Any) -> Any:
    """The value the last ``--key value`` / ``--key=value`` of ``overrides`` gives ``key`` (``True`` for a bare
    ``--key``, as TRL's parser reads a boolean flag), else ``default``."""
    value = default
    args = list(overrides)
    for index, token in enumerate(args):
        if token == f"--{key}":
            following = args[index + 1] if index + 1 < len(args) else None
            value = True if following is None or following.startswith("--") else following
        elif token.startswith(f"--{key}="):
            value = token.split("=", 1)[1]
    return value


def parse_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Recipe:
    """Parse a recipe file into its dataclasses, with ``--key value`` overrides, the way ``trl <cmd> --config`` does.

    Raises:
        RecipeError: missing/unreadable file, unknown trainer, unknown keys or invalid values (the config classes'
            own checks), with the file name.
    """
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

    path = Path(path)
    name = read_trainer_name(path, overrides)
    asynchronous = read_asynchronous(path, overrides)
    config = config_class(method_for_recipe(name), asynchronous=asynchronous, source=path)
    # A field the config shares with `ModelConfig` (TRL's async config has `dtype`, with the same meaning) is one
    # key: the config parses it, and `ModelConfig` gets the same value below.
    shared = sorted(_field_names(config) & _field_names(ModelConfig))
    dataclass_types = (TrainScriptArguments, config, _parsed_without(ModelConfig, shared), DatasetMixtureConfig)
    mapping = _read_yaml(path)
    _check_keys(path, name, mapping, dataclass_types, asynchronous)
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
    for key in shared:
        setattr(model_args, key, getattr(training_args, key))
    if script_args.asynchronous != asynchronous:  # the classes were picked before parsing: they must agree
        raise RecipeError(
            f"{path}: asynchronous={script_args.asynchronous!r} after parsing, but the recipe was read as "
            f"asynchronous={asynchronous!r}; write it as `asynchronous: true` (or false) in the file, or "
            "`--asynchronous true` on the command line."
        )
    given = override_keys(overrides)
    if "dataset_name" in given and "datasets" not in given and dataset_args.datasets:
        dataset_args.datasets = []  # the command line wins over the file: `--dataset_name` replaces its `datasets:`
    dataset_args.datasets = [_local_data_file_config(path, config) for config in dataset_args.datasets]
    set_keys = (set(mapping) | given) - {"env"}
    return Recipe(script_args, training_args, model_args, dataset_args, source=path, set_keys=set_keys)


def _parsed_without(cls: type, names: Sequence[str]) -> type:
    """``cls``, or when ``names`` are given a subclass of it (same name) whose fields ``names`` are not parsed
    (``init=False``: TRL's parser skips them) and keep their defaults until set."""
    if not names:
        return cls
    fields = {item.name: item for item in dataclasses.fields(cls)}
    own = [(name, fields[name].type, field(default=fields[name].default, init=False)) for name in names]
    return dataclasses.make_dataclass(cls.__name__, own, bases=(cls,))


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


def _check_keys(
    path: Path, trainer: str, mapping: Mapping[str, Any], dataclass_types: Sequence[type], asynchronous: bool = False
) -> None:
    """Unknown keys are a typo, a field of the same method's other trainer (synchronous or asynchronous) or another
    trainer's field: say which, with the closest known names."""
    import difflib

    known = {"env"} | {item.name for cls in dataclass_types for item in dataclasses.fields(cls)}
    unknown = [key for key in mapping if key not in known]
    if not unknown:
        return
    other_mode = _existing_config_class(method_for_recipe(trainer), not asynchronous)
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1)
        owner = [
            method.recipe_name
            for method in METHODS.values()
            if method.recipe_name != trainer and key in _field_names(config_class(method))
        ]
        if other_mode is not None and key in _field_names(other_mode):
            if asynchronous:
                hints.append(
                    f"{key!r} (a field of the synchronous trainer's {other_mode.__name__}, not of the asynchronous "
                    "one's: remove it, or `asynchronous: false`)"
                )
            else:
                hints.append(f"{key!r} (a field of the asynchronous {other_mode.__name__}: set `asynchronous: true`)")
        elif owner:
            hints.append(f"{key!r} (a field of trainer {owner[0]!r})")
        elif close:
            hints.append(f"{key!r} (did you mean {close[0]!r}?)")
        else:
            hints.append(repr(key))
    names = ", ".join(cls.__name__ for cls in dataclass_types)
    mode = "asynchronous " if asynchronous else ""
    raise RecipeError(
        f"{path}: unknown key(s) for {mode}trainer {trainer!r}: {'; '.join(hints)}. Valid keys: fields of {names}."
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


def config_class(method: Method, asynchronous: bool = False, source: Path | None = None) -> type:
    """The config class of ``method``, its asynchronous one with ``asynchronous`` (imports `trl_ext.trainers`).

    Raises:
        RecipeError: ``asynchronous`` for a method without an asynchronous trainer, or whose asynchronous classes
            this trl-ext does not have (yet); the message names the recipe ``source``, the class and the fix.
    """
    return _trainers_class(method, asynchronous, 1, source)


def trainer_class(method: Method, asynchronous: bool = False, source: Path | None = None) -> type:
    """The trainer class of ``method``, its asynchronous one with ``asynchronous`` (imports `trl_ext.trainers`);
    `RecipeError` as `config_class`."""
    return _trainers_class(method, asynchronous, 0, source)


def _trainers_class(method: Method, asynchronous: bool, index: int, source: Path | None) -> type:
    """Class ``index`` (0 trainer, 1 config) of `Method.classes`, from `trl_ext.trainers`."""
    where = f"{source}: " if source else ""
    name = method.classes(asynchronous)[index]
    if name is None:
        raise RecipeError(
            f"{where}trainer {method.recipe_name!r} has no asynchronous trainer; remove `asynchronous: true` to "
            f"train it synchronously ({method.trainer}), or pick one of {_async_choices()}."
        )
    cls = _trainers_attribute(name)
    if cls is not None:
        return cls
    if not asynchronous:
        raise AttributeError(f"trl_ext.trainers has no {name}, the {method.tag} method's class (trl_ext.methods).")
    raise RecipeError(
        f"{where}`asynchronous: true` with trainer {method.recipe_name!r} needs {name}, which this trl-ext does "
        f"not have yet (trl_ext.trainers has no {name}). Remove `asynchronous: true` to train it synchronously "
        f"({method.trainer}), or pick a trainer whose asynchronous version exists: {_async_choices()}."
    )


def _trainers_attribute(name: str) -> type | None:
    """``trl_ext.trainers.<name>`` (imported on first access), or None when there is none."""
    return getattr(importlib.import_module("trl_ext.trainers"), name, None)


def _existing_config_class(method: Method, asynchronous: bool) -> type | None:
    """The config class of ``method`` in that mode, or None when it has none (yet)."""
    name = method.classes(asynchronous)[1]
    return None if name is None else _trainers_attribute(name)


def _async_choices() -> str:
    """The recipe names of the methods whose asynchronous classes exist, for error messages."""
    names = [
        method.recipe_name
        for method in METHODS.values()
        if all(name is not None and _trainers_attribute(name) is not None for name in method.classes(True))
    ]
    return ", ".join(names) or "none"
