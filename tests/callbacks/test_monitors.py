"""Tests of the training monitors (docs/monitoring.md): each rule through its monitor on synthetic logs, the
settings, the callback plumbing, real GRPO runs. The pure rules alone: test_rules.py."""

from __future__ import annotations

import json
import logging
import math
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback, TrainerCallback

from trl_ext.callbacks import (
    ALERTS,
    ClipRateMonitor,
    ClipRateMonitorConfig,
    EntropyMonitor,
    EntropyMonitorConfig,
    MonitorAlert,
    RewardMonitor,
    RewardMonitorConfig,
    StalenessMonitor,
    StalenessMonitorConfig,
    add_monitors,
    default_monitors,
)

LOGGER = "trl_ext.callbacks"


# ---------------------------------------------------------------------------------------------------------------
# Synthetic logs


def healthy_logs(n: int = 300, seed: int = 0, clip_key: str = "clip_ratio/region_mean") -> list[dict[str, float]]:
    """A healthy GRPO run's logs with noise: reward rises and plateaus, entropy declines slowly, KL grows
    slowly, the clip rate sits inside the band with ±30 % log-normal noise, few judge failures."""
    rng = random.Random(seed)
    logs = []
    for t in range(n):
        progress = t / n
        logs.append(
            {
                "loss": rng.gauss(0, 0.01),
                "learning_rate": 1e-6,
                "reward": 0.2 + 0.5 / (1 + math.exp(-(t - n / 3) / (n / 12))) + rng.gauss(0, 0.05),
                "reward_std": abs(0.3 + rng.gauss(0, 0.05)),
                "frac_reward_zero_std": min(1.0, max(0.0, 0.25 + rng.gauss(0, 0.08))),
                "entropy": (0.8 - 0.35 * progress) * math.exp(rng.gauss(0, 0.05)),
                "kl": (0.002 + 0.05 * progress) * math.exp(rng.gauss(0, 0.25)),
                clip_key: min(1.0, 0.05 * math.exp(rng.gauss(0, 0.3))),
                "judge/failure_ratio": max(0.0, 0.03 + rng.gauss(0, 0.02)),
                "judge/share": 0.06 + rng.gauss(0, 0.01),
            }
        )
    return logs


def feed(monitor, sequence, start: int = 1) -> list[MonitorAlert]:
    """Observe every log of ``sequence`` (steps start, start+1, ...) and return all fired alerts."""
    alerts = []
    for step, logs in enumerate(sequence, start=start):
        alerts += monitor.observe(logs, step)
    return alerts


def fired(alerts) -> list[tuple[str, int]]:
    return [(a.rule, a.step) for a in alerts]


def clip_logs(values, key="clip_ratio/region_mean"):
    return [{key: v} for v in values]


