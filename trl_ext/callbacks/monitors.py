"""The trl-ext training monitors (docs/monitoring.md): `ClipRateMonitor` (the loss's trust-region metric: TRL's
clip rate, the IPO masked ratio), `EntropyMonitor` (entropy and KL), `RewardMonitor` (reward and judge),
`StalenessMonitor` (the rollout pipeline of an asynchronous run), the recommended set (`default_monitors`) and
`add_monitors`, which puts them ahead of the loggers.

Each reads the metrics TRL's `GRPOTrainer` (or `AsyncGRPOTrainer`) and trl-ext log (``clip_ratio/region_mean`` or
the loss's own trust-region metric, ``entropy``, ``kl``, ``reward``, ``frac_reward_zero_std``,
``judge/failure_ratio``, ``sample/staleness_mean``, ``perf/rollout_wait_s``, ...); the engine they share (alert
episodes, actions, state export and restore) is `trl_ext.callbacks.base.MonitorCallback`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import TrainerControl, TrainerState, TrainingArguments

from ..callback_order import put_before_loggers
from ..losses import LOSSES, trust_region_loss, trust_region_metrics
from .base import MonitorCallback, Rule, check_action, logger, metric_value
from .configs import (
    ClipRateMonitorConfig,
    EntropyMonitorConfig,
    RewardMonitorConfig,
    StalenessMonitorConfig,
    is_number,
)
from .rules import (
    Finding,
    answer_rate_collapse,
    clip_rate_drop,
    clip_rate_high,
    clip_rate_jump,
    clip_rate_low,
    clip_rate_stuck_zero,
    dropped_share,
    entropy_baseline,
    entropy_collapse,
    judge_failure,
    judge_injection,
    kl_spike,
    reward_collapse,
    reward_no_signal,
    stale_rollouts,
    trainer_starved,
    wait_share,
)

__all__ = [
    "ClipRateMonitor",
    "EntropyMonitor",
    "RewardMonitor",
    "StalenessMonitor",
    "add_monitors",
    "async_max_staleness",
    "default_monitors",
]


def async_max_staleness(args: Any) -> int | None:
    """The ``max_staleness`` of an asynchronous run's arguments (TRL's `AsyncGRPOConfig`, trl-ext's
    `ExtAsyncGRPOConfig`), or None for a synchronous run (arguments without an int ``max_staleness``)."""
    value = getattr(args, "max_staleness", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


GENERATION_FIELDS = ("gradient_accumulation_steps", "steps_per_generation", "num_iterations")


def generation_cycle_steps(args: Any) -> int | None:
    """Optimizer steps between two generation batches of a run with arguments ``args``: 1 in an asynchronous run
    (TRL's `AsyncGRPOTrainer`, each sample trained once), the cycle of ``gradient_accumulation_steps``,
    ``steps_per_generation`` and ``num_iterations`` in a synchronous one, None when the arguments lack them."""
    if async_max_staleness(args) is not None:
        return 1
    ga, spg, num_iterations = (getattr(args, name, None) for name in GENERATION_FIELDS)
    if not all(isinstance(x, int) and x > 0 for x in (ga, spg, num_iterations)):
        return None
    generate_every = spg * num_iterations  # micro-steps between generations
    return math.lcm(ga, generate_every) // ga


def logging_interval(args: Any, state: TrainerState) -> int:
    """Optimizer steps between two logs: ``args.logging_steps``, or the Trainer's count in ``state`` where the
    arguments give a ratio of ``max_steps`` (< 1)."""
    logging_steps = getattr(args, "logging_steps", 1)
    if not is_number(logging_steps) or logging_steps < 1:
        logging_steps = getattr(state, "logging_steps", 1)
    return max(1, int(logging_steps)) if is_number(logging_steps) else 1


class ClipRateMonitor(MonitorCallback):
    """Watch the trust-region metric of the run's loss (`trl_ext.losses.LossSpec.trust_region_metric`): TRL's clip
    rate ``clip_ratio/region_mean``, the IPO loss's masked ratio, or that of a loss registered from outside.

    The healthy band is 1 %–20 % (docs/monitoring.md). Outside it, or on a sudden drop or step change, the usual
    culprit is a systematic log-prob mismatch between generator and trainer; the loss curve hides such faults.

    Rules (log keys ``monitor/alerts/<rule>``; conditions and thresholds in `trl_ext.callbacks.rules`):
        - ``clip_rate_high``: above ``healthy_max`` for ``patience`` observations, or above ``saturated_max`` in one
          (`clip_rate_high`).
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
    ``aggregate_logs=None`` the monitor averages two logs when a generation cycle (inferred from the arguments)
    spans several optimizer steps, else takes each log.

    Off-policy: TRL's clip rate can only be non-zero when ``gradient_accumulation_steps`` is not a multiple of
    ``steps_per_generation × num_iterations`` (otherwise old log-probs equal the current ones, also with vLLM);
    a loss whose metric compares against the sampler's log-probs (``LossSpec.measured_against_sampler``, e.g. the
    IPO masked ratio) is also non-zero with ``use_vllm``. An asynchronous run (TRL's ``AsyncGRPOTrainer``: its
    arguments have ``max_staleness``) is off-policy when ``max_staleness > 0``, and always samples with vLLM.
    When the run is fully on-policy the value 0 is legitimate and the low/stuck rules stay idle. They are also idle
    on a metric whose loss says 0 is its healthy state (``LossSpec.trust_region_floor=False``: IPO's mask acts on
    outlier tokens only) unless ``expect_nonzero=True``.

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
        self._run_metric: str | None = None  # the trust-region metric of the run's loss, once `_configure` knows it
        self._aggregate = self.config.aggregate_logs or 1

    def _initial_extra_state(self) -> dict[str, Any]:
        return {"metric": self.config.metric, "pending": []}

    def _configure(self, args: TrainingArguments, state: TrainerState) -> None:
        super()._configure(args, state)
        run_loss = LOSSES.get(getattr(args, "loss_type", None))
        self._run_metric = run_loss.trust_region_metric if run_loss is not None else None
        ga = getattr(args, "gradient_accumulation_steps", None)
        spg = getattr(args, "steps_per_generation", None)
        num_iterations = getattr(args, "num_iterations", None)
        use_vllm = bool(getattr(args, "use_vllm", False))
        max_staleness = async_max_staleness(args)
        self._context.update(
            gradient_accumulation_steps=ga,
            steps_per_generation=spg,
            num_iterations=num_iterations,
            use_vllm=use_vllm,
            max_staleness=max_staleness,
        )
        cycle_steps = generation_cycle_steps(args)
        known = cycle_steps is not None
        if max_staleness is not None:
            # TRL's AsyncGRPOTrainer: one pass per sample, p_old = the vLLM sampler's log-probs, and samples up to
            # max_staleness policy versions old; off-policy as soon as it may train on an older version.
            use_vllm = True
            trainer_off_policy = max_staleness > 0
        elif known:
            trainer_off_policy = ga % (spg * num_iterations) != 0  # micro-steps between generations
        else:
            trainer_off_policy, cycle_steps = False, 1
        self._context["trainer_off_policy"] = trainer_off_policy
        if self.config.expect_nonzero is not None:
            self._expect = self.config.expect_nonzero
        else:
            # A metric measured against the generator's log-probs differs from 0 with vLLM even when on-policy.
            watched = trust_region_loss(self.config.metric) if self.config.metric else None
            against_sampler = any(spec is not None and spec.measured_against_sampler for spec in (watched, run_loss))
            self._expect = trainer_off_policy or (against_sampler and use_vllm)
            if not known and state.is_world_process_zero:
                logger.info(
                    "ClipRateMonitor: the training arguments lack gradient_accumulation_steps/steps_per_generation/"
                    "num_iterations (and max_staleness, for an asynchronous run); treating the run as on-policy "
                    "(low and stuck-at-0 rules idle). Pass expect_nonzero=True to enable them."
                )
        if self.config.aggregate_logs is not None:
            self._aggregate = self.config.aggregate_logs
        else:
            logging_steps = logging_interval(args, state)
            # At most two logs: the on-policy first log of a cycle is averaged with an off-policy one (so values do
            # not alternate 0, x, 0, x), while a long cycle (num_iterations=16) still gives an observation every two
            # logs, not one per cycle, which kept the patience rules silent for three cycles.
            self._aggregate = min(2, max(1, math.ceil(cycle_steps / logging_steps)))

    def _metric_candidates(self) -> list[str]:
        """The keys the watched metric is picked from, best first: the run's loss's trust-region metric when known,
        then every registered loss's, those of the losses trl-ext computes (each key names its loss) before TRL's
        clip rate (shared by several losses)."""
        registered = sorted(trust_region_metrics(), key=lambda key: trust_region_loss(key).compute is None)
        return [self._run_metric, *registered] if self._run_metric else registered

    def _resolve_metric(self, logs: Mapping[str, Any]) -> str | None:
        chosen = self.monitor_state.get("metric")
        if chosen:
            return chosen
        for key in self._metric_candidates():
            if metric_value(logs, key) is not None:
                self.monitor_state["metric"] = key
                return key
        return None

    def _check(self, logs: Mapping[str, Any], step: int) -> list[tuple[Finding, str]]:
        metric = self._resolve_metric(logs)
        value = None if metric is None else metric_value(logs, metric)
        if value is None:
            return []
        st = self.monitor_state
        st["pending"].append(value)
        if len(st["pending"]) < self._aggregate:
            return []
        x = sum(st["pending"]) / len(st["pending"])
        st["pending"] = []
        st["aggregate"] = self._aggregate  # read by `plot_run` to draw the observations
        # The low rules watch a metric whose loss says a value near 0 means stalled updates (not IPO's mask, which
        # acts on outlier tokens only and is healthy at 0), in a run where it can move (`_configure`).
        spec = trust_region_loss(metric)
        floor = spec is None or spec.trust_region_floor or self.config.expect_nonzero is True
        off_policy = {"off_policy": self._expect and floor}
        checks: tuple[tuple[Rule, dict[str, Any]], ...] = (
            (clip_rate_stuck_zero, off_policy),
            (clip_rate_low, off_policy),
            (clip_rate_high, {}),
            (clip_rate_drop, {"floor": floor}),  # a fall to 0 is healthy where 0 is
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
        - ``kl_spike``: ``kl`` above ``kl_max`` for ``kl_max_patience`` logs (by default, more than one generation
          batch's), or above ``kl_spike_factor`` × its largest value over the last ``kl_window`` logs (at least
          ``kl_min_history`` of them) while also above ``kl_spike_min`` (`kl_spike`). ``kl`` is only logged when
          ``beta > 0``; otherwise the rule is idle. In an asynchronous run (its arguments have ``max_staleness``) the
          rule is idle on the default ``kl`` key: TRL's asynchronous trainer has no KL term and logs under ``kl`` the
          k3 estimate between the trained policy and the sampler, a staleness figure that swings from batch to
          batch, not a distance to the reference.

    Args:
        config: an `EntropyMonitorConfig` (``entropy_floor``, ``floor_patience``, ``max_drop``, ``baseline_logs``,
            ``smoothing``, ``kl_max``, ``kl_max_patience``, ``kl_spike_factor``, ``kl_spike_min``, ``kl_window``,
            ``kl_min_history``, ``entropy_metric``, ``kl_metric``), or its fields as keywords.
        action, actions, start_step, rearm_after: see `MonitorCallback`.
    """

    rules = ("entropy_collapse", "kl_spike")
    config_class = EntropyMonitorConfig
    rule_metrics = ((entropy_collapse, "entropy_metric"), (kl_spike, "kl_metric"))
    config: EntropyMonitorConfig

    def __init__(self, config: EntropyMonitorConfig | None = None, **kwargs: Any):
        super().__init__(config, **kwargs)
        self._reference_kl = True  # `_configure`: the run's ``kl`` is the KL to the reference
        self._kl_max_patience = self.config.kl_max_patience or 2  # `_configure`: from the generation cycle

    def _configure(self, args: TrainingArguments, state: TrainerState) -> None:
        super()._configure(args, state)
        # An asynchronous run's ``kl`` (TRL's default key) is sampler vs. trained policy, not the reference: a
        # healthy async judge-credit run jumped 7x from one step to the next (benchmarks/monitors_eval.py).
        default_key = EntropyMonitorConfig().kl_metric
        self._reference_kl = async_max_staleness(args) is None or self.config.kl_metric != default_key
        if self.config.kl_max_patience is None:  # every log of one generation batch, and one of the next
            cycle = generation_cycle_steps(args) or 1
            self._kl_max_patience = math.ceil(cycle / logging_interval(args, state)) + 1

    def _rule_kwargs(self, rule: Rule) -> dict[str, Any]:
        return {"max_patience": self._kl_max_patience} if rule is kl_spike else {}

    def _check(self, logs: Mapping[str, Any], step: int) -> list[tuple[Finding, str]]:
        if not self._reference_kl and self.config.kl_metric in logs:
            logs = {key: value for key, value in logs.items() if key != self.config.kl_metric}
        return super()._check(logs, step)

    @property
    def entropy_baseline(self) -> float | None:
        """The early entropy level (median of the first ``baseline_logs`` values), once known."""
        return entropy_baseline(self.monitor_state["memory"].get("entropy_collapse"), self.config)


# ----------------------------------------------------------------------------------------------------------------


JUDGE_SPANS_METRIC = "judge/spans_per_rollout"  # logged by JudgeCreditTrainer: the judge's spans per rollout


def text_verdicts_metric(injection_metric: str) -> str:
    """The key of the verdicts read out of free text that goes with a judge's injection key
    (``judge/injection_suspected`` -> ``judge/text_verdicts``, ``rubric_judge/…`` likewise)."""
    return injection_metric.rsplit("/", 1)[0] + "/text_verdicts" if "/" in injection_metric else "text_verdicts"


class RewardMonitor(MonitorCallback):
    """Watch the reward for collapse after a rise, the learning signal, and the LLM judge's failures.

    See docs/monitoring.md and, for the judge, docs/judge_credit.md.

    Rules (log keys ``monitor/alerts/<rule>``; conditions and thresholds in `trl_ext.callbacks.rules`):
        - ``reward_collapse``: the reward, averaged over the last ``smoothing`` logs, has risen by at least
          ``min_rise`` above its earlier low, then lost more than ``max_drop`` of that gain (or fallen below that low,
          ``min_rise`` under its peak) for ``collapse_patience`` consecutive logs, by at least ``min_drop_sigmas``
          standard errors (`reward_collapse`).
        - ``reward_no_signal``: ``frac_reward_zero_std`` >= ``zero_std_max`` for ``zero_std_patience`` logs: nearly
          every group has identical rewards, so the advantages are 0 (`reward_no_signal`). Not in a log where judge
          credit (``judge_lambda > 0``) marked spans: those give per-token advantages all the same.
        - ``answer_rate_collapse``: ``rlm/final_answer_rate`` below ``answer_drop`` of its peak so far for
          ``answer_patience`` observations, each a pool of logs holding ``answer_min_roots`` root rollouts
          (``rlm/roots_total``; RLM trainers; idle elsewhere): the policy stops answering, the road to a dead run
          where no group has a reward spread (`answer_rate_collapse`).
        - ``judge_failure``: ``judge/failure_ratio`` > ``judge_failure_max`` for ``judge_patience`` logs (judge credit
          runs only; `judge_failure`).
        - ``judge_injection``: ``judge/injection_suspected`` > ``judge_injection_max`` for ``judge_injection_patience``
          logs: the policy is suspected of forging the judge's verdict (off unless ``judge_injection_max`` is set, or
          the log's verdicts came partly as free text, ``judge/text_verdicts`` > 0; `judge_injection`).

    Args:
        config: a `RewardMonitorConfig` (``smoothing``, ``min_rise``, ``max_drop``, ``collapse_patience``,
            ``min_drop_sigmas``, ``zero_std_max``, ``zero_std_patience``, ``judge_failure_max``,
            ``judge_patience``, ``judge_injection_max``, ``judge_injection_patience``, ``reward_metric``,
            ``zero_std_metric``, ``judge_failure_metric``, ``judge_injection_metric``), or its fields as
            keywords.
        action, actions, start_step, rearm_after: see `MonitorCallback`.
    """

    rules = ("reward_collapse", "reward_no_signal", "answer_rate_collapse", "judge_failure", "judge_injection")
    config_class = RewardMonitorConfig
    rule_metrics = (
        (reward_collapse, "reward_metric"),
        (reward_no_signal, "zero_std_metric"),
        (answer_rate_collapse, "answer_rate_metric"),
        (judge_failure, "judge_failure_metric"),
        (judge_injection, "judge_injection_metric"),
    )
    config: RewardMonitorConfig

    def __init__(self, config: RewardMonitorConfig | None = None, **kwargs: Any):
        super().__init__(config, **kwargs)
        self._judge_credit = False  # `_configure`: the run blends judge credit into its advantages
        self._text_verdicts = False  # `_check`: some verdicts of this log were read out of free text
        self._answer_roots: float | None = None  # `_check`: the root rollouts behind this log's final-answer rate

    def _rule_kwargs(self, rule: Rule) -> dict[str, Any]:
        if rule is answer_rate_collapse:
            return {"roots": self._answer_roots}
        return {"text_verdicts": self._text_verdicts} if rule is judge_injection else {}

    def _configure(self, args: TrainingArguments, state: TrainerState) -> None:
        super()._configure(args, state)
        judge_lambda = getattr(args, "judge_lambda", None)
        self._judge_credit = is_number(judge_lambda) and judge_lambda > 0

    def _check(self, logs: Mapping[str, Any], step: int) -> list[tuple[Finding, str]]:
        # A judge-credit run whose judge marked spans has per-token advantages even where every group's rewards
        # agree (benchmarks/monitors_eval.py: a healthy run whose rollouts all failed for 4 generations): not "no
        # signal".
        if self._judge_credit and (metric_value(logs, JUDGE_SPANS_METRIC) or 0) > 0:
            logs = {**logs, self.config.zero_std_metric: 0.0}
        self._text_verdicts = (metric_value(logs, text_verdicts_metric(self.config.judge_injection_metric)) or 0) > 0
        self._answer_roots = metric_value(logs, self.config.answer_roots_metric)
        return super()._check(logs, step)


# ----------------------------------------------------------------------------------------------------------------


class StalenessMonitor(MonitorCallback):
    """Watch the rollout pipeline of an asynchronous run (TRL's `AsyncGRPOTrainer`, `ExtAsyncGRPOTrainer`):
    stale rollouts that dominate, and a trainer starved of rollouts (docs/monitoring.md).

    Rules (log keys ``monitor/alerts/<rule>``; conditions and thresholds in `trl_ext.callbacks.rules`):
        - ``stale_rollouts``: for ``stale_patience`` logs, more than ``max_dropped_share`` of the rollouts that
          reached the trainer were dropped as stale, or (``watch_pinned``) every sample trained was exactly
          ``max_staleness`` versions old while others were dropped (`stale_rollouts`). The share is
          `dropped_share` of ``sample/dropped_stale_total`` (absent from a log: none dropped) against
          ``batch/samples_per_step`` × the optimizer steps since the previous log.
        - ``trainer_starved``: for ``starved_patience`` logs, the trainer waited for rollouts more than
          ``max_wait_share`` of its step (``perf/rollout_wait_s / perf/step_s``, `trainer_starved`). The first log
          of a session is not judged: TRL logs no ``perf/step_s`` for the first step, whose wait includes the
          worker's start-up.

    A rule whose keys are not in a log is idle for that log: a synchronous run, an eval log, and every rank but the
    main process (where TRL keeps the rollout queue and logs its metrics). Since only the main process sees these
    metrics, only ``action="warn"`` is allowed with several processes (a stop or a checkpoint on one rank would
    hang the others); `default_monitors` gives this monitor ``"warn"``.

    Args:
        config: a `StalenessMonitorConfig` (``max_dropped_share``, ``watch_pinned``, ``stale_patience``,
            ``max_staleness``, ``max_wait_share``, ``starved_patience``, ``dropped_metric``, ``samples_metric``,
            ``staleness_metric``, ``wait_metric``, ``step_time_metric``), or its fields as keywords.
        action, actions, start_step, rearm_after: see `MonitorCallback`.
    """

    rules = ("stale_rollouts", "trainer_starved")
    config_class = StalenessMonitorConfig
    config: StalenessMonitorConfig

    def __init__(self, config: StalenessMonitorConfig | None = None, **kwargs: Any):
        super().__init__(config, **kwargs)
        self._session_start = 0  # global step at train begin: the start of the first log window
        self._waits_seen = False  # whether this session has logged a rollout wait yet (the first is not judged)

    def _initial_extra_state(self) -> dict[str, Any]:
        # last_window_end: global step of the previous log with a sample count (the window's start);
        # max_staleness: the run's, read by `plot_run`.
        return {"last_window_end": None, "max_staleness": self.config.max_staleness}

    def _configure(self, args: TrainingArguments, state: TrainerState) -> None:
        super()._configure(args, state)
        self._session_start, self._waits_seen = state.global_step, False
        world_size = getattr(args, "world_size", 1)
        acting = sorted({self.actions.get(rule, self.action) for rule in self.rules} - {"warn"})
        if isinstance(world_size, int) and world_size > 1 and acting:
            raise ValueError(
                f"StalenessMonitor: action {acting[0]!r} with {world_size} processes. TRL's asynchronous trainer logs "
                "the staleness and rollout-wait metrics on the main process only, so a stop or a checkpoint would be "
                "taken there alone and the other ranks would hang; use StalenessMonitor(action='warn')."
            )
        max_staleness = self.config.max_staleness
        if max_staleness is None:
            max_staleness = async_max_staleness(args)
        self._context["max_staleness"] = max_staleness

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        super().on_train_begin(args, state, control, **kwargs)
        self.monitor_state["max_staleness"] = self._context.get("max_staleness")

    def _check(self, logs: Mapping[str, Any], step: int) -> list[tuple[Finding, str]]:
        config, st, fired = self.config, self.monitor_state, []
        samples = metric_value(logs, config.samples_metric)
        staleness = metric_value(logs, config.staleness_metric)
        if samples is not None and staleness is not None:  # a training log of the main process
            previous = st.get("last_window_end")
            start = self._session_start if previous is None else max(previous, self._session_start)
            st["last_window_end"] = step
            share = dropped_share(metric_value(logs, config.dropped_metric) or 0.0, samples, step - start)
            if share is not None:
                max_staleness = self._context.get("max_staleness", config.max_staleness)
                finding = self._evaluate(
                    stale_rollouts, share, step, staleness_mean=[staleness], max_staleness=max_staleness
                )
                if finding is not None:
                    fired.append(
                        (finding, config.dropped_metric if finding.variant == "dropped" else config.staleness_metric)
                    )
        wait = metric_value(logs, config.wait_metric)
        if wait is not None:
            first, self._waits_seen = not self._waits_seen, True
            step_s = metric_value(logs, config.step_time_metric)
            share = None if first or step_s is None else wait_share(wait, step_s)
            if share is not None and (finding := self._evaluate(trainer_starved, share, step)) is not None:
                fired.append((finding, config.wait_metric))
        return fired


# ----------------------------------------------------------------------------------------------------------------


def default_monitors(action: str = "warn", stop_on_collapse: bool = True, args: Any = None) -> list[MonitorCallback]:
    """The recommended monitor set: `ClipRateMonitor`, `EntropyMonitor` and `RewardMonitor` with default thresholds,
    and `StalenessMonitor` for an asynchronous run.

    Args:
        action: action of every rule (``"warn"``, ``"checkpoint"`` or ``"stop"``) but the `StalenessMonitor`'s,
            which warn (its rules flag wasted compute, not a broken policy, and only the main process sees them).
        stop_on_collapse: stop training on ``entropy_collapse`` and ``reward_collapse`` (a collapsed policy does
            not recover; the last regular checkpoint is the one to restart from). False keeps ``action`` for them.
        args: the run's training arguments; when they have ``max_staleness`` (TRL's `AsyncGRPOConfig`,
            `ExtAsyncGRPOConfig`) the set also holds a `StalenessMonitor`. None: the synchronous set.

    Returns:
        A list to pass as ``callbacks=`` (or to `add_monitors`, which also puts them ahead of the loggers).
    """
    check_action("default_monitors", "action", action)
    collapse = "stop" if stop_on_collapse else action
    monitors: list[MonitorCallback] = [
        ClipRateMonitor(action=action),
        EntropyMonitor(action=action, actions={"entropy_collapse": collapse}),
        RewardMonitor(action=action, actions={"reward_collapse": collapse}),
    ]
    if async_max_staleness(args) is not None:
        monitors.append(StalenessMonitor(action="warn"))
    return monitors


def add_monitors(trainer: Any, monitors: Sequence[MonitorCallback] | None = None) -> list[MonitorCallback]:
    """Insert monitors into ``trainer``'s callbacks right after `DefaultFlowCallback`, ahead of the loggers.

    The `Trainer` calls callbacks in order and puts the reporting integrations (wandb, trackio, tensorboard, ...)
    before the ones passed as ``callbacks=``; a monitor placed after them adds its ``monitor/alerts/<rule>`` keys
    too late for that log to reach them. This helper moves the monitors (given ones, or those already in the
    trainer, or `default_monitors` for the trainer's arguments when there are none) in front.

    Returns:
        The monitors, in their new order.
    """
    handler = trainer.callback_handler
    present = [cb for cb in handler.callbacks if isinstance(cb, MonitorCallback)]
    if monitors is None:
        monitors = present or default_monitors(args=getattr(trainer, "args", None))
    monitors = list(monitors)
    for monitor in monitors:
        if not isinstance(monitor, MonitorCallback):
            raise TypeError(
                f"add_monitors: {monitor!r} is not a trl-ext monitor (ClipRateMonitor, EntropyMonitor, ...)."
            )
    put_before_loggers(handler, monitors)
    return monitors
