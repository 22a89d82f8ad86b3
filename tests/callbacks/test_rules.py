"""Tests of the pure monitor rules (trl_ext.callbacks.rules) on hand-made series, and of the alert texts as data."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from trl_ext.callbacks import rules
from trl_ext.callbacks.alerts import ALERTS, MonitorAlert, format_alert, format_pct
from trl_ext.callbacks.configs import (
    ClipRateMonitorConfig,
    EntropyMonitorConfig,
    RewardMonitorConfig,
    StalenessMonitorConfig,
)
from trl_ext.callbacks.rules import Finding

CLIP = ClipRateMonitorConfig()
ENTROPY = EntropyMonitorConfig()
REWARD = RewardMonitorConfig()
STALE = StalenessMonitorConfig()
IN_BAND = [0.05, 0.06, 0.04, 0.05, 0.055, 0.045, 0.05, 0.06]
DOCS = Path(__file__).resolve().parents[2] / "docs"


def run(rule, values, config, **kwargs):
    """The rule over ``values`` at steps 1, 2, ...: its findings as (step, value) pairs."""
    result = rule(values, range(1, len(values) + 1), config, **kwargs)
    return [(f.step, f.value) for f in result.findings]


def steps_of(rule, values, config, **kwargs):
    return [step for step, _ in run(rule, values, config, **kwargs)]


# ---------------------------------------------------------------------------------------------------------------
# ClipRateMonitor's rules


def test_clip_rate_high_fires_from_the_patience_th_value_above_the_band():
    assert steps_of(rules.clip_rate_high, IN_BAND + [0.35, 0.4, 0.38, 0.41], CLIP) == [11, 12]
    findings = rules.clip_rate_high([0.3, 0.3, 0.3], [7, 8, 9], CLIP).findings
    assert findings == [Finding("clip_rate_high", 9, 0.3, facts={"streak": 3})]
    # Not consecutive, or exactly at the band's edge: no finding.
    assert run(rules.clip_rate_high, [0.35, 0.35, 0.05, 0.35, 0.35, 0.05], CLIP) == []
    assert run(rules.clip_rate_high, [0.2] * 10, CLIP) == []


def test_clip_rate_low_needs_a_nonzero_value_in_the_run_and_an_off_policy_run():
    values = [0.05, 0.004, 0.003, 0.005, 0.004]
    assert steps_of(rules.clip_rate_low, values, CLIP) == [4, 5]
    assert run(rules.clip_rate_low, values, CLIP, off_policy=False) == []
    assert run(rules.clip_rate_low, [0.0] * 8, CLIP) == []  # all exactly 0: clip_rate_stuck_zero's
    assert steps_of(rules.clip_rate_low, [0.003, 0.0, 0.0], CLIP) == [3]  # one non-zero value suffices
    assert run(rules.clip_rate_low, [0.005, 0.02, 0.005, 0.02], CLIP) == []


def test_clip_rate_stuck_zero_counts_exact_zeros_off_policy():
    assert steps_of(rules.clip_rate_stuck_zero, [0.0] * 6, CLIP) == [5, 6]
    assert rules.clip_rate_stuck_zero([0.0] * 5, range(5), CLIP).findings[-1].facts == {"streak": 5}
    assert run(rules.clip_rate_stuck_zero, [0.0] * 6, CLIP, off_policy=False) == []
    assert run(rules.clip_rate_stuck_zero, [0.0, 0.0, 0.0, 0.0, 0.001, 0.0], CLIP) == []
    tolerant = ClipRateMonitorConfig(zero_atol=0.001)
    assert steps_of(rules.clip_rate_stuck_zero, [0.0, 0.0, 0.0, 0.0, 0.001, 0.0], tolerant) == [5, 6]


def test_clip_rate_drop_against_the_median_of_an_established_in_band_level():
    (finding,) = rules.clip_rate_drop(IN_BAND + [0.011], range(1, 10), CLIP).findings
    assert (finding.step, finding.value, finding.facts) == (9, 0.011, {"reference": 0.05})
    assert run(rules.clip_rate_drop, IN_BAND + [0.014], CLIP) == []  # above a quarter of 0.05
    assert run(rules.clip_rate_drop, [0.005, 0.006, 0.004, 0.005, 0.005, 0.006, 0.0], CLIP) == []  # below the band
    assert run(rules.clip_rate_drop, [0.05, 0.05, 0.001], CLIP) == []  # fewer than min_history values before


def test_clip_rate_jump_that_stays_in_the_band():
    findings = rules.clip_rate_jump(IN_BAND + [0.16, 0.17, 0.16, 0.18], range(1, 13), CLIP).findings
    assert [(f.step, f.facts["streak"]) for f in findings] == [(11, 3), (12, 4)]
    assert findings[0].facts["reference"] == pytest.approx(0.05)  # the median the jump started from
    assert run(rules.clip_rate_jump, IN_BAND + [0.19, 0.05, 0.05, 0.19, 0.05], CLIP) == []  # single spikes
    assert run(rules.clip_rate_jump, IN_BAND + [0.3, 0.3, 0.3, 0.3], CLIP) == []  # past the band: clip_rate_high


# ---------------------------------------------------------------------------------------------------------------
# EntropyMonitor's rules


def test_entropy_collapse_below_the_floor():
    config = EntropyMonitorConfig(entropy_floor=0.03, floor_patience=2, max_drop=None)
    findings = rules.entropy_collapse([0.5, 0.4, 0.02, 0.01], range(1, 5), config).findings
    assert [(f.step, f.variant, f.value, f.facts["streak"]) for f in findings] == [(4, "floor", 0.01, 2)]
    assert run(rules.entropy_collapse, [0.5, 0.02, 0.5, 0.02, 0.5], config) == []
    assert run(rules.entropy_collapse, [0.02] * 5, EntropyMonitorConfig(entropy_floor=None, max_drop=None)) == []


def test_entropy_collapse_relative_to_its_early_level():
    config = EntropyMonitorConfig(entropy_floor=None, max_drop=0.9, baseline_logs=5, smoothing=3)
    entropies = [0.8, 0.82, 0.79, 0.81, 0.8, 0.6, 0.3, 0.1, 0.07, 0.06, 0.06]
    result = rules.entropy_collapse(entropies, range(1, 12), config)
    # median of the last 3 below 10 % of 0.8 from the 10th log (median 0.07)
    assert [(f.step, f.variant, f.value) for f in result.findings] == [(10, "drop", 0.07), (11, "drop", 0.06)]
    assert result.findings[0].facts["drop_pct"] == pytest.approx(91.25)
    assert rules.entropy_baseline(result.memory, config) == pytest.approx(0.8)
    slow = [0.8 * (1 - 0.8 * t / 500) for t in range(500)]  # -80 % over the run
    assert run(rules.entropy_collapse, slow, ENTROPY) == []


def test_kl_spike_absolute_and_relative():
    relative = EntropyMonitorConfig(kl_max=None, kl_spike_factor=5.0)
    (finding,) = rules.kl_spike([0.02, 0.021, 0.019, 0.02, 0.022, 0.02, 0.15], range(1, 8), relative).findings
    assert (finding.step, finding.variant, finding.facts["ratio"]) == (7, "spike", pytest.approx(0.15 / 0.022))
    absolute = EntropyMonitorConfig(kl_max=0.5, kl_spike_factor=None)
    assert [f.variant for f in rules.kl_spike([0.1, 0.2, 0.6], range(3), absolute).findings] == ["max"]
    # KL growing from 0: 400x its median, but below kl_spike_min.
    assert run(rules.kl_spike, [1e-5, 2e-5, 1e-5, 2e-5, 1e-5, 4e-3, 8e-3, 9e-3], ENTROPY) == []
    assert run(rules.kl_spike, [0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1], ENTROPY) == []


def test_kl_spike_a_smooth_ramp_is_no_spike_and_a_6x_jump_is():
    """The issue's quickstart run: KL rising smoothly from 0 (the old median rule fired at 0.020) and a 6x jump
    (0.025 -> 0.152, which the old rule missed inside the ramp's alert episode)."""
    ramp = [0.0, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.012, 0.014, 0.016, 0.02, 0.025]
    assert run(rules.kl_spike, ramp, ENTROPY) == []
    findings = rules.kl_spike([*ramp, 0.152], range(1, 14), ENTROPY).findings
    assert [(f.step, f.variant) for f in findings] == [(13, "spike")]
    # healthy batches swing 2-3x around a level: no spike
    assert run(rules.kl_spike, [0.05, 0.02, 0.06, 0.03, 0.1, 0.04, 0.2, 0.08, 0.25, 0.1, 0.3], ENTROPY) == []


# ---------------------------------------------------------------------------------------------------------------
# RewardMonitor's rules


def test_reward_collapse_after_a_rise():
    config = RewardMonitorConfig(smoothing=5, min_rise=0.1, max_drop=0.5, collapse_patience=3)
    rewards = [0.1] * 5 + [0.3, 0.5, 0.7, 0.7, 0.7, 0.7, 0.7] + [0.1] * 8
    findings = rules.reward_collapse(rewards, range(1, 21), config).findings
    # smoothed: peak 0.7 (low 0.1), threshold 0.4; below it from log 15 (0.34): the third such log is 17
    assert [f.step for f in findings] == [17, 18, 19, 20]
    assert findings[0].facts["low"] == pytest.approx(0.1) and findings[0].facts["peak"] == pytest.approx(0.7)
    assert findings[0].value == pytest.approx(0.1)
    # never rose: a fall by less than min_rise is no collapse; below where it started by more is ("below_start")
    assert run(rules.reward_collapse, [0.3] * 10 + [0.25] * 10, config) == []
    fell = rules.reward_collapse([0.3] * 10 + [0.05] * 10, range(1, 21), config).findings
    assert fell and {f.variant for f in fell} == {"below_start"} and "lost_pct" not in fell[0].facts


def test_reward_collapse_catches_a_sign_flip_before_any_gain():
    """A reward whose sign flips (a reward bug) drops below where it started before it ever gained min_rise."""
    rewards = [0.03, 0.11, 0.14, 0.14, 0.16, 0.16, 0.16, 0.25] + [-0.27, -0.02, -0.14, -0.06, -0.17, -0.2]
    findings = rules.reward_collapse(rewards, range(1, 15), REWARD).findings
    assert findings and findings[0].variant == "below_start" and findings[0].step <= 12


def test_reward_collapse_ignores_a_dip_within_the_noise():
    def noisy(level, n):
        return [level + 0.05 * (-1) ** t for t in range(n)]

    rewards = noisy(0.2, 10) + noisy(0.4, 10) + noisy(0.25, 10)  # 75 % of the gain lost, ~3 standard errors
    assert run(rules.reward_collapse, rewards, REWARD) == []
    assert run(rules.reward_collapse, rewards, RewardMonitorConfig(min_drop_sigmas=0.0)) != []


def test_reward_no_signal():
    values = [0.5, 0.95, 0.97, 1.0, 0.92, 0.99, 1.0]
    assert steps_of(rules.reward_no_signal, values, REWARD) == [4, 5, 6, 7]
    assert run(rules.reward_no_signal, [0.95, 0.97, 0.5, 1.0, 0.92, 0.89, 0.99], REWARD) == []
    assert run(rules.reward_no_signal, values, RewardMonitorConfig(zero_std_max=None)) == []


def test_judge_failure():
    assert steps_of(rules.judge_failure, [0.05, 0.3, 0.5, 0.6], REWARD) == [3, 4]
    assert run(rules.judge_failure, [0.05, 0.3, 0.2, 0.5, 0.1], REWARD) == []  # 0.2 is not above 0.2
    assert run(rules.judge_failure, [0.9] * 5, RewardMonitorConfig(judge_failure_max=None)) == []


# ---------------------------------------------------------------------------------------------------------------
# StalenessMonitor's rules (asynchronous runs)


def test_dropped_share_counts_the_dropped_against_the_samples_trained_in_the_window():
    assert rules.dropped_share(16.0, 16.0, 1) == 0.5
    assert rules.dropped_share(0.0, 16.0, 3) == 0.0  # the key absent from the log: nothing dropped
    assert rules.dropped_share(8.0, 16.0, 2) == pytest.approx(0.2)  # 2 steps since the previous log: 32 trained
    assert rules.dropped_share(5.0, 0.0, 1) == 1.0
    assert rules.dropped_share(0.0, 0.0, 1) is None and rules.dropped_share(3.0, 16.0, 0) is None


def test_wait_share():
    assert rules.wait_share(0.9, 1.8) == 0.5 and rules.wait_share(1.0, 0.0) is None


def stale(shares, means=None, max_staleness=None, config=STALE):
    """stale_rollouts over ``shares`` at steps 1, 2, ...: (step, variant, value) of each finding."""
    result = rules.stale_rollouts(
        shares, range(1, len(shares) + 1), config, staleness_mean=means, max_staleness=max_staleness
    )
    return [(f.step, f.variant, f.value) for f in result.findings]


def test_stale_rollouts_fires_when_more_are_dropped_than_the_limit_for_patience_logs():
    shares = [0.0, 0.1, 0.6, 0.7, 0.55, 0.8, 0.2, 0.9, 0.9]
    assert stale(shares) == [(5, "dropped", 0.55), (6, "dropped", 0.8)]
    assert stale([0.5] * 6) == []  # the boundary: more than max_dropped_share, not equal
    assert stale([0.6, 0.6, 0.4, 0.6, 0.6]) == []  # consecutive logs only
    finding = rules.stale_rollouts([0.7] * 3, [4, 5, 6], STALE).findings[0]
    assert finding.facts == {"streak": 3, "dropped_share": 0.7, "staleness_mean": None, "max_staleness": None}
    assert stale([0.99] * 5, config=StalenessMonitorConfig(max_dropped_share=None)) == []


def test_stale_rollouts_pinned_at_max_staleness_counts_only_while_samples_are_dropped():
    at_limit = [2.0] * 4
    assert stale([0.1] * 4, at_limit, max_staleness=2) == [(3, "pinned", 2.0), (4, "pinned", 2.0)]
    # At the limit without drops: a pipeline that runs at max_staleness by design.
    assert stale([0.0] * 6, [2.0] * 6, max_staleness=2) == []
    assert stale([0.1] * 4, [1.9] * 4, max_staleness=2) == []  # one sample below the limit: not pinned
    assert stale([0.1] * 4, [0.0] * 4, max_staleness=0) == []  # max_staleness=0: every sample is at the limit
    assert stale([0.1] * 4, at_limit, max_staleness=None) == []  # the limit unknown
    assert stale([0.1] * 4, [2.0, None, 2.0, 2.0], max_staleness=2) == []  # not logged: not pinned
    assert stale([0.1] * 4, at_limit, max_staleness=2, config=StalenessMonitorConfig(watch_pinned=False)) == []
    # Both conditions: the dropped share is the one reported; the streak counts either.
    assert stale([0.1, 0.1, 0.7], [2.0] * 3, max_staleness=2) == [(3, "dropped", 0.7)]
    with pytest.raises(ValueError, match="staleness_mean has 1 values for 2 dropped shares"):
        stale([0.1, 0.1], [2.0], max_staleness=2)


def test_trainer_starved_fires_after_patience_logs_above_the_wait_share():
    assert steps_of(rules.trainer_starved, [0.5] + [0.95] * 6, STALE) == [6, 7]
    assert steps_of(rules.trainer_starved, [0.9] * 8, STALE) == []  # the boundary: above, not equal
    assert steps_of(rules.trainer_starved, [0.95] * 4 + [0.5] + [0.95] * 4, STALE) == []
    assert steps_of(rules.trainer_starved, [1.0] * 8, StalenessMonitorConfig(max_wait_share=None)) == []
    assert steps_of(
        rules.trainer_starved, [0.7] * 3, StalenessMonitorConfig(max_wait_share=0.6, starved_patience=2)
    ) == [2, 3]


# ---------------------------------------------------------------------------------------------------------------
# Memory, episodes


SERIES = [
    (rules.clip_rate_high, CLIP, IN_BAND + [0.35, 0.4, 0.05, 0.3, 0.3, 0.3]),
    (rules.clip_rate_low, CLIP, [0.05, 0.004, 0.0, 0.0, 0.005, 0.02, 0.004, 0.004, 0.004]),
    (rules.clip_rate_stuck_zero, CLIP, [0.0] * 4 + [0.01] + [0.0] * 7),
    (rules.clip_rate_drop, CLIP, IN_BAND + [0.011, 0.05, 0.05, 0.01]),
    (rules.clip_rate_jump, CLIP, IN_BAND + [0.16, 0.17, 0.05, 0.16, 0.18, 0.17, 0.19]),
    (rules.entropy_collapse, ENTROPY, [0.8, 0.82, 0.79, 0.81, 0.8, 0.6, 0.3, 0.02, 0.01, 0.06, 0.06]),
    (rules.kl_spike, ENTROPY, [0.02, 0.021, 0.019, 0.02, 0.022, 0.02, 0.15, 1.5, 0.02]),
    (rules.reward_collapse, REWARD, [0.1] * 5 + [0.7] * 7 + [0.1] * 8),
    (rules.reward_no_signal, REWARD, [0.95] * 7 + [0.1] + [1.0] * 6),
    (rules.judge_failure, REWARD, [0.3, 0.5, 0.1, 0.6, 0.7]),
    (rules.stale_rollouts, STALE, [0.1, 0.6, 0.7, 0.8, 0.2, 0.9, 0.9, 0.9]),
    (rules.trainer_starved, STALE, [0.95] * 6 + [0.1] + [0.99] * 5),
]


@pytest.mark.parametrize(("rule", "config", "values"), SERIES, ids=[rule.__name__ for rule, _, _ in SERIES])
def test_continuing_with_the_memory_equals_one_call_over_the_whole_series(rule, config, values):
    steps = list(range(1, len(values) + 1))
    whole = rule(values, steps, config)
    assert whole.findings, "the series must fire somewhere for this test to mean something"
    memory, findings = None, []
    for value, step in zip(values, steps):
        result = rule([value], [step], config, memory)
        findings += result.findings
        memory = result.memory
    assert findings == whole.findings and memory == whole.memory
    assert all(finding.rule == rule.__name__ for finding in findings)


def test_episode_starts_once_per_episode_rearm_and_start_step():
    steps = list(range(1, 9))

    def starts(condition_steps, **kwargs):
        findings = [Finding("r", step, 1.0) for step in condition_steps]
        return [f.step for f in rules.episode_starts(findings, steps, **kwargs).findings]

    assert starts([1, 2, 3, 5, 8], rearm_after=2) == [1, 8]  # one false observation does not end the episode
    assert starts([1, 2, 3, 5, 8], rearm_after=1) == [1, 5, 8]
    assert starts([1, 2, 3, 4, 5, 6], start_step=5) == [5]  # silent before start_step, fires at it
    assert starts([]) == []
    result = rules.episode_starts([Finding("r", 1, 1.0)], [1, 2], rearm_after=3)
    assert result.memory == {"active": True, "clear": 1}
    continued = rules.episode_starts([Finding("r", 3, 1.0)], [3], rearm_after=3, memory=result.memory)
    assert continued.findings == []  # still the same episode


# ---------------------------------------------------------------------------------------------------------------
# Settings


@pytest.mark.parametrize(
    "config_class", [ClipRateMonitorConfig, EntropyMonitorConfig, RewardMonitorConfig, StalenessMonitorConfig]
)
def test_every_setting_has_help_and_floats_are_normalised(config_class):
    for setting in dataclasses.fields(config_class):
        assert setting.metadata.get("help"), setting.name
    assert dataclasses.asdict(config_class()) == dataclasses.asdict(config_class(**dataclasses.asdict(config_class())))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config_class().__setattr__(dataclasses.fields(config_class)[0].name, 1)


def test_config_errors_name_the_value_and_the_fix():
    assert ClipRateMonitorConfig(healthy_min=0).healthy_min == 0.0 and isinstance(CLIP.healthy_min, float)
    with pytest.raises(ValueError, match=r"ClipRateMonitorConfig: healthy_max=1\.5 .*pass e\.g\. healthy_max=0\.2"):
        ClipRateMonitorConfig(healthy_max=1.5)
    with pytest.raises(TypeError, match=r"EntropyMonitorConfig: kl_metric='' must be a logged key"):
        EntropyMonitorConfig(kl_metric="")
    with pytest.raises(ValueError, match=r"RewardMonitorConfig: max_drop=0 must be > 0\.0 and <= 1\.0"):
        RewardMonitorConfig(max_drop=0)
    with pytest.raises(ValueError, match=r"StalenessMonitorConfig: max_wait_share=1 must be >= 0\.0 and < 1\.0"):
        StalenessMonitorConfig(max_wait_share=1)
    with pytest.raises(ValueError, match=r"StalenessMonitorConfig: max_staleness=-1 must be >= 0"):
        StalenessMonitorConfig(max_staleness=-1)
    with pytest.raises(TypeError, match=r"StalenessMonitorConfig: watch_pinned='yes' must be True or False"):
        StalenessMonitorConfig(watch_pinned="yes")
    with pytest.raises(TypeError, match=r"StalenessMonitorConfig: wait_metric='' must be a logged key"):
        StalenessMonitorConfig(wait_metric="")


def test_noise_sigma_and_median():
    assert rules.noise_sigma([1.0, 2.0]) == 0.0
    assert rules.noise_sigma([0.0, 1.0, 0.0, 1.0]) == pytest.approx(1 / (0.6745 * 2**0.5))
    assert rules.noise_sigma([float(t) for t in range(10)]) == pytest.approx(1 / (0.6745 * 2**0.5))  # a trend: 1
    assert rules.median([3.0, 1.0, 2.0]) == 2.0


# ---------------------------------------------------------------------------------------------------------------
# Alert texts


def sample_fields(rule):
    """Every field a template may name, with the monitor's defaults and plausible finding facts."""
    config = {"clip": CLIP, "entr": ENTROPY, "kl_s": ENTROPY, "stal": STALE, "trai": STALE}.get(rule[:4], REWARD)
    return {
        **dataclasses.asdict(config),
        "metric": "clip_ratio/region_mean",
        "value": 0.5,
        "streak": 4,
        "threshold": 0.0,
        "reference": 0.05,
        "ratio": 7.5,
        "entropy": 0.01,
        "baseline": 0.8,
        "smoothed": 0.07,
        "drop_pct": 91.25,
        "low": 0.1,
        "peak": 0.7,
        "lost_pct": 80.0,
        "learning_rate": 3e-5,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_iterations": 2,
        "use_vllm": False,
        "dropped_share": 0.62,
        "staleness_mean": 2.0,
        "max_staleness": None,  # a synchronous run; async_fields adds it
    }


def async_fields(rule, max_staleness=4):
    """`sample_fields` for an asynchronous run (TRL's AsyncGRPOConfig: no steps_per_generation/num_iterations)."""
    return {
        **sample_fields(rule),
        "steps_per_generation": None,
        "num_iterations": None,
        "use_vllm": True,
        "max_staleness": max_staleness,
    }


def test_the_table_covers_every_rule_and_every_template_formats():
    assert {name for name in dir(rules) if name in ALERTS} == set(ALERTS)  # each rule has its function
    for rule, text in ALERTS.items():
        assert text.meaning and text.check
        for variant in text.variants or [""]:
            for fields in (sample_fields(rule), async_fields(rule)):
                message = format_alert(rule, fields, variant)
                assert "{" not in message and "}" not in message and "What to do:" in message, rule


def test_the_alerts_say_when_the_run_is_asynchronous():
    low = format_alert("clip_rate_low", {**async_fields("clip_rate_low"), "value": 0.004})
    assert "in an off-policy run (asynchronous run: max_staleness=4, so samples up to 4 policy versions old" in low
    assert "steps_per_generation" not in low
    high = format_alert("clip_rate_high", async_fields("clip_rate_high"))
    assert "or for samples up to max_staleness=4 policy versions old (asynchronous run: lower max_staleness)" in high
    assert "asynchronous" not in format_alert("clip_rate_high", sample_fields("clip_rate_high"))
    assert "asynchronous" not in format_alert("clip_rate_high", async_fields("clip_rate_high", max_staleness=0))
    dropped = format_alert("stale_rollouts", async_fields("stale_rollouts"), "dropped")
    assert dropped.startswith("Stale rollouts dominate: 62% of the rollouts that reached the trainer were dropped")
    assert "more than max_staleness=4 policy versions old is dropped" in dropped
    pinned = format_alert("stale_rollouts", {**async_fields("stale_rollouts"), "staleness_mean": 4.0}, "pinned")
    assert "every sample trained was max_staleness=4 policy versions old (sample/staleness_mean 4)" in pinned
    starved = format_alert("trainer_starved", {**async_fields("trainer_starved"), "value": 0.95})
    assert "waited for rollouts 95.0% of its step time" in starved and "max_wait_share=0.9" in starved


def test_format_alert_fills_in_what_is_known_about_the_run():
    fields = sample_fields("clip_rate_high")
    message = format_alert("clip_rate_high", fields)
    assert message.startswith("clip rate (clip_ratio/region_mean) 50.0% has been above the healthy band (1.00%–20.0%)")
    assert "learning_rate=3e-05 too high for 2 update pass(es)" in message and "bf16/fp32" in message
    unknown = {**fields, "learning_rate": None, "num_iterations": None, "metric": "ipo/masked_ratio"}
    message = format_alert("clip_rate_high", unknown)
    assert message.startswith("IPO masked ratio 50.0%") and "the learning rate too high for the update" in message
    low = format_alert("clip_rate_low", {**fields, "value": 0.004})
    assert "0.40% has been below" in low and "(gradient_accumulation_steps=1, steps_per_generation=1" in low
    assert "(gradient_accumulation_steps" not in format_alert(
        "clip_rate_low", {**fields, "gradient_accumulation_steps": None}
    )
    floor = format_alert("entropy_collapse", {**sample_fields("entropy_collapse"), "baseline": None}, "floor")
    assert "below the floor 0.03 for 4 logs." in floor and "early level" not in floor
    with pytest.raises(KeyError):
        format_alert("entropy_collapse", sample_fields("entropy_collapse"), "no such variant")


def test_format_pct():
    assert [format_pct(x) for x in (0.0125, 0.05, 0.2, 1.0)] == ["1.25%", "5.00%", "20.0%", "100.0%"]


def test_monitor_alert_reads_its_meaning_from_the_table():
    alert = MonitorAlert("kl_spike", 3, "kl", 1.5, "warn", "...")
    assert alert.meaning == ALERTS["kl_spike"].meaning and alert.check == ALERTS["kl_spike"].check
    assert alert.log_key == "monitor/alerts/kl_spike"
    assert MonitorAlert("custom_rule", 3, "x", 1.0, "warn", "...").meaning == ""


def test_the_docs_describe_every_rule():
    table = (DOCS / "troubleshooting.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", table, flags=re.MULTILINE))
    assert documented == set(ALERTS)
    monitoring = (DOCS / "monitoring.md").read_text()
    assert set(re.findall(r"^### `([a-z_]+)`", monitoring, flags=re.MULTILINE)) == set(ALERTS)