def off_policy_args(**overrides):
    fields = dict(
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=2,
        use_vllm=False,
        logging_steps=1,
        learning_rate=1e-6,
        loss_type="dapo",
        output_dir="",
        should_save=False,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


# ---------------------------------------------------------------------------------------------------------------
# Silent on healthy runs


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("clip_key", ["clip_ratio/region_mean", "ipo/masked_ratio"])
def test_every_monitor_is_silent_on_noisy_healthy_runs(seed, clip_key):
    monitors = [ClipRateMonitor(expect_nonzero=True, aggregate_logs=1), EntropyMonitor(), RewardMonitor()]
    logs = healthy_logs(seed=seed, clip_key=clip_key)
    for monitor in monitors:
        assert feed(monitor, logs) == [], type(monitor).__name__
        assert sum(monitor.alert_counts.values()) == 0


def test_alternating_per_log_clip_rate_is_healthy_once_averaged_over_the_generation_cycle():
    # num_iterations=2: the first step after each generation is on-policy (clip rate 0), the second is not.
    rng = random.Random(0)
    values = [0.0 if t % 2 == 0 else 0.08 * math.exp(rng.gauss(0, 0.3)) for t in range(200)]
    monitor = ClipRateMonitor()
    monitor.on_train_begin(off_policy_args(num_iterations=2), TrainerState(), TrainerControl())
    assert monitor._expect and monitor._aggregate == 2
    assert feed(monitor, clip_logs(values)) == []
    # Judged log by log, the same healthy run would look like repeated sudden drops.
    per_log = ClipRateMonitor(expect_nonzero=True, aggregate_logs=1)
    assert "clip_rate_drop" in {a.rule for a in feed(per_log, clip_logs(values))}


@pytest.mark.parametrize(
    ("ga", "spg", "iterations", "use_vllm", "loss_type", "expect", "aggregate"),
    [
        (1, 1, 1, False, "dapo", False, 1),  # fully on-policy: 0 is legitimate
        (4, 4, 1, False, "dapo", False, 1),  # TRL's default steps_per_generation = GA: on-policy
        (4, 4, 1, True, "dapo", False, 1),  # vLLM: TRL's ratio is against the trainer's own old log-probs
        (4, 4, 1, True, "ipo", True, 1),  # the IPO mask compares with the generator's log-probs
        (1, 1, 2, False, "dapo", True, 2),
        (2, 2, 2, False, "dapo", True, 2),
        (1, 4, 1, False, "dapo", True, 2),  # a 4-step cycle: observations of two logs
        (2, 4, 1, False, "dapo", True, 2),
    ],
)
def test_off_policy_and_generation_cycle_are_inferred_from_the_arguments(
    ga, spg, iterations, use_vllm, loss_type, expect, aggregate
):
    monitor = ClipRateMonitor()
    args = off_policy_args(
        gradient_accumulation_steps=ga, steps_per_generation=spg, num_iterations=iterations, use_vllm=use_vllm
    )
    args.loss_type = loss_type
    monitor.on_train_begin(args, TrainerState(), TrainerControl())
    assert (monitor._expect, monitor._aggregate) == (expect, aggregate)


def test_explicit_settings_override_the_inference():
    monitor = ClipRateMonitor(expect_nonzero=False, aggregate_logs=3)
    monitor.on_train_begin(off_policy_args(num_iterations=2), TrainerState(), TrainerControl())
    assert (monitor._expect, monitor._aggregate) == (False, 3)


# ---------------------------------------------------------------------------------------------------------------
# ClipRateMonitor rules

IN_BAND = [0.05, 0.06, 0.04, 0.05, 0.055, 0.045, 0.05, 0.06]


def test_clip_rate_high_fires_after_patience_and_names_the_mismatch_causes():
    monitor = ClipRateMonitor(expect_nonzero=True, aggregate_logs=1, patience=3)
    logs = [{"clip_ratio/region_mean": v, "learning_rate": 3e-5} for v in IN_BAND + [0.35, 0.4, 0.38, 0.41, 0.39]]
    alerts = feed(monitor, logs)
    assert fired(alerts) == [("clip_rate_high", 11)]
    message = alerts[0].message
    for cause in ("chat-template mismatch", "LoRA adapter not synced to vLLM", "bf16/fp32", "learning_rate=3e-05 too"):
        assert cause in message
    assert alerts[0].value == pytest.approx(0.38) and alerts[0].metric == "clip_ratio/region_mean"


def test_clip_rate_high_needs_consecutive_observations():
    monitor = ClipRateMonitor(expect_nonzero=True, aggregate_logs=1, patience=3)
    assert feed(monitor, clip_logs(IN_BAND + [0.35, 0.35, 0.05, 0.35, 0.35, 0.05])) == []


def test_clip_rate_low_fires_only_when_the_run_is_off_policy():
    values = [0.05, 0.004, 0.003, 0.005, 0.004]  # too little history for the drop rule
    off_policy = ClipRateMonitor(expect_nonzero=True, aggregate_logs=1)
    alerts = feed(off_policy, clip_logs(values))
    assert fired(alerts) == [("clip_rate_low", 4)]
    assert "grad_norm" in alerts[0].message
    on_policy = ClipRateMonitor(expect_nonzero=False, aggregate_logs=1)
    assert feed(on_policy, clip_logs(values)) == []


def test_clip_rate_stuck_at_zero_fires_off_policy_and_is_silent_on_policy():
    zeros = [0.0] * 7
    alerts = feed(ClipRateMonitor(expect_nonzero=True, aggregate_logs=1, stuck_patience=5), clip_logs(zeros))
    assert fired(alerts) == [("clip_rate_stuck_zero", 5)]  # not also clip_rate_low: all-zero streaks are "stuck"
    assert "off-policy" in alerts[0].message and "rollout_func" in alerts[0].message
    assert feed(ClipRateMonitor(expect_nonzero=False, aggregate_logs=1), clip_logs(zeros * 10)) == []


def test_clip_rate_sudden_drop_against_the_rolling_median():
    monitor = ClipRateMonitor(expect_nonzero=False, aggregate_logs=1, drop_factor=0.25)
    alerts = feed(monitor, clip_logs(IN_BAND + [0.011]))  # median 0.05 -> 0.011 < 0.0125
    assert fired(alerts) == [("clip_rate_drop", 9)]
    assert "template" in alerts[0].message and "adapter" in alerts[0].message
    # 0.014 is above a quarter of the median: no alert.
    assert feed(ClipRateMonitor(expect_nonzero=False, aggregate_logs=1), clip_logs(IN_BAND + [0.014])) == []
    # IPO's masked ratio is healthy at 0 (a healthy judge-credit run went from 1-3 % to 0 within two steps): no drop.
    ipo = ClipRateMonitor(aggregate_logs=1)
    assert feed(ipo, clip_logs(IN_BAND + [0.0, 0.0], key="ipo/masked_ratio")) == []


def test_clip_rate_drop_needs_an_established_in_band_level():
    low_level = [0.005, 0.006, 0.004, 0.005, 0.005, 0.006]
    assert feed(ClipRateMonitor(expect_nonzero=False, aggregate_logs=1), clip_logs(low_level + [0.0])) == []
    # ... and enough history
    assert feed(ClipRateMonitor(expect_nonzero=False, aggregate_logs=1), clip_logs([0.05, 0.05, 0.001])) == []


def test_clip_rate_jump_that_stays_fires_but_a_single_spike_does_not():
    jump = ClipRateMonitor(expect_nonzero=True, aggregate_logs=1, jump_factor=3.0, jump_patience=3)
    alerts = feed(jump, clip_logs(IN_BAND + [0.16, 0.17, 0.16, 0.18]))
    assert fired(alerts) == [("clip_rate_jump", 11)]
    assert "jumped from a rolling median of 5.00%" in alerts[0].message
    spike = ClipRateMonitor(expect_nonzero=True, aggregate_logs=1)
    assert feed(spike, clip_logs(IN_BAND + [0.19, 0.05, 0.05, 0.19, 0.05])) == []


def test_clip_monitor_prefers_the_ipo_masked_ratio_and_keeps_its_choice():
    monitor = ClipRateMonitor(expect_nonzero=True, aggregate_logs=1)
    logs = [{"ipo/masked_ratio": 0.4, "clip_ratio/region_mean": 0.05} for _ in range(3)]
    alerts = feed(monitor, logs)
    assert fired(alerts) == [("clip_rate_high", 3)]
    assert alerts[0].metric == "ipo/masked_ratio" and alerts[0].message.startswith("IPO masked ratio")


def test_clip_monitor_aggregates_logs_into_observations():
    monitor = ClipRateMonitor(expect_nonzero=True, aggregate_logs=2, patience=2)
    # per log: 0.0, 0.6 -> observation 0.3 (too high); twice -> fires at the 4th log
    alerts = feed(monitor, clip_logs([0.0, 0.6, 0.0, 0.6]))
    assert fired(alerts) == [("clip_rate_high", 4)] and alerts[0].value == pytest.approx(0.3)


def test_missing_none_nan_and_eval_keys_leave_the_rules_idle():
    monitor = ClipRateMonitor(expect_nonzero=True, aggregate_logs=1, patience=2, saturated_max=None)
    sequence = [
        {"clip_ratio/region_mean": 0.5},
        {"loss": 0.1},  # no metric: idle, the streak is kept
        {"clip_ratio/region_mean": None},
        {"clip_ratio/region_mean": float("nan")},
        {"eval_clip_ratio/region_mean": 0.9},  # eval logs are not watched
        {"train_runtime": 12.0},
        {"clip_ratio/region_mean": 0.5},
    ]
    assert fired(feed(monitor, sequence)) == [("clip_rate_high", 7)]
    entropy, reward = EntropyMonitor(), RewardMonitor()
    assert feed(entropy, sequence) == [] and feed(reward, sequence) == []
    assert entropy.monitor_state["memory"] == {} and reward.monitor_state["memory"] == {}


def test_an_alert_fires_once_per_episode_and_rearms_after_clearing():
    monitor = ClipRateMonitor(expect_nonzero=True, aggregate_logs=1, patience=1, rearm_after=2, min_history=10)
    values = [0.3, 0.3, 0.3, 0.05, 0.3, 0.05, 0.05, 0.3]
    assert fired(feed(monitor, clip_logs(values))) == [("clip_rate_high", 1), ("clip_rate_high", 8)]
    assert monitor.alert_counts["clip_rate_high"] == 2


def test_start_step_silences_rules_but_keeps_their_streaks():
    monitor = ClipRateMonitor(expect_nonzero=True, aggregate_logs=1, patience=2, start_step=5)
    assert fired(feed(monitor, clip_logs([0.3] * 6))) == [("clip_rate_high", 5)]


# ---------------------------------------------------------------------------------------------------------------
# EntropyMonitor rules


def test_entropy_collapse_below_the_floor():
    monitor = EntropyMonitor(entropy_floor=0.03, floor_patience=2, max_drop=None)
    alerts = feed(monitor, [{"entropy": e, "learning_rate": 0.05} for e in [0.5, 0.4, 0.02, 0.01, 0.01]])
    assert fired(alerts) == [("entropy_collapse", 4)]
    message = alerts[0].message
    assert "below the floor 0.03 for 2 logs" in message
    assert "learning rate too high (learning_rate=0.05)" in message
    assert "cold-start SFT on the full RL dataset" in message


def test_entropy_collapse_relative_to_its_early_level():
    entropies = [0.8, 0.82, 0.79, 0.81, 0.8, 0.6, 0.3, 0.1, 0.07, 0.06, 0.06]
    monitor = EntropyMonitor(entropy_floor=None, max_drop=0.9, baseline_logs=5, smoothing=3)
    alerts = feed(monitor, [{"entropy": e} for e in entropies])
    # smoothed = median of the last 3; the limit is 0.08 (10 % of 0.8): reached at the 10th log (median 0.07)
    assert fired(alerts) == [("entropy_collapse", 10)]
    assert alerts[0].value == pytest.approx(0.07)
    assert "91% below its early level 0.8" in alerts[0].message
    assert monitor.entropy_baseline == pytest.approx(0.8)


def test_a_slow_healthy_entropy_decline_does_not_fire():
    entropies = [0.8 * (1 - 0.8 * t / 500) for t in range(500)]  # -80 % over the run, no collapse
    assert feed(EntropyMonitor(), [{"entropy": e} for e in entropies]) == []


def test_kl_spike_relative_to_its_largest_recent_value():
    kls = [0.02, 0.021, 0.019, 0.02, 0.022, 0.02, 0.15]
    alerts = feed(EntropyMonitor(kl_spike_factor=5.0, kl_max=None), [{"kl": k} for k in kls])
    assert fired(alerts) == [("kl_spike", 7)]
    assert "6.8x its largest value of the last logs (0.022)" in alerts[0].message and "raise beta" in alerts[0].message


def test_kl_spike_absolute_threshold():
    alerts = feed(EntropyMonitor(kl_max=0.5, kl_spike_factor=None, kl_max_patience=1), [{"kl": k} for k in [0.1, 0.6]])
    assert fired(alerts) == [("kl_spike", 2)] and "above kl_max=0.5 (for 1 logs in a row)" in alerts[0].message


def test_kl_above_its_maximum_must_outlast_a_generation_batch():
    # The KL of one batch is heavy-tailed: a healthy judge-credit run (each batch trained for 2 steps) logged 1.19 and
    # 1.13 on one batch and 0.019 on the next (benchmarks/monitors_eval.py). Above kl_max over every log of one
    # batch and the first of the next is a drift; fewer is one batch's outliers.
    outlier = [0.28, 0.20, 0.17, 0.18, 1.19, 1.13, 0.019, 0.019]
    drift = [0.28, 0.20, 0.17, 0.18, 1.19, 1.13, 1.21, 1.3]
    logs = lambda kls: [(step, {"kl": kl}) for step, kl in enumerate(kls, start=1)]  # noqa: E731
    assert feed_steps(EntropyMonitor(kl_spike_factor=None), logs(outlier), off_policy_args()) == []
    (alert,) = feed_steps(EntropyMonitor(kl_spike_factor=None), logs(drift), off_policy_args())
    assert (alert.rule, alert.step) == ("kl_spike", 7) and "(for 3 logs in a row)" in alert.message
    # Four optimizer steps per batch (the quickstart's cycle): five logs; without arguments: two.
    quickstart = off_policy_args(gradient_accumulation_steps=4, steps_per_generation=4, num_iterations=4)
    steps = [(step, {"kl": 1.5}) for step in range(1, 9)]
    assert [a.step for a in feed_steps(EntropyMonitor(), steps, quickstart)] == [5]
    assert fired(feed(EntropyMonitor(), [{"kl": 1.5}] * 3)) == [("kl_spike", 2)]


def test_kl_growing_from_zero_is_not_a_spike():
    kls = [1e-5, 2e-5, 1e-5, 2e-5, 1e-5, 4e-3, 8e-3, 9e-3]  # 400x the median but below kl_spike_min
    assert feed(EntropyMonitor(), [{"kl": k} for k in kls]) == []


def test_kl_hovering_around_the_threshold_fires_once():
    kls = [1.1, 0.9, 1.2, 0.95, 1.1, 0.9, 1.3]
    config = dict(kl_max=1.0, kl_spike_factor=None, kl_max_patience=1, rearm_after=3)
    alerts = feed(EntropyMonitor(**config), [{"kl": k} for k in kls])
    assert fired(alerts) == [("kl_spike", 1)]


# ---------------------------------------------------------------------------------------------------------------
# RewardMonitor rules


def test_reward_collapse_after_a_rise():
    rewards = [0.1] * 5 + [0.3, 0.5, 0.7, 0.7, 0.7, 0.7, 0.7] + [0.1] * 8
    monitor = RewardMonitor(smoothing=5, min_rise=0.1, max_drop=0.5, collapse_patience=3)
    alerts = feed(monitor, [{"reward": r} for r in rewards])
    assert [a.rule for a in alerts] == ["reward_collapse"]
    # smoothed: peak 0.7 (low 0.1), threshold 0.4; 0.58, 0.46 at logs 13-14, below from log 15 (0.34): 3 logs -> 17
    assert alerts[0].step == 17
    assert "rose from 0.1 to 0.7" in alerts[0].message and "entropy collapse" in alerts[0].message


def test_reward_collapse_ignores_a_dip_within_the_noise():
    def noisy(level, n, offset):
        return [level + 0.05 * (-1) ** (t + offset) for t in range(n)]

    # rise 0.2 -> 0.4 and dip to 0.25: 75 % of the gain lost, but only ~3 standard errors of the smoothed reward
    rewards = noisy(0.2, 10, 0) + noisy(0.4, 10, 0) + noisy(0.25, 10, 0)
    assert feed(RewardMonitor(), [{"reward": r} for r in rewards]) == []
    without_guard = RewardMonitor(min_drop_sigmas=0.0)
    assert [a.rule for a in feed(without_guard, [{"reward": r} for r in rewards])] == ["reward_collapse"]


def test_reward_that_never_rose_collapses_only_below_where_it_started():
    assert feed(RewardMonitor(), [{"reward": r} for r in [0.3] * 10 + [0.25] * 10]) == []
    alerts = feed(RewardMonitor(), [{"reward": r} for r in [0.3] * 10 + [0.05] * 10])
    assert [a.rule for a in alerts] == ["reward_collapse"]
    assert "below where it started (0.3)" in alerts[0].message


def test_reward_no_signal_is_idle_where_judge_credit_marks_spans():
    """A judge-credit run whose rollouts all failed for a while (every group's outcome rewards agree) still learns
    from the judge's per-token credit: no alert. Without judge credit (λ = 0) the same logs fire."""
    logs = [{"frac_reward_zero_std": 1.0, "judge/spans_per_rollout": 4.8} for _ in range(6)]
    for judge_lambda, expected in ((1.0, []), (0.0, [("reward_no_signal", 3)])):
        monitor = RewardMonitor()
        monitor.on_train_begin(SimpleNamespace(judge_lambda=judge_lambda), TrainerState(), TrainerControl())
        assert fired(feed(monitor, logs)) == expected


def test_saturated_trust_region_fires_at_once():
    monitor = ClipRateMonitor(expect_nonzero=True, aggregate_logs=1)
    assert fired(feed(monitor, [{"clip_ratio/region_mean": x} for x in (0.05, 0.3, 0.55)])) == [("clip_rate_high", 3)]


def test_reward_no_signal():
    logs = [{"frac_reward_zero_std": f} for f in [0.5, 0.95, 0.97, 1.0, 0.92, 0.99, 1.0]]
    alerts = feed(RewardMonitor(zero_std_patience=5), logs)
    assert fired(alerts) == [("reward_no_signal", 6)]
    assert "advantages are 0" in alerts[0].message and "num_generations" in alerts[0].message


def test_judge_failures_only_when_judge_credit_logs_them():
    logs = [{"judge/failure_ratio": f} for f in [0.05, 0.3, 0.5, 0.6]]
    alerts = feed(RewardMonitor(judge_failure_max=0.2, judge_patience=2), logs)
    assert fired(alerts) == [("judge_failure", 3)] and "timeout" in alerts[0].message
    assert feed(RewardMonitor(), [{"reward": 0.5}] * 20) == []


# ---------------------------------------------------------------------------------------------------------------
# Configuration errors


@pytest.mark.parametrize(
    ("factory", "error", "pattern"),
    [
        (lambda: ClipRateMonitor(healthy_min=-0.1), ValueError, r"healthy_min=-0\.1 must be >= 0\.0"),
        (lambda: ClipRateMonitor(healthy_min=0.3, healthy_max=0.2), ValueError, r"healthy_min=0\.3 must be below"),
        (lambda: ClipRateMonitor(healthy_max=1.5), ValueError, r"healthy_max=1\.5 .*pass e\.g\. healthy_max=0\.2"),
        (lambda: ClipRateMonitor(patience=0), ValueError, r"patience=0 must be >= 1"),
        (lambda: ClipRateMonitor(patience=2.5), TypeError, r"patience=2\.5 must be an int"),
        (lambda: ClipRateMonitor(drop_factor=1.0), ValueError, r"drop_factor=1\.0 must be > 0\.0 and < 1\.0"),
        (lambda: ClipRateMonitor(jump_factor=1.0), ValueError, r"jump_factor=1\.0 must be > 1\.0"),
        (lambda: ClipRateMonitor(window=3, min_history=5), ValueError, r"min_history=5 cannot exceed window=3"),
        (lambda: ClipRateMonitor(expect_nonzero="yes"), TypeError, r"expect_nonzero='yes'"),
        (lambda: ClipRateMonitor(aggregate_logs=0), ValueError, r"aggregate_logs=0 must be >= 1"),
        (lambda: EntropyMonitor(entropy_floor=float("nan")), TypeError, r"entropy_floor=nan must be a finite"),
        (lambda: EntropyMonitor(max_drop=1.2), ValueError, r"max_drop=1\.2 .*or None to disable"),
        (lambda: EntropyMonitor(kl_spike_factor=0.5), ValueError, r"kl_spike_factor=0\.5 must be > 1\.0"),
        (lambda: EntropyMonitor(kl_max=0), ValueError, r"kl_max=0 must be > 0\.0"),
        (lambda: RewardMonitor(min_rise=0), ValueError, r"min_rise=0 must be > 0\.0"),
        (lambda: RewardMonitor(zero_std_max=1.1), ValueError, r"zero_std_max=1\.1 must be"),
        (lambda: RewardMonitor(smoothing=True), TypeError, r"smoothing=True must be an int"),
        (lambda: RewardMonitor(action="halt"), ValueError, r"action='halt' is not an action; use one of"),
        (lambda: EntropyMonitor(actions={"reward_collapse": "stop"}), ValueError, r"unknown rule 'reward_collapse'"),
        (lambda: EntropyMonitor(actions={"kl_spike": "pause"}), ValueError, r"actions\['kl_spike'\]='pause'"),
        (lambda: EntropyMonitor(start_step=-1), ValueError, r"start_step=-1 must be >= 0"),
        (lambda: default_monitors(action="panic"), ValueError, r"default_monitors: action='panic'"),
        (lambda: StalenessMonitor(max_dropped_share=1.0), ValueError, r"max_dropped_share=1\.0 must be >= 0\.0"),
        (lambda: StalenessMonitor(stale_patience=0), ValueError, r"stale_patience=0 must be >= 1"),
        (lambda: StalenessMonitor(actions={"kl_spike": "stop"}), ValueError, r"unknown rule 'kl_spike'"),
    ],
)
def test_invalid_settings_name_the_value_and_the_fix(factory, error, pattern):
    with pytest.raises(error, match=pattern):
        factory()


def test_a_monitor_takes_a_config_or_its_fields_as_keywords():
    config = ClipRateMonitorConfig(healthy_max=0.15, patience=2)
    by_config, by_keywords = (
        ClipRateMonitor(config, action="stop"),
        ClipRateMonitor(healthy_max=0.15, patience=2, action="stop"),
    )
    assert by_config.config == by_keywords.config == config and by_config._config() == by_keywords._config()
    assert by_config.healthy_max == 0.15 and by_config.window == 10  # settings read as attributes
    overridden = ClipRateMonitor(config, patience=4)
    assert (overridden.config.patience, overridden.config.healthy_max, config.patience) == (4, 0.15, 2)
    # The exported arguments rebuild the same monitor (what transformers does on resume).
    assert ClipRateMonitor(**by_config.state()["args"])._config() == by_config._config()
    assert EntropyMonitor(EntropyMonitorConfig(kl_max=0.5)).kl_max == 0.5
    assert RewardMonitor(RewardMonitorConfig(min_rise=2.0)).config.min_rise == 2.0
    with pytest.raises(TypeError, match=r"unknown setting\(s\) 'low'; the settings of ClipRateMonitor are metric"):
        ClipRateMonitor(low=0.1)
    with pytest.raises(TypeError, match=r"config=.* must be a ClipRateMonitorConfig"):
        ClipRateMonitor(EntropyMonitorConfig())
    with pytest.raises(AttributeError, match="no attribute 'no_such_setting'"):
        _ = by_config.no_such_setting


def test_every_rule_of_a_monitor_has_its_alert_texts():
    classes = (ClipRateMonitor, EntropyMonitor, RewardMonitor, StalenessMonitor)
    assert {rule for cls in classes for rule in cls.rules} == set(ALERTS)


def test_default_monitors_recommended_set():
    clip, entropy, reward = default_monitors()
    assert (type(clip), type(entropy), type(reward)) == (ClipRateMonitor, EntropyMonitor, RewardMonitor)
    assert entropy.actions == {"entropy_collapse": "stop"} and reward.actions == {"reward_collapse": "stop"}
    assert {m.action for m in default_monitors()} == {"warn"}
    relaxed = default_monitors(action="checkpoint", stop_on_collapse=False)
    assert {m.actions.get(rule, m.action) for m in relaxed for rule in m.rules} == {"checkpoint"}


# ---------------------------------------------------------------------------------------------------------------
# Callback plumbing: actions, logs, ranks, state


def run_callbacks(monitor, sequence, *, main_process=True, args=None):
    """Drive ``monitor`` like the Trainer does; return (controls per log, state, logs as seen by the callbacks)."""
    args = args or off_policy_args()
    state, control = TrainerState(is_world_process_zero=main_process), TrainerControl()
    monitor.on_train_begin(args, state, control)
    controls, seen = [], []
    for step, logs in enumerate(sequence, start=1):
        state.global_step = step
        logs = dict(logs)
        state.log_history.append({**logs, "step": step})
        control = TrainerControl()
        control = monitor.on_log(args, state, control, logs=logs)
        controls.append((control.should_save, control.should_training_stop))
        seen.append(logs)
    return controls, state, seen


@pytest.mark.parametrize(
    ("action", "expected"), [("warn", (False, False)), ("checkpoint", (True, False)), ("stop", (False, True))]
)
def test_actions_set_the_trainer_control(action, expected, caplog):
    monitor = EntropyMonitor(entropy_floor=0.1, floor_patience=1, actions={"entropy_collapse": action})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        controls, state, seen = run_callbacks(monitor, [{"entropy": 1.0}, {"entropy": 0.05}, {"entropy": 0.04}])
    assert controls == [(False, False), expected, (False, False)]
    assert "monitor/alerts/entropy_collapse" in seen[1] and "monitor/alerts/entropy_collapse" not in seen[2]
    assert state.log_history[1]["monitor/alerts/entropy_collapse"] == 1.0  # reaches trainer_state.json
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    text = records[0].getMessage()
    assert text.startswith("[trl-ext monitor] step 2, entropy_collapse: Entropy collapse")
    assert ("Stopping training" in text) == (action == "stop")
    assert ("Saving a checkpoint" in text) == (action == "checkpoint")


def test_only_the_main_process_speaks_but_every_rank_decides_the_same(caplog):
    sequence = [{"entropy": 1.0}] * 5 + [{"entropy": 0.01}] * 3
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        main_controls, _, main_logs = run_callbacks(EntropyMonitor(action="stop"), sequence, main_process=True)
        n_main = len([r for r in caplog.records if r.name == LOGGER])
        other_controls, _, other_logs = run_callbacks(EntropyMonitor(action="stop"), sequence, main_process=False)
        n_other = len([r for r in caplog.records if r.name == LOGGER]) - n_main
    assert main_controls == other_controls and (False, True) in main_controls
    assert main_logs == other_logs
    assert n_main >= 1 and n_other == 0


def test_state_is_json_and_round_trips_through_transformers_restore():
    sequence = healthy_logs(n=40, seed=3)
    for values in ([0.4] * 4, [0.0] * 6):
        sequence += [{"clip_ratio/region_mean": v, "entropy": 0.01, "kl": 3.0, "reward": 0.0} for v in values]
    original = [ClipRateMonitor(expect_nonzero=True, aggregate_logs=2), EntropyMonitor(), RewardMonitor()]
    head, tail = sequence[:43], sequence[43:]
    for monitor in original:
        feed(monitor, head)
    for monitor in original:
        saved = json.loads(json.dumps(monitor.state()))  # what trainer_state.json holds
        # transformers' Trainer._load_callback_state: new instance from "args", then setattr each attribute
        restored = type(monitor)(**saved["args"])
        for name, value in saved["attributes"].items():
            setattr(restored, name, value)
        assert restored.monitor_state == monitor.monitor_state
        assert fired(feed(restored, tail, start=44)) == fired(feed(monitor, tail, start=44))


def test_on_train_begin_restores_the_checkpoint_entry_and_resets_a_fresh_run():
    monitor = EntropyMonitor(entropy_floor=0.1, floor_patience=1)
    feed(monitor, [{"entropy": 1.0}, {"entropy": 0.9}, {"entropy": 0.05}])
    saved = json.loads(json.dumps(monitor.state()))
    other_config = EntropyMonitor(entropy_floor=0.2).state()
    # As loaded from a checkpoint: global_step > 0, a list because of two EntropyMonitor instances.
    resumed = TrainerState(global_step=3, stateful_callbacks={"EntropyMonitor": [other_config, saved]})
    fresh = EntropyMonitor(entropy_floor=0.1, floor_patience=1)
    fresh.on_train_begin(off_policy_args(), resumed, TrainerControl())
    assert fresh.monitor_state == saved["attributes"]["monitor_state"]
    assert fresh.alert_counts["entropy_collapse"] == 1 and fresh.monitor_state["memory"]["entropy_collapse"][
        "recent"
    ] == [1.0, 0.9, 0.05]
    # A single saved entry is restored even when a threshold changed for the resumed run.
    single = TrainerState(global_step=3, stateful_callbacks={"EntropyMonitor": saved})
    stricter = EntropyMonitor(entropy_floor=0.2, floor_patience=1)
    stricter.on_train_begin(off_policy_args(), single, TrainerControl())
    assert stricter.monitor_state == saved["attributes"]["monitor_state"]
    # Nothing saved for this monitor (added at resume): it starts fresh.
    newcomer = RewardMonitor()
    newcomer.on_train_begin(off_policy_args(), single, TrainerControl())
    assert newcomer.monitor_state["last_step"] == -1
    # A new run (global step 0) forgets everything.
    fresh.on_train_begin(off_policy_args(), TrainerState(), TrainerControl())
    assert fresh.alert_counts["entropy_collapse"] == 0 and fresh.monitor_state["memory"] == {}


def test_add_monitors_puts_them_before_the_reporting_callbacks():
    class Reporter(TrainerCallback):  # stands for WandbCallback / TrackioCallback / TensorBoardCallback
        def __init__(self):
            self.logged = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logged.append(dict(logs))

    reporter = Reporter()
    late = EntropyMonitor(entropy_floor=0.1, floor_patience=1)
    # Trainer order: DefaultFlowCallback, integrations, then the callbacks= the user passed.
    handler = CallbackHandler([DefaultFlowCallback(), reporter, late], None, None, None, None)
    trainer = SimpleNamespace(callback_handler=handler)
    assert add_monitors(trainer) == [late]
    assert [type(cb) for cb in handler.callbacks] == [DefaultFlowCallback, EntropyMonitor, Reporter]
    args, state, control = off_policy_args(), TrainerState(), TrainerControl()
    handler.on_train_begin(args, state, control)
    for step, entropy in enumerate([1.0, 0.05], start=1):
        state.global_step = step
        handler.on_log(args, state, control, logs={"entropy": entropy})
    assert reporter.logged[-1]["monitor/alerts/entropy_collapse"] == 1.0

    with_defaults = SimpleNamespace(callback_handler=CallbackHandler([DefaultFlowCallback()], None, None, None, None))
    added = add_monitors(with_defaults)
    assert [type(m) for m in added] == [ClipRateMonitor, EntropyMonitor, RewardMonitor]
    assert with_defaults.callback_handler.callbacks[1:] == added
    with pytest.raises(TypeError, match="is not a trl-ext monitor"):
        add_monitors(with_defaults, [Reporter()])


# ---------------------------------------------------------------------------------------------------------------
# Real GRPO runs on the offline tiny model

REPETITION_REWARD_DOC = "1 - distinct tokens / tokens: rewards repeating one token, so a high lr collapses entropy"


def repetition_reward(completions, completion_ids=None, **kwargs):
    return [1.0 - len(set(ids)) / max(1, len(ids)) for ids in completion_ids]


def grpo_run(output_dir, *, learning_rate, max_steps, monitors=(), seed=0, resume=None, extra_callbacks=(), **config):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from trl_ext.testing import build_tiny_model_and_tokenizer

    model, tokenizer = build_tiny_model_and_tokenizer(seed=seed)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i} + 3?"}] for i in range(16)]})
    settings = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        disable_tqdm=True,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        max_steps=max_steps,
        logging_steps=1,
        save_strategy="no",
        beta=0.0,
        seed=seed,
    )
    settings.update(config)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=repetition_reward,
        args=GRPOConfig(**settings),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=list(extra_callbacks),
    )
    add_monitors(trainer, list(monitors))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


