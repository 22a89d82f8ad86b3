"""Training monitors for GRPO-style runs: clip rate / IPO mask, entropy and KL, reward (SPEC §4).

Each monitor is a `transformers.TrainerCallback` that reads the averaged metrics TRL's `GRPOTrainer` logs
(``clip_ratio/region_mean``, ``entropy``, ``kl``, ``reward``, ``frac_reward_zero_std``, and trl-ext's
``ipo/masked_ratio`` and ``judge/failure_ratio``) in ``on_log``, and raises *alerts* when a rule fires.

- A rule whose metric is absent from a log is idle for that log (no crash, no streak change), so every
  monitor works with any subset of the keys and ignores eval logs (their keys carry an ``eval_`` prefix).
- An alert fires when its condition becomes true and stays silent while the condition persists; it can fire
  again once the condition has cleared.
- Each alert is logged once (logger ``trl_ext.callbacks``, main process only), written into the log as
  ``monitor/alerts/<rule> = 1.0`` and triggers the rule's action: ``"warn"`` (log only), ``"checkpoint"``
  (``control.should_save``) or ``"stop"`` (``control.should_training_stop``).
- Logs are identical on every rank, and the rules are deterministic functions of the logs, so every rank
  takes the same decision; only the main process speaks.
- The state (rolling windows, streaks, alert counts) is exported with `ExportableState` into
  ``trainer_state.json`` and restored on resume (see `MonitorCallback.on_train_begin`).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import DefaultFlowCallback, ExportableState

logger = logging.getLogger("trl_ext.callbacks")

ACTIONS = ("warn", "checkpoint", "stop")
ALERT_KEY_PREFIX = "monitor/alerts/"
_MAX_ALERT_RECORDS = 100  # alert records kept in the exported state (the counts are exact)


@dataclass(frozen=True)
class MonitorAlert:
    """One fired alert.

    Attributes:
        rule: name of the rule, e.g. ``"entropy_collapse"``; the log key is ``monitor/alerts/<rule>``.
        step: global step of the log that fired it.
        metric: the logged metric the rule watches, e.g. ``"entropy"``.
        value: the value that fired it (smoothed or aggregated when the rule smooths).
        action: ``"warn"``, ``"checkpoint"`` or ``"stop"``.
        message: what happened, the likely causes and what to do.
    """

    rule: str
    step: int
    metric: str
    value: float
    action: str
    message: str

    @property
    def log_key(self) -> str:
        return ALERT_KEY_PREFIX + self.rule


@dataclass(frozen=True)
class _Finding:
    rule: str
    metric: str
    value: float
    message: str


# ----------------------------------------------------------------------------------------------------------------
# Validation helpers: every error names the class, the argument, the bad value and a valid example.


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(owner: str, name: str, value: Any, minimum: int, example: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{owner}: {name}={value!r} must be an int >= {minimum}; pass e.g. {name}={example}.")
    if value < minimum:
        raise ValueError(f"{owner}: {name}={value!r} must be >= {minimum}; pass e.g. {name}={example}.")
    return value


def _check_float(
    owner: str,
    name: str,
    value: Any,
    example: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    allow_none: bool = False,
) -> float | None:
    if value is None and allow_none:
        return None
    none_hint = " (or None to disable the check)" if allow_none else ""
    if not _is_number(value) or not math.isfinite(value):
        raise TypeError(f"{owner}: {name}={value!r} must be a finite number{none_hint}; pass e.g. {name}={example}.")
    too_low = low is not None and (value < low if low_inclusive else value <= low)
    too_high = high is not None and (value > high if high_inclusive else value >= high)
    if too_low or too_high:
        lo = "" if low is None else f"{'>=' if low_inclusive else '>'} {low}"
        hi = "" if high is None else f"{'<=' if high_inclusive else '<'} {high}"
        bounds = " and ".join(b for b in (lo, hi) if b)
        raise ValueError(f"{owner}: {name}={value!r} must be {bounds}{none_hint}; pass e.g. {name}={example}.")
    return float(value)


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
    if not _is_number(value):
        try:  # numpy / torch scalars
            value = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor with several elements
            return None
    value = float(value)
    return value if math.isfinite(value) else None


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


_NOISE_WINDOW = 50  # raw values used to estimate a metric's log-to-log noise


def _noise_sigma(values: Sequence[float]) -> float:
    """Robust noise std of a series: median |successive difference| / (0.6745 · √2), insensitive to slow trends."""
    if len(values) < 3:
        return 0.0
    differences = [abs(b - a) for a, b in zip(values[:-1], values[1:])]
    return _median(differences) / (0.6745 * math.sqrt(2.0))


def _fmt_pct(x: float) -> str:
    return f"{100 * x:.2f}%" if x < 0.1 else f"{100 * x:.1f}%"


# ----------------------------------------------------------------------------------------------------------------


class MonitorCallback(TrainerCallback, ExportableState):
    """Base class of the trl-ext monitors: rule bookkeeping, actions, logging, state export and restore.

    Subclasses declare their ``rules``, implement `_check` (update windows, return findings via `_edge`) and
    `_config` (the constructor arguments, JSON-serialisable).

    Args:
        action: default action of every rule: ``"warn"`` (log a warning), ``"checkpoint"`` (also save a
            checkpoint now) or ``"stop"`` (also stop training after this step).
        actions: per-rule overrides, e.g. ``{"entropy_collapse": "stop"}``; keys must be rules of this monitor.
        start_step: rules stay silent before this global step (values are still recorded, so streaks and
            baselines are ready). Set it to the warm-up length when the learning rate starts at 0.
        rearm_after: after a rule fired, its condition must be false for this many consecutive observations
            before it can fire again (no chatter when a value hovers around a threshold).
    """

    rules: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        action: str = "warn",
        actions: Mapping[str, str] | None = None,
        start_step: int = 0,
        rearm_after: int = 3,
    ):
        owner = type(self).__name__
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
        self.start_step = _check_int(owner, "start_step", start_step, 0, 0)
        self.rearm_after = _check_int(owner, "rearm_after", rearm_after, 1, 3)
        self.monitor_state: dict[str, Any] = self._fresh_state()
        self._context: dict[str, Any] = {}  # run facts for the messages (args), not exported
        self._stop_rule: str | None = None  # rule that stopped this session's training, if any

    # -- subclass interface ------------------------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "actions": dict(self.actions) or None,
            "start_step": self.start_step,
            "rearm_after": self.rearm_after,
        }

    def _initial_extra_state(self) -> dict[str, Any]:
        return {}

    def _check(self, logs: Mapping[str, Any], step: int) -> list[_Finding]:
        raise NotImplementedError

    def _configure(self, args: TrainingArguments, state: TrainerState) -> None:
        """Read run facts from the training arguments at train begin."""
        self._context["learning_rate"] = getattr(args, "learning_rate", None)

    # -- state -------------------------------------------------------------------------------------------------
    def _fresh_state(self) -> dict[str, Any]:
        return {
            "last_step": -1,
            "alert_counts": {rule: 0 for rule in self.rules},
            "alerts": [],
            "active": {rule: False for rule in self.rules},
            "clear_streaks": {rule: 0 for rule in self.rules},
            "streaks": {},
            "series": {},
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

    def _series(self, name: str) -> list[float]:
        return self.monitor_state["series"].setdefault(name, [])

    def _push(self, name: str, value: float, maxlen: int) -> list[float]:
        series = self._series(name)
        series.append(value)
        del series[: max(0, len(series) - maxlen)]
        return series

    def _streak(self, name: str, condition: bool) -> int:
        streaks = self.monitor_state["streaks"]
        streaks[name] = streaks.get(name, 0) + 1 if condition else 0
        return streaks[name]

    def _edge(self, rule: str, condition: bool, step: int) -> bool:
        """True when ``rule``'s condition becomes true: once per episode, silent before ``start_step``.

        An episode ends when the condition has been false for ``rearm_after`` consecutive observations.
        """
        active, clear = self.monitor_state["active"], self.monitor_state["clear_streaks"]
        if not condition:
            clear[rule] = clear.get(rule, 0) + 1
            if clear[rule] >= self.rearm_after:
                active[rule] = False
            return False
        clear[rule] = 0
        if active.get(rule) or step < self.start_step:
            return False
        active[rule] = True
        return True

    # -- the rule engine, usable without a Trainer -------------------------------------------------------------
    def observe(self, logs: Mapping[str, Any], step: int) -> list[MonitorAlert]:
        """Feed one log (the dict `on_log` receives) and return the alerts it fires.

        This is what `on_log` calls; it takes no action, so rules can be tested on synthetic log sequences.
        """
        findings = self._check(logs, step)
        self.monitor_state["last_step"] = step
        alerts = []
        for finding in findings:
            action = self.actions.get(finding.rule, self.action)
            alert = MonitorAlert(finding.rule, step, finding.metric, finding.value, action, finding.message)
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

_CLIP_METRICS = ("ipo/masked_ratio", "clip_ratio/region_mean")

_MISMATCH_CAUSES = (
    "a systematic log-prob mismatch between the generator and the trainer: chat-template mismatch (the trainer "
    "re-tokenises a prompt the generator did not see, e.g. a different template or a missing generation prompt), "
    "LoRA adapter not synced to vLLM (the generator samples from the base model or a stale adapter), or a "
    "bf16/fp32 precision mismatch between generator and trainer (colocated vLLM runs a float32 checkpoint in "
    "bfloat16 unless vllm_dtype says otherwise)"
)


class ClipRateMonitor(MonitorCallback):
    """Watch the clip rate (``clip_ratio/region_mean``) or, under the IPO loss, the masked ratio (``ipo/masked_ratio``).

    SPEC §4: the healthy band is 1 %–20 %. Outside it, or on a sudden drop or step change, the usual culprit is a
    systematic log-prob mismatch between generator and trainer; the loss curve hides such faults.

    Rules (log keys ``monitor/alerts/<rule>``):
        - ``clip_rate_high``: above ``healthy_max`` for ``patience`` observations.
        - ``clip_rate_low``: below ``healthy_min`` (and not all exactly 0) for ``patience`` observations while the
          run is off-policy.
        - ``clip_rate_stuck_zero``: exactly 0 (``<= zero_atol``) for ``stuck_patience`` observations while the run
          is off-policy.
        - ``clip_rate_drop``: falls below ``drop_factor`` × the rolling median in one observation.
        - ``clip_rate_jump``: rises to ``jump_factor`` × the rolling median (but not above ``healthy_max``: that
          is ``clip_rate_high``) and stays there ``jump_patience`` observations.
        The drop and jump rules compare against an established level: the rolling median of the last ``window``
        observations (at least ``min_history``) must be inside the band (``>= healthy_min``).

    An *observation* is the mean of ``aggregate_logs`` consecutive logs. TRL computes the ratio against log-probs
    taken at generation time, so within one generation cycle the first optimizer step is on-policy (ratio 1, clip
    rate 0) and later ones are off-policy; per-log values alternate 0, x, 0, x when ``num_iterations > 1``. With
    ``aggregate_logs=None`` the monitor averages over one generation cycle, inferred from the arguments.

    Off-policy: TRL's clip rate can only be non-zero when ``gradient_accumulation_steps`` is not a multiple of
    ``steps_per_generation × num_iterations`` (otherwise old log-probs equal the current ones, also with vLLM);
    the IPO masked ratio compares against the generator's log-probs, so it is also non-zero with ``use_vllm``.
    When the run is fully on-policy the value 0 is legitimate and the low/stuck rules stay idle.

    Args:
        metric: the logged key to watch; None picks the first present of ``ipo/masked_ratio``,
            ``clip_ratio/region_mean`` and keeps it.
        healthy_min: lower edge of the healthy band (fraction, default 0.01).
        healthy_max: upper edge of the healthy band (fraction, default 0.20).
        patience: consecutive observations outside the band before ``clip_rate_high``/``clip_rate_low`` fire.
        stuck_patience: consecutive exact zeros before ``clip_rate_stuck_zero`` fires.
        zero_atol: values ``<=`` this count as exactly 0.
        drop_factor: ``clip_rate_drop`` fires when a value is below ``drop_factor`` × the rolling median.
        jump_factor: ``clip_rate_jump`` counts values ``>=`` ``jump_factor`` × the rolling median.
        jump_patience: consecutive jumped observations before ``clip_rate_jump`` fires.
        window: observations in the rolling median.
        min_history: observations needed before the drop/jump rules run.
        expect_nonzero: whether the run is off-policy (non-zero values expected); None infers it from the
            training arguments at train begin.
        aggregate_logs: logs averaged into one observation; None = one generation cycle (from the arguments).
        action, actions, start_step, rearm_after: see `MonitorCallback`.
    """

    rules = ("clip_rate_high", "clip_rate_low", "clip_rate_stuck_zero", "clip_rate_drop", "clip_rate_jump")

    def __init__(
        self,
        metric: str | None = None,
        healthy_min: float = 0.01,
        healthy_max: float = 0.20,
        patience: int = 3,
        stuck_patience: int = 5,
        zero_atol: float = 0.0,
        drop_factor: float = 0.25,
        jump_factor: float = 3.0,
        jump_patience: int = 3,
        window: int = 10,
        min_history: int = 5,
        expect_nonzero: bool | None = None,
        aggregate_logs: int | None = None,
        action: str = "warn",
        actions: Mapping[str, str] | None = None,
        start_step: int = 0,
        rearm_after: int = 3,
    ):
        owner = type(self).__name__
        if metric is not None and (not isinstance(metric, str) or not metric):
            raise TypeError(
                f"{owner}: metric={metric!r} must be a logged key such as 'clip_ratio/region_mean', or None."
            )
        self.metric = metric
        self.healthy_min = _check_float(
            owner, "healthy_min", healthy_min, 0.01, low=0.0, high=1.0, high_inclusive=False
        )
        self.healthy_max = _check_float(owner, "healthy_max", healthy_max, 0.2, low=0.0, high=1.0, low_inclusive=False)
        if self.healthy_min >= self.healthy_max:
            raise ValueError(
                f"{owner}: healthy_min={healthy_min!r} must be below healthy_max={healthy_max!r}; "
                "pass e.g. healthy_min=0.01, healthy_max=0.2."
            )
        self.patience = _check_int(owner, "patience", patience, 1, 3)
        self.stuck_patience = _check_int(owner, "stuck_patience", stuck_patience, 1, 5)
        self.zero_atol = _check_float(owner, "zero_atol", zero_atol, 0.0, low=0.0, high=self.healthy_min)
        self.drop_factor = _check_float(
            owner, "drop_factor", drop_factor, 0.25, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False
        )
        self.jump_factor = _check_float(owner, "jump_factor", jump_factor, 3.0, low=1.0, low_inclusive=False)
        self.jump_patience = _check_int(owner, "jump_patience", jump_patience, 1, 3)
        self.window = _check_int(owner, "window", window, 1, 10)
        self.min_history = _check_int(owner, "min_history", min_history, 1, 5)
        if self.min_history > self.window:
            raise ValueError(
                f"{owner}: min_history={min_history!r} cannot exceed window={window!r}; pass e.g. min_history={window}."
            )
        if expect_nonzero is not None and not isinstance(expect_nonzero, bool):
            raise TypeError(
                f"{owner}: expect_nonzero={expect_nonzero!r} must be True, False or None (infer from args)."
            )
        self.expect_nonzero = expect_nonzero
        if aggregate_logs is not None:
            _check_int(owner, "aggregate_logs", aggregate_logs, 1, 1)
        self.aggregate_logs = aggregate_logs
        super().__init__(action=action, actions=actions, start_step=start_step, rearm_after=rearm_after)
        # Effective settings; `_configure` refines them from the training arguments.
        self._expect = bool(expect_nonzero)
        self._aggregate = aggregate_logs or 1

    def _config(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "healthy_min": self.healthy_min,
            "healthy_max": self.healthy_max,
            "patience": self.patience,
            "stuck_patience": self.stuck_patience,
            "zero_atol": self.zero_atol,
            "drop_factor": self.drop_factor,
            "jump_factor": self.jump_factor,
            "jump_patience": self.jump_patience,
            "window": self.window,
            "min_history": self.min_history,
            "expect_nonzero": self.expect_nonzero,
            "aggregate_logs": self.aggregate_logs,
            **super()._config(),
        }

    def _initial_extra_state(self) -> dict[str, Any]:
        return {"metric": self.metric, "pending": [], "jump_ref": None, "low_nonzero": False}

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
        if self.expect_nonzero is not None:
            self._expect = self.expect_nonzero
        else:
            # The IPO mask compares against the generator's log-probs, which differ from the trainer's with vLLM.
            ipo = (self.metric or "").startswith("ipo/") or getattr(args, "loss_type", None) == "ipo"
            self._expect = trainer_off_policy or (ipo and use_vllm)
            if not known and state.is_world_process_zero:
                logger.info(
                    "ClipRateMonitor: the training arguments lack gradient_accumulation_steps/steps_per_generation/"
                    "num_iterations; treating the run as on-policy (low and stuck-at-0 rules idle). "
                    "Pass expect_nonzero=True to enable them."
                )
        if self.aggregate_logs is not None:
            self._aggregate = self.aggregate_logs
        else:
            # args.logging_steps may be a ratio of max_steps (< 1); the Trainer has then put the steps in the state.
            logging_steps = getattr(args, "logging_steps", 1)
            if not _is_number(logging_steps) or logging_steps < 1:
                logging_steps = getattr(state, "logging_steps", 1)
            logging_steps = max(1, int(logging_steps)) if _is_number(logging_steps) else 1
            self._aggregate = max(1, math.ceil(cycle_steps / logging_steps))

    def _resolve_metric(self, logs: Mapping[str, Any]) -> str | None:
        chosen = self.monitor_state.get("metric")
        if chosen:
            return chosen
        for key in _CLIP_METRICS:
            if _metric_value(logs, key) is not None:
                self.monitor_state["metric"] = key
                return key
        return None

    def _policy_facts(self) -> str:
        c = self._context
        if c.get("gradient_accumulation_steps") is None:
            return ""
        return (
            f" (gradient_accumulation_steps={c['gradient_accumulation_steps']}, "
            f"steps_per_generation={c['steps_per_generation']}, num_iterations={c['num_iterations']}, "
            f"use_vllm={c['use_vllm']})"
        )

    def _check(self, logs: Mapping[str, Any], step: int) -> list[_Finding]:
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
        history = list(self._series("value"))  # previous observations
        label = "IPO masked ratio" if metric.startswith("ipo/") else f"clip rate ({metric})"
        band = f"{_fmt_pct(self.healthy_min)}–{_fmt_pct(self.healthy_max)}"
        lr = _metric_value(logs, "learning_rate")
        lr = self._context.get("learning_rate") if lr is None else lr
        lr_text = f"learning_rate={lr:g}" if _is_number(lr) else "the learning rate"
        findings: list[_Finding] = []

        # Exactly zero while the run is off-policy.
        zero_streak = self._streak("zero", x <= self.zero_atol)
        if self._edge("clip_rate_stuck_zero", self._expect and zero_streak >= self.stuck_patience, step):
            findings.append(
                _Finding(
                    "clip_rate_stuck_zero",
                    metric,
                    x,
                    f"{label} has been exactly 0 for {zero_streak} observations although the run is off-policy"
                    f"{self._policy_facts()}, so every importance ratio is 1. Likely causes: the old log-probs are "
                    "computed with the current weights instead of the sampling ones (custom rollout_func or loss "
                    "returning the trainer's own log-probs; for IPO, the generator's logprobs missing so the trainer's "
                    f"are used), the policy does not move ({lr_text} is 0 during warm-up or too small to move any "
                    "token's probability past epsilon, or no parameter is trainable - LoRA adapter not attached to "
                    "the optimizer), the advantages are all 0 (frac_reward_zero_std near 1), or the loss ignores the "
                    "ratio. What to do: check that learning_rate and grad_norm are > 0 and frac_reward_zero_std < 1 "
                    "in the logs, call model.print_trainable_parameters(), and check that rollout_func returns the "
                    "sampler's logprobs.",
                )
            )

        # Outside the healthy band.
        below = x < self.healthy_min
        low_streak = self._streak("low", below)
        # The low rule needs a non-zero value in the streak: all-zero streaks belong to clip_rate_stuck_zero.
        st["low_nonzero"] = below and ((low_streak > 1 and st["low_nonzero"]) or x > self.zero_atol)
        if self._edge("clip_rate_low", self._expect and low_streak >= self.patience and st["low_nonzero"], step):
            findings.append(
                _Finding(
                    "clip_rate_low",
                    metric,
                    x,
                    f"{label} {_fmt_pct(x)} has been below the healthy band ({band}) for {low_streak} observations "
                    f"in an off-policy run{self._policy_facts()}: the updates barely move the policy. Likely causes: "
                    f"{lr_text} too low or still warming up, vanishing gradients (grad_norm near 0), advantages "
                    "mostly 0 (see frac_reward_zero_std). What to do: check learning_rate and grad_norm in the logs, "
                    "raise the learning rate, or set start_step past the warm-up.",
                )
            )
        high_streak = self._streak("high", x > self.healthy_max)
        if self._edge("clip_rate_high", high_streak >= self.patience, step):
            findings.append(
                _Finding(
                    "clip_rate_high",
                    metric,
                    x,
                    f"{label} {_fmt_pct(x)} has been above the healthy band ({band}) for {high_streak} observations: "
                    "the trained policy is far from the one that sampled the tokens. Likely causes: "
                    f"{lr_text} too high for {self._context.get('num_iterations') or 'the'} update pass(es) per "
                    f"generation batch; or {_MISMATCH_CAUSES}. What to do: lower the learning rate or "
                    "num_iterations/steps_per_generation; with vLLM compare sampling/sampling_logp_difference/mean, "
                    "check the adapter is pushed to vLLM after every optimizer step, and that trainer and generator "
                    "use the same chat template and dtype (vllm_dtype for colocated vLLM, --dtype for "
                    "trl vllm-serve).",
                )
            )

        # Step changes against the rolling median of an established, in-band level.
        reference = _median(history[-self.window :]) if len(history) >= self.min_history else None
        established = reference is not None and reference >= self.healthy_min
        dropped = established and x < self.drop_factor * reference
        if self._edge("clip_rate_drop", dropped, step):
            findings.append(
                _Finding(
                    "clip_rate_drop",
                    metric,
                    x,
                    f"{label} fell from a rolling median of {_fmt_pct(reference)} to {_fmt_pct(x)} in one "
                    f"observation (below {self.drop_factor:g}x). A sudden drop usually means that the generator and "
                    "the trainer changed how they score tokens relative to each other - "
                    f"{_MISMATCH_CAUSES} appeared or went away (e.g. the generator reloaded other weights) - or "
                    "that the learning-rate schedule reached ~0. What to do: check the generator loaded the latest "
                    "adapter, diff the templates used by trainer and generator, check dtypes, and check "
                    "learning_rate in the logs.",
                )
            )
        # A jump past the band's top is clip_rate_high's; this rule reports step changes inside the band.
        jumped_in_band = x <= self.healthy_max
        if st["jump_ref"] is not None and not (jumped_in_band and x >= self.jump_factor * st["jump_ref"]):
            st["jump_ref"] = None
        if st["jump_ref"] is None and established and jumped_in_band and x >= self.jump_factor * reference:
            st["jump_ref"] = reference
        jump_streak = self._streak("jump", st["jump_ref"] is not None)
        if self._edge("clip_rate_jump", jump_streak >= self.jump_patience, step):
            findings.append(
                _Finding(
                    "clip_rate_jump",
                    metric,
                    x,
                    f"{label} jumped from a rolling median of {_fmt_pct(st['jump_ref'])} to {_fmt_pct(x)} "
                    f"(>= {self.jump_factor:g}x) and stayed there for {jump_streak} observations. A step change "
                    f"points to {_MISMATCH_CAUSES}, or to a learning-rate change ({lr_text}). What to do: find the "
                    "step where it changed (trl-ext plot), compare the generator's and the trainer's log-probs on one "
                    "batch, and check adapter sync and dtypes.",
                )
            )

        self._push("value", x, self.window)
        return findings


# ----------------------------------------------------------------------------------------------------------------


class EntropyMonitor(MonitorCallback):
    """Watch the policy entropy for collapse, and the KL to the reference for spikes (SPEC §4, §1.4).

    Rules (log keys ``monitor/alerts/<rule>``):
        - ``entropy_collapse``: ``entropy`` below ``entropy_floor`` for ``floor_patience`` logs, or its median over
          the last ``smoothing`` logs down more than ``max_drop`` from its early level (median of the first
          ``baseline_logs`` logs).
        - ``kl_spike``: ``kl`` above ``kl_max``, or above ``kl_spike_factor`` × its rolling median over the last
          ``kl_window`` logs (at least ``kl_min_history`` of them) while also above ``kl_spike_min``. ``kl`` is only
          logged when ``beta > 0``; otherwise the rule is idle.

    Args:
        entropy_floor: absolute floor in nats (mean per-token entropy); None disables it.
        floor_patience: consecutive logs below the floor before the alert.
        max_drop: relative drop from the early level that counts as collapse (0.9 = entropy fell to a tenth);
            None disables it.
        baseline_logs: logs that define the early level.
        smoothing: logs in the median compared with the early level.
        kl_max: absolute KL threshold (nats per token); None disables it.
        kl_spike_factor: multiple of the rolling median that counts as a spike; None disables it.
        kl_spike_min: relative spikes below this KL are ignored (KL grows from 0 early in training).
        kl_window: logs in the KL rolling median.
        kl_min_history: logs needed before the relative KL rule runs.
        entropy_metric, kl_metric: the logged keys.
        action, actions, start_step, rearm_after: see `MonitorCallback`.
    """

    rules = ("entropy_collapse", "kl_spike")

    def __init__(
        self,
        entropy_floor: float | None = 0.03,
        floor_patience: int = 2,
        max_drop: float | None = 0.9,
        baseline_logs: int = 5,
        smoothing: int = 3,
        kl_max: float | None = 1.0,
        kl_spike_factor: float | None = 5.0,
        kl_spike_min: float = 0.01,
        kl_window: int = 10,
        kl_min_history: int = 5,
        entropy_metric: str = "entropy",
        kl_metric: str = "kl",
        action: str = "warn",
        actions: Mapping[str, str] | None = None,
        start_step: int = 0,
        rearm_after: int = 3,
    ):
        owner = type(self).__name__
        self.entropy_floor = _check_float(owner, "entropy_floor", entropy_floor, 0.03, low=0.0, allow_none=True)
        self.floor_patience = _check_int(owner, "floor_patience", floor_patience, 1, 2)
        self.max_drop = _check_float(
            owner,
            "max_drop",
            max_drop,
            0.9,
            low=0.0,
            high=1.0,
            low_inclusive=False,
            high_inclusive=False,
            allow_none=True,
        )
        self.baseline_logs = _check_int(owner, "baseline_logs", baseline_logs, 1, 5)
        self.smoothing = _check_int(owner, "smoothing", smoothing, 1, 3)
        self.kl_max = _check_float(owner, "kl_max", kl_max, 1.0, low=0.0, low_inclusive=False, allow_none=True)
        self.kl_spike_factor = _check_float(
            owner, "kl_spike_factor", kl_spike_factor, 5.0, low=1.0, low_inclusive=False, allow_none=True
        )
        self.kl_spike_min = _check_float(owner, "kl_spike_min", kl_spike_min, 0.01, low=0.0)
        self.kl_window = _check_int(owner, "kl_window", kl_window, 1, 10)
        self.kl_min_history = _check_int(owner, "kl_min_history", kl_min_history, 1, 5)
        if self.kl_min_history > self.kl_window:
            raise ValueError(
                f"{owner}: kl_min_history={kl_min_history!r} cannot exceed kl_window={kl_window!r}; "
                f"pass e.g. kl_min_history={kl_window}."
            )
        for name, key in (("entropy_metric", entropy_metric), ("kl_metric", kl_metric)):
            if not isinstance(key, str) or not key:
                raise TypeError(f"{owner}: {name}={key!r} must be a logged key such as 'entropy' or 'kl'.")
        self.entropy_metric = entropy_metric
        self.kl_metric = kl_metric
        super().__init__(action=action, actions=actions, start_step=start_step, rearm_after=rearm_after)

    def _config(self) -> dict[str, Any]:
        return {
            "entropy_floor": self.entropy_floor,
            "floor_patience": self.floor_patience,
            "max_drop": self.max_drop,
            "baseline_logs": self.baseline_logs,
            "smoothing": self.smoothing,
            "kl_max": self.kl_max,
            "kl_spike_factor": self.kl_spike_factor,
            "kl_spike_min": self.kl_spike_min,
            "kl_window": self.kl_window,
            "kl_min_history": self.kl_min_history,
            "entropy_metric": self.entropy_metric,
            "kl_metric": self.kl_metric,
            **super()._config(),
        }

    def _initial_extra_state(self) -> dict[str, Any]:
        return {"entropy_baseline": []}

    @property
    def entropy_baseline(self) -> float | None:
        """The early entropy level (median of the first ``baseline_logs`` values), once known."""
        values = self.monitor_state["entropy_baseline"]
        return _median(values) if len(values) >= self.baseline_logs else None

    def _check(self, logs: Mapping[str, Any], step: int) -> list[_Finding]:
        findings: list[_Finding] = []
        lr = _metric_value(logs, "learning_rate")
        if lr is None:
            lr = self._context.get("learning_rate")
        lr_text = f"learning rate too high (learning_rate={lr:g})" if _is_number(lr) else "learning rate too high"

        entropy = _metric_value(logs, self.entropy_metric)
        if entropy is not None:
            baseline_values = self.monitor_state["entropy_baseline"]
            if len(baseline_values) < self.baseline_logs:
                baseline_values.append(entropy)
            recent = self._push("entropy", entropy, self.smoothing)
            floor_streak = self._streak(
                "entropy_floor", self.entropy_floor is not None and entropy < self.entropy_floor
            )
            below_floor = self.entropy_floor is not None and floor_streak >= self.floor_patience
            baseline = self.entropy_baseline
            smoothed = _median(recent) if len(recent) >= self.smoothing else None
            dropped = (
                self.max_drop is not None
                and baseline is not None
                and smoothed is not None
                and baseline > 0
                and smoothed < (1.0 - self.max_drop) * baseline
            )
            if self._edge("entropy_collapse", below_floor or dropped, step):
                if below_floor:
                    what = (
                        f"entropy {entropy:.4g} nats has been below the floor {self.entropy_floor:g} for "
                        f"{floor_streak} logs"
                    )
                else:
                    what = (
                        f"entropy (median of the last {self.smoothing} logs) fell to {smoothed:.4g} nats, "
                        f"{100 * (1 - smoothed / baseline):.0f}% below its early level {baseline:.4g} "
                        f"(limit {100 * self.max_drop:.0f}%)"
                    )
                if baseline is not None and below_floor:
                    what += f" (early level {baseline:.4g})"
                findings.append(
                    _Finding(
                        "entropy_collapse",
                        self.entropy_metric,
                        entropy if below_floor else float(smoothed),
                        f"Entropy collapse: {what}. The policy now puts almost all mass on few tokens, so the "
                        "completions of a group look alike, rewards stop varying and learning stalls. Likely causes: "
                        f"{lr_text}; cold-start SFT on the full RL dataset instead of a small held-out subset; a "
                        "reward that repetition or one fixed answer can hack; sampling temperature too low. What to do: restart from a checkpoint before the drop with a lower learning rate, redo "
                        "SFT on a few dozen held-out examples, inspect completions (log_completions=True), and "
                        "consider epsilon_high=0.28 (clip-higher) or entropy_coef/use_adaptive_entropy.",
                    )
                )

        kl = _metric_value(logs, self.kl_metric)
        if kl is not None:
            history = list(self._series("kl"))
            reference = _median(history[-self.kl_window :]) if len(history) >= self.kl_min_history else None
            above_max = self.kl_max is not None and kl > self.kl_max
            spiked = (
                self.kl_spike_factor is not None
                and reference is not None
                and kl > self.kl_spike_min
                and kl > self.kl_spike_factor * reference
            )
            if self._edge("kl_spike", above_max or spiked, step):
                if spiked:
                    what = f"KL {kl:.4g} is {kl / max(reference, 1e-12):.1f}x its rolling median {reference:.4g}"
                else:
                    what = f"KL {kl:.4g} is above kl_max={self.kl_max:g}"
                findings.append(
                    _Finding(
                        "kl_spike",
                        self.kl_metric,
                        kl,
                        f"KL spike: {what}. The policy moved abruptly away from the reference model. Likely causes: "
                        f"{lr_text} or a batch with extreme advantages; cold-start SFT on the full dataset (the "
                        "entropy collapses and the KL spikes together); the reference scored differently from the "
                        "policy (other chat template or dtype for the reference, LoRA reference = adapter disabled on "
                        "a different base); reward hacking. What to do: look at the completions around this step, "
                        "check grad_norm, lower the learning rate or raise beta, and check the entropy alert.",
                    )
                )
            self._push("kl", kl, self.kl_window)
        return findings


# ----------------------------------------------------------------------------------------------------------------


class RewardMonitor(MonitorCallback):
    """Watch the reward for collapse after a rise, the learning signal, and the LLM judge's failures (SPEC §4, §2).

    Rules (log keys ``monitor/alerts/<rule>``):
        - ``reward_collapse``: the reward, averaged over the last ``smoothing`` logs, has risen by at least
          ``min_rise`` above its earlier low, then lost more than ``max_drop`` of that gain for ``collapse_patience``
          consecutive logs. The loss must also exceed ``min_drop_sigmas`` standard errors of that average (the
          log-to-log noise is estimated from the last 50 rewards), so a noisy plateau does not count as a collapse.
        - ``reward_no_signal``: ``frac_reward_zero_std`` >= ``zero_std_max`` for ``zero_std_patience`` logs: nearly
          every group has identical rewards, so the advantages are 0.
        - ``judge_failure``: ``judge/failure_ratio`` > ``judge_failure_max`` for ``judge_patience`` logs (judge credit
          runs only).

    Args:
        smoothing: logs in the moving average of the reward.
        min_rise: gain (in reward units) the smoothed reward must make before a collapse can be called; set it
            to your reward's scale (default 0.1 suits rewards in [0, 1]).
        max_drop: fraction of the gain that must be lost (0.5 = half of it).
        collapse_patience: consecutive logs below the collapse threshold before the alert.
        min_drop_sigmas: the loss from the peak must also be at least this many standard errors of the smoothed
            reward (0 disables the noise guard).
        zero_std_max: ``frac_reward_zero_std`` at or above this is "no signal"; None disables the rule.
        zero_std_patience: consecutive logs before ``reward_no_signal``.
        judge_failure_max: judge failure ratio above this fires ``judge_failure``; None disables the rule.
        judge_patience: consecutive logs before ``judge_failure``.
        reward_metric, zero_std_metric, judge_failure_metric: the logged keys.
        action, actions, start_step, rearm_after: see `MonitorCallback`.
    """

    rules = ("reward_collapse", "reward_no_signal", "judge_failure")

    def __init__(
        self,
        smoothing: int = 5,
        min_rise: float = 0.1,
        max_drop: float = 0.5,
        collapse_patience: int = 3,
        min_drop_sigmas: float = 6.0,
        zero_std_max: float | None = 0.9,
        zero_std_patience: int = 5,
        judge_failure_max: float | None = 0.2,
        judge_patience: int = 2,
        reward_metric: str = "reward",
        zero_std_metric: str = "frac_reward_zero_std",
        judge_failure_metric: str = "judge/failure_ratio",
        action: str = "warn",
        actions: Mapping[str, str] | None = None,
        start_step: int = 0,
        rearm_after: int = 3,
    ):
        owner = type(self).__name__
        self.smoothing = _check_int(owner, "smoothing", smoothing, 1, 5)
        self.min_rise = _check_float(owner, "min_rise", min_rise, 0.1, low=0.0, low_inclusive=False)
        self.max_drop = _check_float(
            owner, "max_drop", max_drop, 0.5, low=0.0, high=1.0, low_inclusive=False, high_inclusive=True
        )
        self.collapse_patience = _check_int(owner, "collapse_patience", collapse_patience, 1, 3)
        self.min_drop_sigmas = _check_float(owner, "min_drop_sigmas", min_drop_sigmas, 6.0, low=0.0)
        self.zero_std_max = _check_float(
            owner, "zero_std_max", zero_std_max, 0.9, low=0.0, high=1.0, low_inclusive=False, allow_none=True
        )
        self.zero_std_patience = _check_int(owner, "zero_std_patience", zero_std_patience, 1, 5)
        self.judge_failure_max = _check_float(
            owner,
            "judge_failure_max",
            judge_failure_max,
            0.2,
            low=0.0,
            high=1.0,
            high_inclusive=False,
            allow_none=True,
        )
        self.judge_patience = _check_int(owner, "judge_patience", judge_patience, 1, 2)
        for name, key in (
            ("reward_metric", reward_metric),
            ("zero_std_metric", zero_std_metric),
            ("judge_failure_metric", judge_failure_metric),
        ):
            if not isinstance(key, str) or not key:
                raise TypeError(f"{owner}: {name}={key!r} must be a logged key such as 'reward'.")
        self.reward_metric = reward_metric
        self.zero_std_metric = zero_std_metric
        self.judge_failure_metric = judge_failure_metric
        super().__init__(action=action, actions=actions, start_step=start_step, rearm_after=rearm_after)

    def _config(self) -> dict[str, Any]:
        return {
            "smoothing": self.smoothing,
            "min_rise": self.min_rise,
            "max_drop": self.max_drop,
            "collapse_patience": self.collapse_patience,
            "min_drop_sigmas": self.min_drop_sigmas,
            "zero_std_max": self.zero_std_max,
            "zero_std_patience": self.zero_std_patience,
            "judge_failure_max": self.judge_failure_max,
            "judge_patience": self.judge_patience,
            "reward_metric": self.reward_metric,
            "zero_std_metric": self.zero_std_metric,
            "judge_failure_metric": self.judge_failure_metric,
            **super()._config(),
        }

    def _initial_extra_state(self) -> dict[str, Any]:
        # low: lowest smoothed reward so far; peak: highest; low_before_peak: the low the peak rose from.
        return {"reward_low": None, "reward_peak": None, "reward_low_before_peak": None}

    def _check(self, logs: Mapping[str, Any], step: int) -> list[_Finding]:
        findings: list[_Finding] = []
        st = self.monitor_state

        reward = _metric_value(logs, self.reward_metric)
        if reward is not None:
            recent = self._push("reward", reward, self.smoothing)
            noise_window = self._push("reward_noise", reward, _NOISE_WINDOW)
            if len(recent) >= self.smoothing:
                smoothed = sum(recent) / len(recent)
                if st["reward_peak"] is None:
                    st["reward_low"] = st["reward_peak"] = st["reward_low_before_peak"] = smoothed
                else:
                    st["reward_low"] = min(st["reward_low"], smoothed)
                    if smoothed > st["reward_peak"]:
                        st["reward_peak"] = smoothed
                        st["reward_low_before_peak"] = st["reward_low"]
                peak, low = st["reward_peak"], st["reward_low_before_peak"]
                gain = peak - low
                threshold = peak - self.max_drop * gain
                drop = peak - smoothed
                standard_error = _noise_sigma(noise_window) / math.sqrt(self.smoothing)
                collapsed_now = (
                    gain >= self.min_rise and smoothed < threshold and drop >= self.min_drop_sigmas * standard_error
                )
                streak = self._streak("reward_collapse", collapsed_now)
                if self._edge("reward_collapse", streak >= self.collapse_patience, step):
                    findings.append(
                        _Finding(
                            "reward_collapse",
                            self.reward_metric,
                            smoothed,
                            f"Reward collapse: the reward (mean of the last {self.smoothing} logs) rose from "
                            f"{low:.4g} to {peak:.4g} and has now been at {smoothed:.4g} for {streak} logs, losing "
                            f"{100 * (peak - smoothed) / gain:.0f}% of the gain (limit {100 * self.max_drop:.0f}%). "
                            "Likely causes: an entropy collapse or KL blow-up before it (see those alerts), learning "
                            "rate too high, reward hacking that ends in degenerate outputs, the generator serving a "
                            "stale or unsynced LoRA adapter, or a reward/judge endpoint that started failing. What to "
                            "do: look at completions before and after the peak, check the entropy, KL and clip-rate "
                            "alerts, and restart from the checkpoint at the peak with a lower learning rate.",
                        )
                    )

        frac = _metric_value(logs, self.zero_std_metric)
        if frac is not None and self.zero_std_max is not None:
            streak = self._streak("reward_no_signal", frac >= self.zero_std_max)
            if self._edge("reward_no_signal", streak >= self.zero_std_patience, step):
                findings.append(
                    _Finding(
                        "reward_no_signal",
                        self.zero_std_metric,
                        frac,
                        f"No learning signal: in {100 * frac:.0f}% of the groups all completions got the same reward "
                        f"(frac_reward_zero_std >= {self.zero_std_max:g} for {streak} logs), so their advantages are "
                        "0. Likely causes: prompts too hard (all rewards 0) or too easy (all 1) for this model; the "
                        "reward function fails to parse the outputs (answer format, stripped thinking, wrong chat "
                        "template); too few generations per prompt; collapsed entropy or low temperature making the "
                        "completions identical. What to do: print a few completions with their rewards, filter the "
                        "dataset by pass rate, raise num_generations or the temperature.",
                    )
                )

        failure = _metric_value(logs, self.judge_failure_metric)
        if failure is not None and self.judge_failure_max is not None:
            streak = self._streak("judge_failure", failure > self.judge_failure_max)
            if self._edge("judge_failure", streak >= self.judge_patience, step):
                findings.append(
                    _Finding(
                        "judge_failure",
                        self.judge_failure_metric,
                        failure,
                        f"Judge failures: {100 * failure:.0f}% of the judge calls failed (above "
                        f"{100 * self.judge_failure_max:.0f}% for {streak} logs), and a failed call gives that rollout "
                        "no token credit, so the judge's share of the advantage silently shrinks. Likely causes: the "
                        "judge endpoint times out or is rate limited, the judge's output is not valid span JSON, "
                        "span quotes do not match the marked trace, or the trace exceeds the judge's context. What to "
                        "do: check the judge server's logs, raise the timeout or lower the concurrency, and test the "
                        "judge prompt on a few traces.",
                    )
                )
        return findings


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