# Final-answer rates per generation batch of quickstart RL runs at lr 3e-3 (IPO's probability region alone died on
# every seed; PPO-clip lived): the rule must fire on the dying runs, by the step they die at the latest, and not
# on the live ones.
DYING = {  # seed: (rates, first dead generation)
    0: ([0.91, 0.34, 0.00, 0.03], 2),
    1: ([0.88, 0.38, 0.47, 0.06], 3),
    2: ([0.81, 0.19, 0.47, 0.25, 0.16, 0.00], 1),
}
LIVE = [[0.91, 0.88, 0.91, 0.69], [0.88, 0.59, 0.69, 0.66, 0.44, 0.59], [0.81, 0.59, 0.62, 0.59, 0.69, 0.56]]


def test_answer_rate_collapse_fires_on_dying_runs_before_they_die_and_not_on_live_ones():
    config = REWARD
    for rates, dead in DYING.values():
        findings = rules.answer_rate_collapse(rates, list(range(len(rates))), config).findings
        assert findings and findings[0].step <= dead and findings[0].facts["peak"] == rates[0]
    for rates in LIVE:
        assert rules.answer_rate_collapse(rates, list(range(len(rates))), config).findings == []
    off = RewardMonitorConfig(answer_drop=None)
    assert rules.answer_rate_collapse(DYING[0][0], [0, 1, 2, 3], off).findings == []
    low = [0.1, 0.02, 0.0]  # never reached answer_min_peak: a task the policy has not learnt to answer yet
    assert rules.answer_rate_collapse(low, [0, 1, 2], config).findings == []
    # memory carries the peak across calls (one log at a time, as the monitor feeds it)
    memory = None
    fired = []
    for step, rate in enumerate(DYING[1][0]):
        result = rules.answer_rate_collapse([rate], [step], config, memory)
        memory, fired = result.memory, fired + [f.step for f in result.findings]
    assert fired == [1, 3]