class Recorder(TrainerCallback):
    """Placed where the reporting integrations sit; records the logs they would send."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_too_high_learning_rate_collapses_entropy_and_the_monitor_stops_the_run(tmp_path, caplog):
    recorder = Recorder()
    monitors = default_monitors()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer = grpo_run(tmp_path, learning_rate=0.05, max_steps=40, monitors=monitors, extra_callbacks=[recorder])
    stopped_at = trainer.state.global_step
    assert 5 < stopped_at < 40
    entropy_monitor = monitors[1]
    assert entropy_monitor.alert_counts["entropy_collapse"] == 1
    assert entropy_monitor.alerts[-1] == {
        "rule": "entropy_collapse",
        "step": stopped_at,
        "value": entropy_monitor.alerts[-1]["value"],
        "action": "stop",
    }
    # The entropy really collapsed: far below its early level at the stop.
    entropies = [h["entropy"] for h in trainer.state.log_history if "entropy" in h]
    assert entropies[-1] < 0.1 * entropies[0]
    # It says why, once.
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER and "entropy_collapse" in r.getMessage()]
    assert len(messages) == 1
    assert f"step {stopped_at}, entropy_collapse: Entropy collapse" in messages[0]
    assert "learning rate too high (learning_rate=0.05)" in messages[0]
    assert "Stopping training (action='stop')" in messages[0]
    # The alert is in the logs the loggers receive, and in trainer_state.json (written on the stop).
    assert recorder.logs[stopped_at - 1]["monitor/alerts/entropy_collapse"] == 1.0
    written = json.loads((tmp_path / "trainer_state.json").read_text())
    assert written["global_step"] == stopped_at
    assert any(h.get("monitor/alerts/entropy_collapse") == 1.0 for h in written["log_history"])


def test_a_sane_learning_rate_runs_to_the_end_without_collapse(tmp_path):
    monitors = default_monitors()
    trainer = grpo_run(tmp_path, learning_rate=0.005, max_steps=16, monitors=monitors)
    assert trainer.state.global_step == 16
    assert monitors[1].alert_counts["entropy_collapse"] == 0 and monitors[2].alert_counts["reward_collapse"] == 0
    assert not (tmp_path / "trainer_state.json").exists()


def test_checkpoint_action_saves_at_the_alert_and_training_goes_on(tmp_path):
    monitor = EntropyMonitor(action="checkpoint")
    trainer = grpo_run(tmp_path, learning_rate=0.2, max_steps=10, monitors=[monitor])
    assert trainer.state.global_step == 10
    (alert,) = monitor.alerts
    assert alert["rule"] == "entropy_collapse" and alert["action"] == "checkpoint"
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [f"checkpoint-{alert['step']}"]


def test_grpo_config_off_policy_inference():
    from trl import GRPOConfig

    monitor = ClipRateMonitor()
    args = GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, num_iterations=2, logging_steps=1)
    monitor.on_train_begin(args, TrainerState(), TrainerControl())
    assert (monitor._expect, monitor._aggregate) == (True, 2)
    # Logging every 10 steps already averages over 5 generation cycles.
    args = GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, num_iterations=2, logging_steps=10)
    monitor.on_train_begin(args, TrainerState(), TrainerControl())
    assert (monitor._expect, monitor._aggregate) == (True, 1)
    monitor.on_train_begin(GRPOConfig(output_dir="unused", use_cpu=True, bf16=False), TrainerState(), TrainerControl())
    assert (monitor._expect, monitor._aggregate) == (False, 1)


def test_resume_from_a_checkpoint_restores_the_monitor_state(tmp_path):
    settings = dict(learning_rate=0.2, max_steps=9, save_strategy="steps", save_steps=3)
    first = [ClipRateMonitor(), EntropyMonitor(), RewardMonitor()]
    full = grpo_run(tmp_path, monitors=first, **settings)
    assert full.state.global_step == 9
    collapse_step = first[1].alerts[0]["step"]
    assert first[1].alerts[0]["rule"] == "entropy_collapse" and collapse_step <= 6  # in the checkpoint's state

    class Probe(TrainerCallback):  # snapshots the monitors right after they restored themselves
        def on_train_begin(self, args, state, control, **kwargs):
            self.snapshot = [json.loads(json.dumps(m.monitor_state)) for m in second]

    second = [ClipRateMonitor(), EntropyMonitor(), RewardMonitor()]
    probe = Probe()
    checkpoint = tmp_path / "checkpoint-6"
    resumed = grpo_run(
        tmp_path / "resumed", monitors=second, resume=str(checkpoint), extra_callbacks=[probe], **settings
    )
    assert resumed.state.global_step == 9

    saved = json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]
    for monitor, snapshot in zip(second, probe.snapshot):
        assert snapshot == saved[type(monitor).__name__]["attributes"]["monitor_state"]
        assert snapshot["last_step"] == 6
    # The rolling windows are those of the logs up to step 6: replay them through a fresh monitor.
    replay = EntropyMonitor()
    feed(replay, [h for h in json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]])
    assert probe.snapshot[1]["memory"] == replay.monitor_state["memory"]  # windows, streaks, early level
    # The alert fired before the checkpoint is remembered: counted once, not raised again after the resume.
    assert probe.snapshot[1]["alert_counts"]["entropy_collapse"] == 1
    assert second[1].alert_counts["entropy_collapse"] == 1 and second[1].alerts[0]["step"] == collapse_step


DDP_SCRIPT = textwrap.dedent(
    """
    import json, logging, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    logging.basicConfig(level=logging.WARNING, format="%(name)s|%(message)s")
    import test_monitors as t
    from trl_ext.callbacks import default_monitors
    monitors = default_monitors()
    trainer = t.grpo_run(sys.argv[1], learning_rate=0.05, max_steps=40, monitors=monitors, per_device_train_batch_size=4)
    out = {"step": trainer.state.global_step, "counts": [m.alert_counts for m in monitors]}
    with open(f"{sys.argv[1]}/rank{trainer.args.process_index}.json", "w") as f:
        json.dump(out, f)
    sys.path.insert(0, str(Path(sys.argv[2]).parents[1]))
    from tests.utils import end_distributed_script
    end_distributed_script()  # leave without gloo's teardown at exit, which can abort a rank (tests/utils.py)
    """
)


@pytest.mark.slow
def test_two_ranks_stop_at_the_same_step_and_only_rank_zero_speaks(tmp_path):
    script = tmp_path / "ddp_run.py"
    script.write_text(DDP_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), str(tmp_path)]
    result = subprocess.run(
        command + [str(Path(__file__).parent)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1
    assert rank0["step"] < 40 and rank0["counts"][1]["entropy_collapse"] == 1
    output = result.stdout + result.stderr
    assert output.count("entropy_collapse: Entropy collapse") == 1


# ---------------------------------------------------------------------------------------------------------------
# Asynchronous runs (TRL's AsyncGRPOTrainer): off-policy detection and StalenessMonitor


def async_args(**overrides):
    """Training arguments shaped like TRL's AsyncGRPOConfig: max_staleness, no steps_per_generation,
    num_iterations or use_vllm."""
    fields = dict(
        max_staleness=4,
        gradient_accumulation_steps=1,
        logging_steps=1,
        learning_rate=1e-6,
        loss_type="dapo",
        output_dir="",
        should_save=False,
        world_size=1,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


@pytest.fixture(scope="module")
def async_config():
    """A real trl-ext ExtAsyncGRPOConfig (TRL's AsyncGRPOConfig plus the loss settings)."""
    from trl_ext.trainers.ext_async_grpo_config import ExtAsyncGRPOConfig

    return ExtAsyncGRPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none")


def async_logs(
    steps=200,
    seed=0,
    *,
    logging_steps=1,
    samples=16.0,
    max_staleness=4,
    dropped=None,
    staleness=None,
    wait_share=None,
):
    """(global step, log) pairs of a healthy asynchronous run, with TRL's AsyncGRPOTrainer's keys and reductions.

    Each log averages ``logging_steps`` optimizer steps: ``sample/dropped_stale_total`` is the window's count and
    absent when nothing was dropped, the rest are window means (``sample/staleness_max`` a maximum); the first log
    has the worker's start-up in its ``perf/rollout_wait_s`` and no ``perf/step_s`` when it covers one step only.
    ``dropped``, ``staleness`` and ``wait_share`` (functions of the step, returning None to keep the healthy value)
    inject faults: samples dropped in the window, the mean staleness, the rollout wait as a share of the step.
    """
    rng = random.Random(seed)
    healthy = healthy_logs(steps // logging_steps, seed=seed)
    logs = []
    for index, step in enumerate(range(logging_steps, steps + 1, logging_steps)):
        base = healthy[index]
        step_s = 2.0 * math.exp(rng.gauss(0, 0.1))
        share = min(0.85, max(0.0, rng.gauss(0.4, 0.15)))
        mean = min(float(max_staleness), max(0.0, rng.gauss(max_staleness / 2, 0.5)))
        count = float(rng.choice([0, 0, 0, 1, 2, 4])) * logging_steps  # a few samples at the edge go stale
        if dropped is not None and dropped(step) is not None:
            count = float(dropped(step))
        if staleness is not None and staleness(step) is not None:
            mean = float(staleness(step))
        if wait_share is not None and wait_share(step) is not None:
            share = float(wait_share(step))
        entry = {
            "loss": base["loss"],
            "grad_norm": abs(rng.gauss(0.5, 0.1)),
            "learning_rate": 1e-6,
            "reward": base["reward"],
            "reward_std": base["reward_std"],
            "entropy": base["entropy"],
            "kl": base["kl"],
            "ratio": 1.0 + rng.gauss(0, 0.01),
            "clip_ratio/region_mean": base["clip_ratio/region_mean"],
            "clip_ratio/low_mean": base["clip_ratio/region_mean"] / 2,
            "clip_ratio/high_mean": base["clip_ratio/region_mean"] / 2,
            "batch/samples_per_step": samples,
            "batch/groups_per_step": samples / 4,
            "perf/fwd_bwd_s": step_s * (1 - share) * 0.8,
            "perf/optimizer_s": 0.01,
            "perf/rollout_wait_s": share * step_s,
            "perf/step_s": step_s,
            "perf/weight_sync_s": 0.05,
            "sample/rollout_queue_size": float(rng.randint(0, 20)),
            "sample/time_in_queue_s": abs(rng.gauss(1.0, 0.3)),
            "sample/staleness_mean": mean,
            "sample/staleness_max": float(min(max_staleness, math.ceil(mean) + 1)),
            "rollout/inflight": 64.0,
            "rollout/generated_tok_s": 900.0,
            "epoch": 0.01 * step,
        }
        if count:
            entry["sample/dropped_stale_total"] = count
        if index == 0:
            entry["perf/rollout_wait_s"] = 30.0 / logging_steps + share * step_s  # spawn + server warm-up
            if logging_steps == 1:
                del entry["perf/step_s"]  # TRL measures no step_s for the first step
        logs.append((step, entry))
    return logs


def drive(monitors, logs, args, *, start_step=0, main_process=True):
    """Run ``monitors`` like the Trainer does over (step, log) pairs from ``start_step``; return the alerts."""
    state = TrainerState(is_world_process_zero=main_process, global_step=start_step)
    for monitor in monitors:
        monitor.on_train_begin(args, state, TrainerControl())
    alerts = []
    for step, entry in logs:
        state.global_step = step
        state.log_history.append({**entry, "step": step})
        for monitor in monitors:
            monitor.on_log(args, state, TrainerControl(), logs=dict(entry))
            alerts += [(record["rule"], record["step"]) for record in monitor.alerts if record["step"] == step]
    return alerts


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("logging_steps", [1, 3])
def test_the_async_monitor_set_is_silent_on_noisy_healthy_async_runs(seed, logging_steps):
    args = async_args(logging_steps=logging_steps)
    monitors = default_monitors(args=args)
    assert [type(m) for m in monitors] == [ClipRateMonitor, EntropyMonitor, RewardMonitor, StalenessMonitor]
    assert drive(monitors, async_logs(seed=seed, logging_steps=logging_steps), args) == []


def test_a_generation_bound_run_at_max_staleness_without_drops_is_healthy():
    # TRL's automatic max_inflight_tasks keeps max_staleness steps of samples in flight: the staleness sits at the
    # limit and the trainer waits much of each step. Neither is an alert.
    logs = async_logs(staleness=lambda step: 4.0, dropped=lambda step: 0.0, wait_share=lambda step: 0.85)
    assert drive([StalenessMonitor()], logs, async_args()) == []


def test_stale_rollouts_fires_when_the_worker_runs_ahead():
    logs = async_logs(dropped=lambda step: 30.0 if step >= 40 else 0.0)  # 30 dropped, 16 trained: 65 %
    monitor = StalenessMonitor()
    alerts = feed_steps(monitor, logs, async_args())
    assert [(a.rule, a.step, a.metric) for a in alerts] == [("stale_rollouts", 42, "sample/dropped_stale_total")]
    assert alerts[0].value == pytest.approx(30 / 46)
    message = alerts[0].message
    assert message.startswith("Stale rollouts dominate: 65% of the rollouts that reached the trainer were dropped")
    assert "more than max_staleness=4 policy versions old" in message and "max_inflight_tasks" in message


def test_the_dropped_share_counts_the_samples_trained_since_the_previous_log():
    # logging_steps=2: 16 samples per step, 32 trained per log. 30 dropped is 48 % (silent), 40 is 56 %.
    args = async_args(logging_steps=2)
    below = async_logs(logging_steps=2, dropped=lambda step: 30.0 if step >= 40 else 0.0)
    assert feed_steps(StalenessMonitor(), below, args) == []
    above = async_logs(logging_steps=2, dropped=lambda step: 40.0 if step >= 40 else 0.0)
    assert [(a.rule, a.step) for a in feed_steps(StalenessMonitor(), above, args)] == [("stale_rollouts", 44)]


def test_stale_rollouts_pinned_at_max_staleness_while_dropping():
    logs = async_logs(staleness=lambda step: 4.0 if step >= 40 else None, dropped=lambda step: 3.0)
    (alert,) = feed_steps(StalenessMonitor(), logs, async_args())
    assert (alert.rule, alert.step, alert.value, alert.metric) == ("stale_rollouts", 42, 4.0, "sample/staleness_mean")
    assert "every sample trained was max_staleness=4 policy versions old" in alert.message
    # The limit is read from the arguments, or from the settings without them.
    assert feed_steps(StalenessMonitor(watch_pinned=False), logs, async_args()) == []
    assert [a.step for a in feed(StalenessMonitor(max_staleness=4), [entry for _, entry in logs])] == [42]


def test_trainer_starved_fires_after_patience_logs_and_names_the_wait():
    logs = async_logs(wait_share=lambda step: 0.97 if step >= 40 else None)
    (alert,) = feed_steps(StalenessMonitor(), logs, async_args())
    assert (alert.rule, alert.step, alert.metric) == ("trainer_starved", 44, "perf/rollout_wait_s")
    assert alert.value == pytest.approx(0.97)
    assert "waited for rollouts 97.0% of its step time" in alert.message
    assert feed_steps(StalenessMonitor(max_wait_share=None), logs, async_args()) == []


def test_the_first_log_of_a_session_is_not_judged_for_starvation():
    # Starved from the start, logging every 3 steps: the first log's wait includes the worker's start-up and its
    # step time misses the first step, so the streak starts at the second log and fires at the sixth.
    logs = async_logs(steps=30, logging_steps=3, wait_share=lambda step: 0.95)
    assert logs[0][1]["perf/rollout_wait_s"] > logs[0][1]["perf/step_s"]  # the start-up wait: share above 1
    alerts = feed_steps(StalenessMonitor(), logs, async_args(logging_steps=3))
    assert [(a.rule, a.step) for a in alerts] == [("trainer_starved", 18)]
    # With logging_steps=1 TRL logs no step time for the first step: idle there, the same count follows.
    alerts = feed_steps(StalenessMonitor(), async_logs(steps=10, wait_share=lambda step: 0.95), async_args())
    assert [(a.rule, a.step) for a in alerts] == [("trainer_starved", 6)]


def test_missing_keys_leave_the_staleness_rules_idle():
    monitor = StalenessMonitor(max_staleness=4)
    other_rank = {"batch/samples_per_step": 16.0, "perf/step_s": 2.0, "loss": 0.1}  # TRL logs sample/* on rank 0
    eval_log = {"eval_sample/staleness_mean": 4.0, "eval_perf/rollout_wait_s": 9.0}
    summary = {"train_runtime": 10.0, "train_loss": 0.1}
    no_step_time = {"batch/samples_per_step": 16.0, "sample/staleness_mean": 4.0, "perf/rollout_wait_s": 9.0}
    logs = [other_rank, eval_log, summary, no_step_time, {"sample/staleness_mean": float("nan")}, {}] * 5
    assert feed(monitor, logs) == []
    assert monitor.monitor_state["memory"].get("trainer_starved") is None  # never judged
    sync = [entry for _, entry in async_logs(steps=20)]
    for entry in sync:  # a synchronous GRPO log: none of the asynchronous keys
        for key in [k for k in entry if k.split("/")[0] in ("sample", "perf", "batch", "rollout")]:
            del entry[key]
    assert feed(StalenessMonitor(), sync) == []


def test_only_warn_with_several_processes():
    with pytest.raises(ValueError, match=r"StalenessMonitor: action 'stop' with 2 processes.*main process only"):
        StalenessMonitor(action="stop").on_train_begin(async_args(world_size=2), TrainerState(), TrainerControl())
    with pytest.raises(ValueError, match=r"action 'checkpoint' with 4 processes"):
        StalenessMonitor(actions={"trainer_starved": "checkpoint"}).on_train_begin(
            async_args(world_size=4), TrainerState(), TrainerControl()
        )
    StalenessMonitor().on_train_begin(async_args(world_size=2), TrainerState(), TrainerControl())
    StalenessMonitor(action="stop").on_train_begin(async_args(), TrainerState(), TrainerControl())


def test_staleness_state_round_trips_and_a_resume_starts_a_new_window():
    args = async_args()
    monitor = StalenessMonitor()
    logs = async_logs(steps=60, dropped=lambda step: 30.0 if step >= 40 else 0.0)
    drive([monitor], logs[:41], args)  # stale from step 40: a streak of 2 at the checkpoint (step 41)
    exported = json.loads(json.dumps(monitor.state()))
    assert exported["attributes"]["monitor_state"]["last_window_end"] == 41
    assert exported["attributes"]["monitor_state"]["max_staleness"] == 4
    resumed = StalenessMonitor(**exported["args"])
    state = TrainerState(global_step=41, stateful_callbacks={"StalenessMonitor": exported})
    resumed.on_train_begin(args, state, TrainerControl())
    alerts = []
    for step, entry in logs[41:]:
        alerts += resumed.observe(entry, step)
    assert [(a.rule, a.step) for a in alerts] == [("stale_rollouts", 42)]  # the streak continued
    # Without saved state the window starts at the resumed step: 32 trained in 2 steps, 40 dropped is 56 %.
    fresh = StalenessMonitor()
    fresh.on_train_begin(args, TrainerState(global_step=50), TrainerControl())
    entry = {"batch/samples_per_step": 16.0, "sample/staleness_mean": 2.0, "sample/dropped_stale_total": 40.0}
    alerts = [a for step in (52, 54, 56) for a in fresh.observe(entry, step)]
    assert [(a.step, round(a.value, 3)) for a in alerts] == [(56, round(40 / 72, 3))]


def test_async_runs_are_off_policy_for_the_clip_rate_monitor(async_config, caplog):
    # A real ExtAsyncGRPOConfig: max_staleness=4 by default, no steps_per_generation/num_iterations/use_vllm.
    assert async_config.max_staleness == 4 and not hasattr(async_config, "num_iterations")
    monitor = ClipRateMonitor()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        monitor.on_train_begin(async_config, TrainerState(), TrainerControl())
    assert (monitor._expect, monitor._aggregate) == (True, 1)
    assert not [r for r in caplog.records if "treating the run as on-policy" in r.getMessage()]
    alerts = feed(monitor, clip_logs([0.0] * 5))
    assert [a.rule for a in alerts] == ["clip_rate_stuck_zero"]
    assert "although the run is off-policy (asynchronous run: max_staleness=4, so samples up to 4" in alerts[0].message
    # max_staleness=0 trains every sample on the policy that sampled it; only a loss measured against the sampler
    # (the IPO masked ratio: the async trainer always samples with vLLM) is off-policy then.
    for loss_type, expect in (("dapo", False), ("ipo", True)):
        monitor.on_train_begin(async_args(max_staleness=0, loss_type=loss_type), TrainerState(), TrainerControl())
        assert (monitor._expect, monitor._aggregate) == (expect, 1), loss_type
    monitor.on_train_begin(async_args(max_staleness=1), TrainerState(), TrainerControl())
    assert monitor._expect


def test_default_monitors_add_the_staleness_monitor_for_async_arguments(async_config):
    monitors = default_monitors(action="stop", args=async_config)
    assert [type(m) for m in monitors] == [ClipRateMonitor, EntropyMonitor, RewardMonitor, StalenessMonitor]
    assert monitors[-1].action == "warn" and not monitors[-1].actions  # wasted compute, not a broken policy
    assert len(default_monitors(args=off_policy_args())) == 3 and len(default_monitors()) == 3
    assert isinstance(StalenessMonitor(StalenessMonitorConfig(max_wait_share=0.5)).config, StalenessMonitorConfig)
    trainer = SimpleNamespace(
        args=async_config, callback_handler=CallbackHandler([DefaultFlowCallback()], None, None, None, None)
    )
    assert [type(m) for m in add_monitors(trainer)][-1] is StalenessMonitor


def feed_steps(monitor, logs, args):
    """Configure ``monitor`` from ``args`` at step 0, then observe the (step, log) pairs; return the alerts."""
    monitor.on_train_begin(args, TrainerState(), TrainerControl())
    return [alert for step, entry in logs for alert in monitor.observe(entry, step)]


def test_kl_spike_is_idle_on_the_sampler_kl_of_an_async_run():
    # TRL's asynchronous trainer has no KL term: its ``kl`` is the k3 estimate between the trained policy and the
    # sampler, which swings with each batch's staleness (7x from one step to the next in a healthy
    # benchmarks/monitors_eval.py run). The same series in a synchronous run is a KL to the reference, and spikes.
    kls = [0.004, 0.006, 0.005, 0.004, 0.006, 0.005, 0.035, 0.004, 0.041]
    logs = [(step, {"kl": kl, "entropy": 1.0}) for step, kl in enumerate(kls, start=1)]
    assert feed_steps(EntropyMonitor(), logs, async_args()) == []
    assert [(a.rule, a.step) for a in feed_steps(EntropyMonitor(), logs, off_policy_args())] == [("kl_spike", 7)]
    # A KL logged under another key is the user's own reference KL: watched in asynchronous runs too.
    custom = [(step, {"ref_kl": kl, "entropy": 1.0}) for step, kl in enumerate(kls, start=1)]
    alerts = feed_steps(EntropyMonitor(kl_metric="ref_kl"), custom, async_args())
    assert [(a.rule, a.step) for a in alerts] == [("kl_spike", 7)]


def test_the_kl_rule_called_directly_reads_its_patience_from_the_config():
    from trl_ext.callbacks.configs import EntropyMonitorConfig
    from trl_ext.callbacks.rules import kl_spike

    config = EntropyMonitorConfig(kl_spike_factor=None, kl_max_patience=3)
    result = kl_spike([1.5, 1.5, 1.5], [1, 2, 3], config)
    assert [finding.step for finding in result.findings] == [3]
    assert [f.step for f in kl_spike([1.5, 1.5], [1, 2], EntropyMonitorConfig(kl_spike_factor=None)).findings] == [
        1,
        2,
    ]


def test_reward_monitor_pools_the_answer_rate_of_small_logs_by_their_roots():
    # Per-step logs of an asynchronous RLM run, 8 roots each: one log of 3 answers in 8 is chance, not a collapse.
    rates = [1.0, 0.75, 0.625, 0.875, 0.375, 0.75, 0.875, 0.625]
    with_roots = [{"rlm/final_answer_rate": rate, "rlm/roots_total": 8.0} for rate in rates]
    assert fired(feed(RewardMonitor(), with_roots)) == []
    assert fired(feed(RewardMonitor(), [{"rlm/final_answer_rate": rate} for rate in rates])) == [
        ("answer_rate_collapse", 5)
    ]
    dying = with_roots[:4] + [{"rlm/final_answer_rate": 0.125, "rlm/roots_total": 8.0}] * 4
    assert fired(feed(RewardMonitor(), dying)) == [("answer_rate_collapse", 8)]
