"""``trl_ext_run.json``: the one summary of a training run, written by ``trl-ext train`` and ``trl-ext quickstart``
and read by ``trl-ext push`` for the model card.

One schema, `RunInfo` (a JSON object, ``schema_version`` 1):

==================  =============================================================================================
key                 value
==================  =============================================================================================
``schema_version``  ``1``
``source``          what wrote the file: ``"trl-ext train"``, ``"trl-ext quickstart"`` (or your own script's name)
``method``          the trl-ext method (`trl_ext.methods.METHODS`): ``"stepwise-rlm"``, ``"judge-credit"``,
                    ``"rlmt"`` or ``"grpo"``
``trainer``         the trainer class name, e.g. ``"StepwiseRLMTrainer"``
``base_model``      the model the run started from: a Hub id, a local path, or a description
``dataset``         the training data: a Hub id, a list of data files/ids (mixtures), or a description
``reward_funcs``    names of the reward functions
``config``          the trainer config fields the run chose that differ from the class defaults (bookkeeping left
                    out: `is_setting_choice`; `config_summary`)
``peft``            LoRA settings (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``), or null
``metrics``         the final value of each logged metric (``reward``, ``ipo/masked_ratio``, ``eval/...``)
``steps``           optimizer steps run
``alerts``          rule -> how many times the monitors fired it (rules that never fired left out)
``alert_log``       the fired alerts, ``{"monitor", "rule", "step", "value", "action"}``, by step
``sandbox``         what the run's Python REPLs were isolated from (`trl_ext.rlm.sandbox.isolation_report`), or null
``extra``           whatever only one source knows: ``trl-ext train`` puts ``recipe`` (the YAML file's path);
                    ``trl-ext quickstart`` puts ``settings`` (its `QuickstartSettings`) and ``result`` (its
                    `QuickstartResult`, with the before/after evaluations)
==================  =============================================================================================

`write_run_info` writes it (the one writer: ``trl-ext train`` and ``trl-ext quickstart`` each build a `RunInfo` and
call it), `read_run_info` reads it back (keys it does not know land in ``extra``); `config_summary` gives
``config``, `collect_monitor_alerts` gathers ``alerts``/``alert_log`` from a trainer's monitors and
`last_logged_metrics` the ``metrics`` from its log history. ``PLOT_FILE`` (``monitors.png``) is the run's other
summary file, drawn next to it and uploaded with it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .jsonl import write_json_atomic
from .methods import METHODS

__all__ = [
    "PLOT_FILE",
    "RUN_INFO_FILE",
    "RunInfo",
    "collect_monitor_alerts",
    "config_summary",
    "is_setting_choice",
    "last_logged_metrics",
    "read_run_info",
    "write_run_info",
]

RUN_INFO_FILE = "trl_ext_run.json"
PLOT_FILE = "monitors.png"
SCHEMA_VERSION = 1


# Trainer-config fields that are not choices about the training itself: where and how the run logs, saves, reports
# and uploads, the machine it ran on, values derived from other fields, secrets and endpoints. Left out of the run
# file's ``config`` and of the model card's "settings chosen for this run".
_NOT_CHOICES = frozenset(
    {
        "output_dir",
        "overwrite_output_dir",
        "run_name",
        "report_to",
        "disable_tqdm",
        "use_cpu",
        "resume_from_checkpoint",
        "push_to_hub",
        "accelerator_config",
        "debug",
        "deepspeed",
        "model_init_kwargs",  # built by `trl-ext train` from the model arguments
        "generation_batch_size",  # derived: per_device_train_batch_size x processes x steps_per_generation
        "gradient_checkpointing",  # memory, not the training: the same steps either way
        "activation_checkpointing",
        "gradient_checkpointing_kwargs",
        "vllm_gpu_memory_utilization",
        "judge_base_url",
        "judge_api_key_env",
        "vllm_server_base_url",
        "vllm_server_host",
        "vllm_server_port",
    }
)
_NOT_CHOICE_PREFIXES = ("logging_", "save_", "hub_", "dataloader_", "ddp_", "fsdp", "_")


def trust_region_summary_key(metric: str) -> str:
    """The run file's key for the mean of a loss's trust-region metric over training:
    ``"ipo/masked_ratio"`` -> ``"train/ipo_masked_ratio_mean"``."""
    return f"train/{metric.replace('/', '_')}_mean"


def is_setting_choice(name: str) -> bool:
    """Whether the config field ``name`` is a choice about the training (learning rate, loss, group size, ...)
    rather than bookkeeping (output and logging folders, run name, saving, reporting, the Hub, tokens, endpoints,
    the machine, derived values): what the run file's ``config`` and the model card list."""
    return (
        name not in _NOT_CHOICES
        and not name.startswith(_NOT_CHOICE_PREFIXES)
        and not name.endswith("_token")  # secrets (max_prompt_tokens is a choice)
        and "api_key" not in name
    )


def config_summary(config: Any, set_keys: Collection[str] | None = None) -> dict[str, Any]:
    """The training choices of a trainer config: the fields that differ from the class defaults (JSON-safe), without
    bookkeeping (`is_setting_choice`: folders, logging, saving, the Hub, endpoints, secrets, the machine, derived
    values). With ``set_keys`` (the keys a recipe file and its command line set), only those: values the config
    computed itself are not choices. ``loss_type`` is always kept. The ``config`` of the run file and the model
    card."""
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


