"""Training monitors for GRPO-style runs: clip rate / IPO mask, entropy and KL, reward (docs/monitoring.md).

Each monitor is a `transformers.TrainerCallback` that reads the averaged metrics TRL's `GRPOTrainer` logs
(``clip_ratio/region_mean``, ``entropy``, ``kl``, ``reward``, ``frac_reward_zero_std``, and trl-ext's
``ipo/masked_ratio`` and ``judge/failure_ratio``) in ``on_log``, feeds each value to its rules and raises *alerts*.
The rules are pure functions in `trl_ext.callbacks.rules`, their settings the ``*MonitorConfig`` dataclasses there,
and the alert texts are data in `trl_ext.callbacks.alerts`; the callbacks here only wire them to the Trainer.

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import DefaultFlowCallback, ExportableState

from .alerts import ALERT_KEY_PREFIX, MonitorAlert, format_alert
from .rules import (
    CLIP_METRICS,
    ClipRateMonitorConfig,
    EntropyMonitorConfig,
    Finding,
    RewardMonitorConfig,
    RuleResult,
    check_int,
    clip_rate_drop,
    clip_rate_high,
    clip_rate_jump,
    clip_rate_low,
    clip_rate_stuck_zero,
    entropy_baseline,
    entropy_collapse,
    episode_starts,
    is_number,
    judge_failure,
    kl_spike,
    reward_collapse,
    reward_no_signal,
)

logger = logging.getLogger("trl_ext.callbacks")

__all__ = [
    "ACTIONS",
    "ALERT_KEY_PREFIX",
    "ClipRateMonitor",
    "EntropyMonitor",
    "MonitorAlert",
    "MonitorCallback",
    "RewardMonitor",
    "add_monitors",
    "default_monitors",
]

ACTIONS = ("warn", "checkpoint", "stop")
_MAX_ALERT_RECORDS = 100  # alert records kept in the exported state (the counts are exact)

Rule = Callable[..., RuleResult]  # a function of `trl_ext.callbacks.rules`, named after its rule


def _check_action(owner: str, name: str, value: Any) -> str:
    if value not in ACTIONS:
        raise ValueError(
            f"{owner}: {name}={value!r} is not an action; use one of {', '.join(repr(a) for a in ACTIONS)} "
            f"(e.g. {name}='warn')."
        )
    return value


def _metric_value(logs: Mapping[str, Any], key: str) -> float | None:
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
        self.action = _check_action(owner, "action", action)
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
            _check_action(owner, f"actions[{rule!r}]", rule_action)
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
            value = _metric_value(logs, metric)
            if value is not None and (finding := self._evaluate(rule, value, step)) is not None:
                fired.append((finding, metric))
        return fired

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
        learning_rate = _metric_value(logs, "learning_rate")
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


# ----------------------------------------------------------------------------------------------------------------


class ClipRateMonitor(MonitorCallback):
    """Watch the clip rate (``clip_ratio/region_mean``) or, under the IPO loss, the masked ratio (``ipo/masked_ratio``).

    The healthy band is 1 %–20 % (docs/monitoring.md). Outside it, or on a sudden drop or step change, the usual
    culprit is a systematic log-prob mismatch between generator and trainer; the loss curve hides such faults.

    Rules (log keys ``monitor/alerts/<rule>``; conditions and thresholds in `trl_ext.callbacks.rules`):
        - ``clip_rate_high``: above ``healthy_max`` for ``patience`` observations (`clip_rate_high`).
        - ``clip_rate_low``: below ``healthy_min`` (and not all exactly 0) for ``patience`` observations while the
          run is off-policy (`clip_rate_low`).
        - ``clip_rate_stuck_zero``: exactly 0 (``<= zero_atol``) for ``stuck_patience`` observations while the run
          is off-policy (`clip_rate_stuck_zero`).
        - ``clip_rate_drop``: falls below ``drop_factor`` × the rolling median in one observation
          (`clip_rate_drop`).
        - ``clip_rate_jump``: rises to ``jump_factor`` × the rolling median (but not above ``healthy_max``: that
          is ``clip_rate_high``) and stays there ``jump_patience`` observations (`clip_rate_jump`).

    An *observation* is the mean of ``aggregate_logs`` consecutive logs. TRL computes the ratio against log-probs
    taken at generation time, so within one generation cycle the first optimizer step is on-policy (ratio 1, clip
    rate 0) and later ones are off-policy; per-log values alternate 0, x, 0, x when ``num_iterations > 1``. With
    ``aggregate_logs=None`` the monitor averages over one generation cycle, inferred from the arguments.

    Off-policy: TRL's clip rate can only be non-zero when ``gradient_accumulation_steps`` is not a multiple of
    ``steps_per_generation × num_iterations`` (otherwise old log-probs equal the current ones, also with vLLM);
    the IPO masked ratio compares against the generator's log-probs, so it is also non-zero with ``use_vllm``.
    When the run is fully on-policy the value 0 is legitimate and the low/stuck rules stay idle.

    Args:
        config: a `ClipRateMonitorConfig` (``metric``, ``healthy_min``, ``healthy_max``, ``patience``,
            ``stuck_patience``, ``zero_atol``, ``drop_factor``, ``jump_factor``, ``jump_patience``, ``window``,
            ``min_history``, ``expect_nonzero``, ``aggregate_logs``), or its fields as keywords.
        action, actions, start_step, rearm_after: see `MonitorCallback`.
    """

    rules = ("clip_rate_high", "clip_rate_low", "clip_rate_stuck_zero", "clip_rate_drop", "clip_rate_jump")
    config_class = ClipRateMonitorConfig
    config: ClipRateMonitorConfig

    def __init__(self, config: ClipRateMonitorConfig | None = None, **kwargs: Any):
        super().__init__(config, **kwargs)
        # Effective settings; `_configure` refines them from the training arguments.
        self._expect = bool(self.config.expect_nonzero)
        self._aggregate = self.config.aggregate_logs or 1

    def _initial_extra_state(self) -> dict[str, Any]:
        return {"metric": self.config.metric, "pending": []}

    def _configure(self, args: TrainingArguments, state: TrainerState) -> None:
        super()._configure(args, state)
        ga = getattr(args, "gradient_accumulation_steps", None)
        spg = getattr(args, "steps_per_generation", None)
        num_iterations = getattr(args, "num_iterations", None)
        use_vllm = bool(getattr(args, "use_vllm", False))
        self._context.update(
            gradient_accumulation_steps=ga, steps_per_generation=spg, num_iterations=num_iterations, use_vllm=use_vllm
        )
        known = all(isinstance(x, int) and x > 0 for x in (ga, spg, num_iterations))
        if known:
            generate_every = spg * num_iterations  # micro-steps between generations
            trainer_off_policy = ga % generate_every != 0
            cycle_steps = math.lcm(ga, generate_every) // ga  # optimizer steps per generation cycle
        else:
            trainer_off_policy, cycle_steps = False, 1
        self._context["trainer_off_policy"] = trainer_off_policy
        if self.config.expect_nonzero is not None:
            self._expect = self.config.expect_nonzero
        else:
            # The IPO mask compares against the generator's log-probs, which differ from the trainer's with vLLM.
            ipo = (self.config.metric or "").startswith("ipo/") or getattr(args, "loss_type", None) == "ipo"
            self._expect = trainer_off_policy or (ipo and use_vllm)
            if not known and state.is_world_process_zero:
                logger.info(
                    "ClipRateMonitor: the training arguments lack gradient_accumulation_steps/steps_per_generation/"
                    "num_iterations; treating the run as on-policy (low and stuck-at-0 rules idle). "
                    "Pass expect_nonzero=True to enable them."
                )
        if self.config.aggregate_logs is not None:
            self._aggregate = self.config.aggregate_logs
        else:
            # args.logging_steps may be a ratio of max_steps (< 1); the Trainer has then put the steps in the state.
            logging_steps = getattr(args, "logging_steps", 1)
            if not is_number(logging_steps) or logging_steps < 1:
                logging_steps = getattr(state, "logging_steps", 1)
            logging_steps = max(1, int(logging_steps)) if is_number(logging_steps) else 1
            self._aggregate = max(1, math.ceil(cycle_steps / logging_steps))

    def _resolve_metric(self, logs: Mapping[str, Any]) -> str | None:
        chosen = self.monitor_state.get("metric")
        if chosen:
            return chosen
        for key in CLIP_METRICS:
            if _metric_value(logs, key) is not None:
                self.monitor_state["metric"] = key
                return key
        return None

    def _check(self, logs: Mapping[str, Any], step: int) -> list[tuple[Finding, str]]:
        metric = self._resolve_metric(logs)
        value = None if metric is None else _metric_value(logs, metric)
        if value is None:
            return []
        st = self.monitor_state
        st["pending"].append(value)
        if len(st["pending"]) < self._aggregate:
            return []
        x = sum(st["pending"]) / len(st["pending"])
        st["pending"] = []
        st["aggregate"] = self._aggregate  # read by `plot_run` to draw the observations
        off_policy = {"off_policy": self._expect}
        checks: tuple[tuple[Rule, dict[str, Any]], ...] = (
            (clip_rate_stuck_zero, off_policy),
            (clip_rate_low, off_policy),
            (clip_rate_high, {}),
            (clip_rate_drop, {}),
            (clip_rate_jump, {}),
        )
        fired = [self._evaluate(rule, x, step, **kwargs) for rule, kwargs in checks]
        return [(finding, metric) for finding in fired if finding is not None]


# ----------------------------------------------------------------------------------------------------------------


class EntropyMonitor(MonitorCallback):
    """Watch the policy entropy for collapse, and the KL to the reference for spikes (docs/monitoring.md).

    Rules (log keys ``monitor/alerts/<rule>``; conditions and thresholds in `trl_ext.callbacks.rules`):
        - ``entropy_collapse``: ``entropy`` below ``entropy_floor`` for ``floor_patience`` logs, or its median over
          the last ``smoothing`` logs down more than ``max_drop`` from its early level (median of the first
          ``baseline_logs`` logs) (`entropy_collapse`).
        - ``kl_spike``: ``kl`` above ``kl_max``, or above ``kl_spike_factor`` × its rolling median over the last
          ``kl_window`` logs (at least ``kl_min_history`` of them) while also above ``kl_spike_min``
          (`kl_spike`). ``kl`` is only logged when ``beta > 0``; otherwise the rule is idle.

    Args:
        config: an `EntropyMonitorConfig` (``entropy_floor``, ``floor_patience``, ``max_drop``, ``baseline_logs``,
            ``smoothing``, ``kl_max``, ``kl_spike_factor``, ``kl_spike_min``, ``kl_window``, ``kl_min_history``,
            ``entropy_metric``, ``kl_metric``), or its fields as keywords.
        action, actions, start_step, rearm_after: see `MonitorCallback`.
    """

    rules = ("entropy_collapse", "kl_spike")
    config_class = EntropyMonitorConfig
    rule_metrics = ((entropy_collapse, "entropy_metric"), (kl_spike, "kl_metric"))
    config: EntropyMonitorConfig

    @property
    def entropy_baseline(self) -> float | None:
        """The early entropy level (median of the first ``baseline_logs`` values), once known."""
        return entropy_baseline(self.monitor_state["memory"].get("entropy_collapse"), self.config)


# ----------------------------------------------------------------------------------------------------------------


class RewardMonitor(MonitorCallback):
    """Watch the reward for collapse after a rise, the learning signal, and the LLM judge's failures.

    See docs/monitoring.md and, for the judge, docs/judge_credit.md.

    Rules (log keys ``monitor/alerts/<rule>``; conditions and thresholds in `trl_ext.callbacks.rules`):
        - ``reward_collapse``: the reward, averaged over the last ``smoothing`` logs, has risen by at least
          ``min_rise`` above its earlier low, then lost more than ``max_drop`` of that gain for ``collapse_patience``
          consecutive logs, by at least ``min_drop_sigmas`` standard errors (`reward_collapse`).
        - ``reward_no_signal``: ``frac_reward_zero_std`` >= ``zero_std_max`` for ``zero_std_patience`` logs: nearly
          every group has identical rewards, so the advantages are 0 (`reward_no_signal`).
        - ``judge_failure``: ``judge/failure_ratio`` > ``judge_failure_max`` for ``judge_patience`` logs (judge credit
          runs only; `judge_failure`).

    Args:
        config: a `RewardMonitorConfig` (``smoothing``, ``min_rise``, ``max_drop``, ``collapse_patience``,
            ``min_drop_sigmas``, ``zero_std_max``, ``zero_std_patience``, ``judge_failure_max``,
            ``judge_patience``, ``reward_metric``, ``zero_std_metric``, ``judge_failure_metric``), or its fields as
            keywords.
        action, actions, start_step, rearm_after: see `MonitorCallback`.
    """

    rules = ("reward_collapse", "reward_no_signal", "judge_failure")
    config_class = RewardMonitorConfig
    rule_metrics = (
        (reward_collapse, "reward_metric"),
        (reward_no_signal, "zero_std_metric"),
        (judge_failure, "judge_failure_metric"),
    )
    config: RewardMonitorConfig


# ----------------------------------------------------------------------------------------------------------------


def default_monitors(action: str = "warn", stop_on_collapse: bool = True) -> list[MonitorCallback]:
    """The recommended monitor set: `ClipRateMonitor`, `EntropyMonitor` and `RewardMonitor` with default thresholds.

    Args:
        action: action of every rule (``"warn"``, ``"checkpoint"`` or ``"stop"``).
        stop_on_collapse: stop training on ``entropy_collapse`` and ``reward_collapse`` (a collapsed policy does
            not recover; the last regular checkpoint is the one to restart from). False keeps ``action`` for them.

    Returns:
        A list to pass as ``callbacks=`` (or to `add_monitors`, which also puts them ahead of the loggers).
    """
    _check_action("default_monitors", "action", action)
    collapse = "stop" if stop_on_collapse else action
    return [
        ClipRateMonitor(action=action),
        EntropyMonitor(action=action, actions={"entropy_collapse": collapse}),
        RewardMonitor(action=action, actions={"reward_collapse": collapse}),
    ]


def add_monitors(trainer: Any, monitors: Sequence[MonitorCallback] | None = None) -> list[MonitorCallback]:
    """Insert monitors into ``trainer``'s callbacks right after `DefaultFlowCallback`, ahead of the loggers.

    The `Trainer` calls callbacks in order and puts the reporting integrations (wandb, trackio, tensorboard, ...)
    before the ones passed as ``callbacks=``; a monitor placed after them adds its ``monitor/alerts/<rule>`` keys
    too late for that log to reach them. This helper moves the monitors (given ones, or those already in the
    trainer, or `default_monitors()` when there are none) in front.

    Returns:
        The monitors, in their new order.
    """
    handler = trainer.callback_handler
    present = [cb for cb in handler.callbacks if isinstance(cb, MonitorCallback)]
    if monitors is None:
        monitors = present or default_monitors()
    monitors = list(monitors)
    for monitor in monitors:
        if not isinstance(monitor, MonitorCallback):
            raise TypeError(
                f"add_monitors: {monitor!r} is not a trl-ext monitor (ClipRateMonitor, EntropyMonitor, ...)."
            )
    handler.callbacks = [cb for cb in handler.callbacks if not any(cb is m for m in monitors)]
    flow = [i for i, cb in enumerate(handler.callbacks) if isinstance(cb, DefaultFlowCallback)]
    position = flow[-1] + 1 if flow else 0
    handler.callbacks[position:position] = monitors
    return monitors