def test_answer_rate_collapse_pools_small_logs_into_observations_of_32_roots():
    # An asynchronous trainer logs every optimizer step over a group or two: a rate of 8 roots moves by 1/8 with
    # each root. A healthy run's per-step rates around 0.75, one log at a time, as the monitor feeds them:
    healthy = [1.0, 0.75, 0.625, 0.875, 0.375, 0.75, 0.875, 0.625, 0.75, 0.5, 0.875, 0.75]

    def fired(rates, roots):
        memory, steps = None, []
        for step, rate in enumerate(rates):
            result = rules.answer_rate_collapse([rate], [step], REWARD, memory, roots=roots)
            memory, steps = result.memory, steps + [f.step for f in result.findings]
        return steps

    assert fired(healthy, roots=None) == [4]  # each log alone: 0.375 < half of the peak 1.0, a false alarm
    assert fired(healthy, roots=8.0) == []  # pooled by 4 logs: 0.81, 0.66, 0.72
    dying = [0.875, 0.75, 0.875, 0.75, 0.5, 0.375, 0.25, 0.25, 0.125, 0.0, 0.0, 0.0]
    assert fired(dying, roots=8.0) == [7, 11]  # pools 0.81, 0.34 (fires), 0.03
    assert fired([0.9, 0.1], roots=32.0) == [1]  # a log of 32 roots (the quickstart's generation batch) is one