@dataclass
class RunInfo:
    """The content of ``trl_ext_run.json`` (see the module docstring for every key)."""

    source: str = field(metadata={"help": 'What wrote the file, e.g. "trl-ext train" or "trl-ext quickstart".'})
    method: str | None = field(
        default=None, metadata={"help": 'The trl-ext method: "stepwise-rlm", "judge-credit", "rlmt" or "grpo".'}
    )
    trainer: str | None = field(default=None, metadata={"help": 'Trainer class name, e.g. "StepwiseRLMTrainer".'})
    base_model: str | None = field(
        default=None, metadata={"help": "The model the run started from: Hub id, local path or description."}
    )
    dataset: str | list[str] | None = field(
        default=None, metadata={"help": "Training data: Hub id, list of files/ids (mixtures) or description."}
    )
    reward_funcs: list[str] = field(default_factory=list, metadata={"help": "Names of the reward functions."})
    config: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Trainer config fields that differ from the class defaults."}
    )
    peft: dict[str, Any] | None = field(
        default=None, metadata={"help": "LoRA settings (r, lora_alpha, lora_dropout, target_modules), or None."}
    )
    metrics: dict[str, Any] = field(default_factory=dict, metadata={"help": "Final value of each logged metric."})
    steps: int | None = field(default=None, metadata={"help": "Optimizer steps run."})
    alerts: dict[str, int] = field(
        default_factory=dict, metadata={"help": "Monitor rule -> times fired (rules that never fired left out)."}
    )
    alert_log: list[dict[str, Any]] = field(
        default_factory=list, metadata={"help": 'Fired alerts {"monitor", "rule", "step", "value", "action"}.'}
    )
    sandbox: dict[str, Any] | None = field(
        default=None, metadata={"help": "What the run's REPLs were isolated from (isolation_report), or None."}
    )
    extra: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "Source-specific data: train -> recipe; quickstart -> settings, result."},
    )
    schema_version: int = field(default=SCHEMA_VERSION, metadata={"help": "Version of this schema."})

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in METHODS:
            raise ValueError(
                f"RunInfo.method={self.method!r} is not a trl-ext method; use one of {', '.join(METHODS)} (or None)."
            )
        self.alerts = {rule: int(count) for rule, count in sorted(self.alerts.items()) if count}
        self.alert_log = sorted(self.alert_log, key=lambda record: record.get("step") or 0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """Indented JSON; values JSON cannot hold (paths, enums) are written as strings."""
        return json.dumps(self.to_dict(), indent=2, default=str) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunInfo:
        """Read a run file's object; keys this schema does not have are kept in ``extra``."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{RUN_INFO_FILE} must hold a JSON object, got {type(data).__name__}.")
        names = {item.name for item in dataclasses.fields(cls)}
        known = {key: value for key, value in data.items() if key in names and value is not None}
        extra = {**{key: value for key, value in data.items() if key not in names}, **(known.pop("extra", {}) or {})}
        known.setdefault("source", "unknown")
        return cls(**known, extra=extra)

    @classmethod
    def from_json(cls, text: str) -> RunInfo:
        return cls.from_dict(json.loads(text))


def write_run_info(output_dir: str | os.PathLike[str], info: RunInfo) -> Path:
    """Write ``OUTPUT_DIR/trl_ext_run.json`` atomically (`trl_ext.jsonl.write_json_atomic`); returns its path.

    Raises:
        OSError: the file could not be written (e.g. disk full); a previous run file is left as it was.
    """
    return write_json_atomic(Path(output_dir) / RUN_INFO_FILE, info.to_json())


def read_run_info(path: str | os.PathLike[str]) -> RunInfo:
    """Read ``trl_ext_run.json`` (``path`` is the file or the folder holding it).

    Raises:
        FileNotFoundError: no run file there.
        ValueError: the file is not a JSON object.
    """
    path = Path(path)
    if path.is_dir():
        path = path / RUN_INFO_FILE
    return RunInfo.from_json(path.read_text(encoding="utf-8"))


def collect_monitor_alerts(source: Any) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """``(alerts, alert_log)`` of the run file from the monitors (`trl_ext.callbacks.MonitorCallback`) of a trainer,
    or of an iterable of callbacks: counts summed per rule over the monitors (rules that never fired left out), and
    every kept alert record tagged with its monitor's class name, by step."""
    from .callbacks import MonitorCallback

    handler = getattr(source, "callback_handler", None)
    callbacks: Iterable[Any] = handler.callbacks if handler is not None else source
    alerts: dict[str, int] = {}
    alert_log: list[dict[str, Any]] = []
    for callback in callbacks:
        if isinstance(callback, MonitorCallback):
            for rule, count in callback.alert_counts.items():
                alerts[rule] = alerts.get(rule, 0) + count
            alert_log.extend({"monitor": type(callback).__name__, **record} for record in callback.alerts)
    fired = {rule: count for rule, count in sorted(alerts.items()) if count}
    return fired, sorted(alert_log, key=lambda record: record.get("step") or 0)


def last_logged_metrics(log_history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The last logged value of every numeric metric in a trainer's ``state.log_history`` (``epoch`` and ``step``
    left out)."""
    metrics: dict[str, Any] = {}
    for entry in log_history:
        for key, value in entry.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("epoch", "step"):
                metrics[key] = value
    return metrics
