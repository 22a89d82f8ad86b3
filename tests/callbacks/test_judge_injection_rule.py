"""The `judge_injection` rule (issue 30, class 1): off by default, fires on suspected judge injections when enabled,
for the span judge's and the rubric judge's keys."""

from __future__ import annotations

from trl_ext.callbacks import RewardMonitor, default_monitors, rules
from trl_ext.callbacks.alerts import format_alert
from trl_ext.callbacks.configs import RewardMonitorConfig


def test_judge_injection_rule_is_off_by_default_and_fires_when_enabled():
    values, steps = [0.0, 2.0, 0.0, 1.0, 3.0], [1, 2, 3, 4, 5]
    assert rules.judge_injection(values, steps, RewardMonitorConfig()).findings == []
    enabled = RewardMonitorConfig(judge_injection_max=0)
    assert [f.step for f in rules.judge_injection(values, steps, enabled).findings] == [2, 4, 5]
    patient = RewardMonitorConfig(judge_injection_max=0, judge_injection_patience=2)
    assert [f.step for f in rules.judge_injection(values, steps, patient).findings] == [5]
    # verdicts read out of free text (no structured output): on at 0 even by default
    text = rules.judge_injection(values, steps, RewardMonitorConfig(), text_verdicts=True).findings
    assert [(f.step, f.facts["threshold"]) for f in text] == [(2, 0.0), (4, 0.0), (5, 0.0)]


def test_judge_injection_monitor_is_on_for_the_logs_whose_verdicts_came_as_text():
    monitor = RewardMonitor()  # judge_injection_max=None
    assert monitor.observe({"judge/injection_suspected": 2.0, "judge/text_verdicts": 0.0}, 1) == []
    [alert] = monitor.observe({"judge/injection_suspected": 2.0, "judge/text_verdicts": 3.0}, 2)
    assert alert.rule == "judge_injection" and "above 0 for 1 logs" in alert.message
    rubric = RewardMonitor(judge_injection_metric="rubric_judge/injection_suspected")
    [alert] = rubric.observe({"rubric_judge/injection_suspected": 1.0, "rubric_judge/text_verdicts": 1.0}, 1)
    assert "judge/text_verdicts is above 0" in alert.message


def test_judge_injection_monitor_reads_the_rubric_key_and_is_silent_in_the_default_set():
    [reward] = [m for m in default_monitors() if isinstance(m, RewardMonitor)]
    assert reward.config.judge_injection_max is None  # a JSON-answer task could fire it on a healthy run
    monitor = RewardMonitor(judge_injection_max=0, judge_injection_metric="rubric_judge/injection_suspected")
    assert monitor.config.judge_injection_metric == "rubric_judge/injection_suspected"
    message = format_alert("judge_injection", {"value": 3.0, "threshold": 0, "streak": 1})
    assert message.startswith("Suspected judge injection: 3 rollouts") and "What to do:" in message
