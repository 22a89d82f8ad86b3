"""`MonitorCallback`: the base of the trl-ext monitors (settings, rule memories, alert episodes, actions, logging,
state export and restore); the monitors themselves are in `trl_ext.callbacks.monitors` (docs/monitoring.md).

A monitor is a `transformers.TrainerCallback` that reads the averaged metrics the trainer logs in ``on_log``, feeds
each value to its rules (pure functions of `trl_ext.callbacks.rules`, with the settings of
`trl_ext.callbacks.configs`) and raises *alerts* (texts as data in `trl_ext.callbacks.alerts`):

- A rule whose metric is absent from a log is idle for that log (no crash, no streak change), so every
  monitor works with any subset of the keys and ignores eval logs (their keys carry an ``eval_`` prefix).
- An alert fires when its condition becomes true and stays silent while the condition persists; it can fire
  again once the condition has cleared (`episode_starts`).
- Each alert is logged once (logger ``trl_ext.callbacks``, main process only), written into the log as
  ``monitor/alerts/<rule> = 1.0`` and triggers the rule's action: ``"warn"`` (log only), ``"checkpoint"``
  (``control.should_save``) or ``"stop"`` (``control.should_training_stop``).
- Logs are identical on every rank, and the rules are deterministic functions of the logs, so every rank
  takes the same decision; only the main process speaks.
- The state (each rule's memory: rolling windows, streaks, levels; episodes; alert counts) is exported with
  `ExportableState` into ``trainer_state.json`` and restored on resume (see `MonitorCallback.on_train_begin`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from .alerts import MonitorAlert, format_alert
from .configs import check_int, is_number
from .rules import Finding, RuleResult, episode_starts

logger = logging.getLogger("trl_ext.callbacks")

__all__ = ["ACTIONS", "MonitorCallback", "check_action", "metric_value"]

ACTIONS = ("warn", "checkpoint", "stop")
_MAX_ALERT_RECORDS = 100  # alert records kept in the exported state (the counts are exact)

Rule = Callable[..., RuleResult]  # a function of `trl_ext.callbacks.rules`, named after its rule


def check_action(owner: str, name: str, value: Any) -> str:
    """``value`` when it is one of `ACTIONS`, else a ValueError naming the setting and the choices."""
    if value not in ACTIONS:
        raise ValueError(
            f"{owner}: {name}={value!r} is not an action; use one of {', '.join(repr(a) for a in ACTIONS)} "
            f"(e.g. {name}='warn')."
        )
    return value


def metric_value(logs: Mapping[str, Any], key: str) -> float | None:
    """The finite float logged under ``key``, or None when absent, None or not finite (rule idle)."""
    value = logs.get(key)
    if value is None or isinstance(value, (bool, str)):
        return None
    if not is_number(value):
        try:  # numpy / torch scalars
            value = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor with several elements
            return None
    value = float(value)
    return value if math.isfinite(value) else None


# ----------------------------------------------------------------------------------------------------------------


class MonitorCallback(TrainerCallback, ExportableState):
    """Base class of the trl-ext monitors: settings, rule memories, episodes, actions, logging, state export/restore.

    Subclasses declare their ``rules`` (names), ``config_class`` (a ``*MonitorConfig`` of `trl_ext.callbacks.rules`)
    and either ``rule_metrics`` (pairs of a rule function and the config field naming its logged key, evaluated in
    that order on every log holding the key) or their own `_check`.

    Args:
        config: the monitor's settings; None builds them from ``**settings`` (the config's fields as keywords,
            e.g. ``ClipRateMonitor(healthy_max=0.15)``); keywords given with a config override its fields.
        action: default action of every rule: ``"warn"`` (log a warning), ``"checkpoint"`` (also save a
            checkpoint now) or ``"stop"`` (also stop training after this step).
        actions: per-rule overrides, e.g. ``{"entropy_collapse": "stop"}``; keys must be rules of this monitor.
        start_step: rules stay silent before this global step (values are still recorded, so streaks and
            baselines are ready). Set it to the warm-up length when the learning rate starts at 0.
        rearm_after: after a rule fired, its condition must be false for this many consecutive observations
            before it can fire again (no chatter when a value hovers around a threshold).

    The settings can be read as attributes too (``monitor.healthy_max`` is ``monitor.config.healthy_max``).
    """

    rules: ClassVar[tuple[str, ...]] = ()
    config_class: ClassVar[type | None] = None
    rule_metrics: ClassVar[tuple[tuple[Rule, str], ...]] = ()
    # Its alerts go into the log: the trl-ext trainers put it ahead of the loggers (`trl_ext.callback_order`).
    runs_before_loggers: ClassVar[bool] = True

    def __init__(
        self,
        config: Any = None,
        *,
        action: str = "warn",
        actions: Mapping[str, str] | None = None,
        start_step: int = 0,
        rearm_after: int = 3,
        **settings: Any,
    ):
        owner = type(self).__name__
        self.config = self._build_config(config, settings)
        self.action = check_action(owner, "action", action)
        if actions is not None and not isinstance(actions, Mapping):
            raise TypeError(
                f"{owner}: actions={actions!r} must be a dict rule -> action, e.g. {{'{self.rules[0]}': 'stop'}}."
            )
        self.actions = dict(actions or {})
        for rule, rule_action in self.actions.items():
            if rule not in self.rules:
                raise ValueError(
                    f"{owner}: actions has unknown rule {rule!r}; the rules of {owner} are {', '.join(self.rules)}."
                )
            check_action(owner, f"actions[{rule!r}]", rule_action)
        self.start_step = check_int(owner, "start_step", start_step, 0, 0)
        self.rearm_after = check_int(owner, "rearm_after", rearm_after, 1, 3)
        self.monitor_state: dict[str, Any] = self._fresh_state()
        self._context: dict[str, Any] = {}  # run facts for the messages (args), not exported
        self._stop_rule: str | None = None  # rule that stopped this session's training, if any

    def _build_config(self, config: Any, settings: dict[str, Any]) -> Any:
        owner, config_class = type(self).__name__, self.config_class
        if config_class is None:
            if config is not None or settings:
                raise TypeError(f"{owner} has no settings besides action, actions, start_step and rearm_after.")
            return None
        if config is not None and not isinstance(config, config_class):
            raise TypeError(
                f"{owner}: config={config!r} must be a {config_class.__name__}; pass e.g. "
                f"{owner}({config_class.__name__}()) or the settings as keywords."
            )
        names = [f.name for f in dataclasses.fields(config_class)]
        unknown = [name for name in settings if name not in names]
        if unknown:
            raise TypeError(
                f"{owner}: unknown setting(s) {', '.join(map(repr, unknown))}; the settings of {owner} are "
                f"{', '.join(names)} ({config_class.__name__}), action, actions, start_step and rearm_after."
            )
        if config is None:
            return config_class(**settings)
        return dataclasses.replace(config, **settings) if settings else config

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: the settings, read as attributes.
        config = self.__dict__.get("config")
        if config is not None and name in {f.name for f in dataclasses.fields(config)}:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- subclass interface ------------------------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        """The constructor arguments, JSON-serialisable (exported with the state; a restore rebuilds from them)."""
        settings = dataclasses.asdict(self.config) if self.config is not None else {}
        return {
            **settings,
            "action": self.action,
            "actions": dict(self.actions) or None,
            "start_step": self.start_step,
            "rearm_after": self.rearm_after,
        }

    def _initial_extra_state(self) -> dict[str, Any]:
        return {}

    def _check(self, logs: Mapping[str, Any], step: int) -> list[tuple[Finding, str]]:
        """The (finding, metric key) pairs that raise an alert at this log: each rule of ``rule_metrics`` is fed
        the value of its key when the log holds one."""
        fired = []
        for rule, key_field in self.rule_metrics:
            metric = getattr(self.config, key_field)
            value = metric_value(logs, metric)
            if value is None:
                continue
            if (finding := self._evaluate(rule, value, step, **self._rule_kwargs(rule))) is not None:
                fired.append((finding, metric))
        return fired

    def _rule_kwargs(self, rule: Rule) -> dict[str, Any]:
        """Settings of ``rule`` that the monitor derives from the run (`_configure`), passed as keywords."""
        return {}

    def _configure(self, args: TrainingArguments, state: TrainerState) -> None:
        """Read run facts from the training arguments at train begin."""
        self._context["learning_rate"] = getattr(args, "learning_rate", None)

    def _message(self, finding: Finding, metric: str, fields: Mapping[str, Any]) -> str:
        """The alert's message: its template in `trl_ext.callbacks.alerts.ALERTS`, filled in."""
        return format_alert(
            finding.rule, {**fields, **finding.facts, "metric": metric, "value": finding.value}, finding.variant
        )

    # -- state -------------------------------------------------------------------------------------------------
    def _fresh_state(self) -> dict[str, Any]:
        return {
            "last_step": -1,
            "alert_counts": {rule: 0 for rule in self.rules},
            "alerts": [],
            "active": {rule: False for rule in self.rules},
            "clear_streaks": {rule: 0 for rule in self.rules},
            "memory": {},
            **self._initial_extra_state(),
        }

    def reset(self) -> None:
        """Forget every observation and alert (a fresh run)."""
        self.monitor_state = self._fresh_state()

    @property
    def alert_counts(self) -> dict[str, int]:
        """How many times each rule fired in this run (restored on resume)."""
        return dict(self.monitor_state["alert_counts"])

    @property
    def alerts(self) -> list[dict[str, Any]]:
        """The latest fired alerts as ``{"rule", "step", "value", "action"}`` records (at most 100 kept)."""
        return [dict(a) for a in self.monitor_state["alerts"]]

    def state(self) -> dict[str, Any]:
        """`ExportableState` export: constructor arguments and the JSON-serialisable monitor state."""
        return {"args": self._config(), "attributes": {"monitor_state": copy.deepcopy(self.monitor_state)}}

    def _evaluate(self, rule: Rule, value: float, step: int, **kwargs: Any) -> Finding | None:
        """Feed one observation to ``rule`` (continuing its memory); the finding when it starts an alert episode."""
        name, st = rule.__name__, self.monitor_state
        result = rule([value], [step], self.config, st["memory"].get(name), **kwargs)
        st["memory"][name] = result.memory
        episode = episode_starts(
            result.findings,
            [step],
            rearm_after=self.rearm_after,
            start_step=self.start_step,
            memory={"active": st["active"].get(name, False), "clear": st["clear_streaks"].get(name, 0)},
        )
        st["active"][name], st["clear_streaks"][name] = episode.memory["active"], episode.memory["clear"]
        return episode.findings[0] if episode.findings else None

    # -- the rule engine, usable without a Trainer -------------------------------------------------------------
    def observe(self, logs: Mapping[str, Any], step: int) -> list[MonitorAlert]:
        """Feed one log (the dict `on_log` receives) and return the alerts it fires.

        This is what `on_log` calls; it takes no action, so rules can be tested on synthetic log sequences.
        """
        fired = self._check(logs, step)
        self.monitor_state["last_step"] = step
        if not fired:
            return []
        learning_rate = metric_value(logs, "learning_rate")
        if learning_rate is None:
            learning_rate = self._context.get("learning_rate")
        fields = {**self._config(), **self._context, "learning_rate": learning_rate}
        alerts = []
        for finding, metric in fired:
            action = self.actions.get(finding.rule, self.action)
            message = self._message(finding, metric, fields)
            alert = MonitorAlert(finding.rule, step, metric, finding.value, action, message)
            self.monitor_state["alert_counts"][finding.rule] = (
                self.monitor_state["alert_counts"].get(finding.rule, 0) + 1
            )
            records = self.monitor_state["alerts"]
            records.append({"rule": finding.rule, "step": step, "value": finding.value, "action": action})
            del records[: max(0, len(records) - _MAX_ALERT_RECORDS)]
            alerts.append(alert)
        return alerts

    # -- TrainerCallback hooks ---------------------------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        """Configure from ``args``; start fresh, or restore the state saved in the checkpoint being resumed.

        Restoring does not depend on ``TrainingArguments.restore_callback_states_from_checkpoint`` (off by
        default): on resume ``state.stateful_callbacks`` is the checkpoint's, and the monitor takes its own
        entry from there (the newest entry with the same constructor arguments).
        """
        self._stop_rule = None
        self._configure(args, state)
        if state.global_step == 0:
            self.reset()
            return
        saved = self._saved_state(state)
        if saved is None:
            self.reset()
            if state.is_world_process_zero:
                logger.info(
                    "%s: resuming at step %d without saved monitor state in the checkpoint; starting fresh.",
                    type(self).__name__,
                    state.global_step,
                )
            return
        self.monitor_state = saved
        if state.is_world_process_zero:
            logger.info(
                "%s: restored monitor state from the checkpoint (last observed step %d, alerts so far %s).",
                type(self).__name__,
                saved["last_step"],
                {k: v for k, v in saved["alert_counts"].items() if v} or "none",
            )

    def _saved_state(self, state: TrainerState) -> dict[str, Any] | None:
        """This monitor's entry in the resumed checkpoint's ``stateful_callbacks``, or None.

        The newest entry with the same constructor arguments wins (transformers appends the states of duplicated
        callback classes to a list). A single entry saved with other thresholds is still restored - the windows
        hold metric values, not decisions - so thresholds can be changed when resuming.
        """
        entries = (state.stateful_callbacks or {}).get(type(self).__name__)
        if entries is None:
            return None
        candidates = entries if isinstance(entries, list) else [entries]
        usable = [
            entry
            for entry in candidates
            if isinstance(entry, Mapping)
            and isinstance((entry.get("attributes") or {}).get("monitor_state"), Mapping)
            and entry["attributes"]["monitor_state"].get("last_step", -1) <= state.global_step
        ]
        config = self._config()
        chosen = next((entry for entry in reversed(usable) if entry.get("args") == config), None)
        if chosen is None and not isinstance(entries, list) and usable:
            chosen = usable[0]
            if state.is_world_process_zero:
                logger.info(
                    "%s: settings changed since the checkpoint; continuing its windows and counts.",
                    type(self).__name__,
                )
        if chosen is None:
            return None
        return {**self._fresh_state(), **copy.deepcopy(dict(chosen["attributes"]["monitor_state"]))}

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        if not logs:
            return control
        alerts = self.observe(logs, state.global_step)
        if not alerts:
            return control
        # `Trainer.log` appended a copy of `logs` to the history before calling the callbacks: mark it too, so
        # trainer_state.json (and `trl-ext plot`) carry the alerts.
        history_entry = state.log_history[-1] if state.log_history else None
        if history_entry is not None and history_entry.get("step") != state.global_step:
            history_entry = None
        for alert in alerts:
            logs[alert.log_key] = 1.0
            if history_entry is not None:
                history_entry[alert.log_key] = 1.0
            if alert.action == "checkpoint":
                control.should_save = True
                consequence = " Saving a checkpoint now (action='checkpoint')."
            elif alert.action == "stop":
                control.should_training_stop = True
                self._stop_rule = self._stop_rule or alert.rule
                consequence = " Stopping training (action='stop')."
            else:
                consequence = ""
            if state.is_world_process_zero:
                logger.warning(
                    "[trl-ext monitor] step %d, %s: %s%s", alert.step, alert.rule, alert.message, consequence
                )
        return control

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        counts = {rule: n for rule, n in self.monitor_state["alert_counts"].items() if n}
        if state.is_world_process_zero and counts:
            logger.info("%s: alerts during this run: %s", type(self).__name__, counts)
        if self._stop_rule is not None and args.should_save and args.output_dir:
            # No checkpoint is written when a monitor stops the run; save the history (no weights) so that
            # `trl-ext plot OUTPUT_DIR` shows the steps up to the stop.
            entries = state.stateful_callbacks if isinstance(state.stateful_callbacks, dict) else None
            if entries is not None and isinstance(entries.get(type(self).__name__), dict):
                entries[type(self).__name__] = self.state()
            os.makedirs(args.output_dir, exist_ok=True)
            state.save_to_json(os.path.join(args.output_dir, "trainer_state.json"))

    def __repr__(self) -> str:
        config = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({config})"
