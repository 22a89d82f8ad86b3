"""A real tiny run that dies, and the warnings that come before it (issue 43).

The tiny model, cold-started to answer ``yes`` or ``no`` after one REPL turn, is trained by `StepwiseRLMTrainer`
(the IPO loss with its ratio band, LoRA, constant learning rate, no KL term) with a reward that scores every answer
-1 and no answer 0: a reward where silence pays, one of the causes `answer_rate_collapse` names. The policy learns to
stop answering; once no rollout answers, every group's rewards agree (all 0) and nothing trains again: final-answer
rate 0, reward 0, grad norm 0 to the end of the run, the dead state of issue 43's collapsed IPO runs. The monitor's
`answer_rate_collapse` must speak while some group still has a reward spread, before the first dead step; the
trainer's own no-learning-signal warning (`LearningSignalWatch`) follows once 5 steps have trained nothing.
"""

from __future__ import annotations

import logging

import pytest
from transformers import TrainerCallback

from trl_ext.callbacks import default_monitors
from trl_ext.trainers.learning_signal import NO_SIGNAL_STEPS

from .test_stepwise_rlm_e2e import cold_started_trainer

STEPS = 18


def silence_pays(completions, **kwargs):
    """-1 for every final answer (``yes`` and ``no`` are both wrong); a rollout without one gets 0 from the trainer."""
    return [-1.0 for _ in completions]


def dead_from(logs: list[dict]) -> int | None:
    """The first step of the run's last stretch in which no root answered and nothing trained (None: alive)."""
    dead = None
    for entry in logs:
        if entry["grad_norm"] == 0.0 and entry["rlm/final_answer_rate"] == 0.0 and entry["reward"] == 0.0:
            dead = entry["step"] if dead is None else dead
        else:
            dead = None
    return dead


@pytest.mark.slow
def test_a_policy_that_stops_answering_dies_and_the_answer_alert_comes_first(tmp_path, caplog):
    monitors = default_monitors(action="warn", stop_on_collapse=False)
    trainer = cold_started_trainer(
        tmp_path,
        silence_pays,
        16 * STEPS,
        callbacks=monitors,
        per_device_train_batch_size=16,  # 4 groups of 4 roots per step
        num_generations=4,
        max_steps=STEPS,
        learning_rate=1.5e-2,
        lr_scheduler_type="constant",
        beta=0.0,
        seed=1,
    )
    assert trainer.args.ipo_ratio_band == 0.2  # IPO as it ships, with its ratio band
    warned_at = []
    caplog.set_level(logging.WARNING, logger="trl_ext.trainers.learning_signal")
    trainer.add_callback(_StepOfWarnings(caplog, warned_at))
    trainer.train()

    logs = [{"step": i, **entry} for i, entry in enumerate((h for h in trainer.state.log_history if "loss" in h), 1)]
    rates = [entry["rlm/final_answer_rate"] for entry in logs]
    assert len(logs) == STEPS and max(rates[:4]) >= 0.75, rates  # the cold start answers
    dead = dead_from(logs)
    assert dead is not None and STEPS - dead + 1 >= NO_SIGNAL_STEPS, rates  # dead, and for 5 steps or more
    alerts = [(alert["rule"], alert["step"]) for monitor in monitors for alert in monitor.alerts]
    answer_alerts = [step for rule, step in alerts if rule == "answer_rate_collapse"]
    assert answer_alerts and answer_alerts[0] < dead, (alerts, dead, rates)
    spread_before = [entry for entry in logs if answer_alerts[0] <= entry["step"] < dead]
    assert any(entry["grad_norm"] > 0 for entry in spread_before)  # the alert came while the run still trained
    assert warned_at == [dead + NO_SIGNAL_STEPS - 1], (warned_at, dead)  # then the trainer's own warning


class _StepOfWarnings(TrainerCallback):
    """Records the global step of each no-learning-signal warning as it is logged."""

    def __init__(self, caplog, steps: list[int]):
        self.caplog, self.steps, self.seen = caplog, steps, 0

    def on_step_end(self, args, state, control, **kwargs):
        records = [r for r in self.caplog.records if r.name == "trl_ext.trainers.learning_signal"]
        self.steps += [state.global_step] * (len(records) - self.seen)
        self.seen = len(records)
