"""The default monitors on real short runs (issue 31; the measured evaluation on longer runs and more pathologies is
benchmarks/monitors_eval.py): the judge-credit miniature of the quickstart (a tiny model after cold-start SFT on
digit copying, `JudgeCreditTrainer`, IPO, LoRA, a scripted judge on 127.0.0.1) raises nothing on a healthy run, and
a learning rate x30 injected mid-run is caught by its rule within 5 steps."""

from __future__ import annotations

import pytest
from transformers import TrainerCallback

from trl_ext.callbacks import default_monitors
from trl_ext.quickstart.copy_task import copy_task_splits
from trl_ext.quickstart.judge_credit import JudgeCreditSettings, build_policy, judge_for, sft_copy_policy, train_rl
from trl_ext.quickstart.scripted_server import ScriptedChatServer
from trl_ext.quickstart.training import fresh_copy

STEPS, ONSET = 14, 8
EXPECTED = {"kl_spike", "entropy_collapse", "clip_rate_high"}  # what a learning rate x30 should raise


class LearningRateTimes(TrainerCallback):
    """Multiplies the learning rate (a constant schedule: its base rates too) by ``factor`` from step ``onset``."""

    def __init__(self, factor: float, onset: int) -> None:
        self.factor, self.onset, self.done = factor, onset, False

    def on_step_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if not self.done and state.global_step + 1 >= self.onset:
            self.done = True
            lr_scheduler.base_lrs = [lr * self.factor for lr in lr_scheduler.base_lrs]
            for group in optimizer.param_groups:
                group["lr"] *= self.factor


@pytest.fixture(scope="module")
def sft_policy(tmp_path_factory):
    js = JudgeCreditSettings.default(0)
    sft_rows, rl_set, _ = copy_task_splits(js.seed, js.num_sft_examples, 64, js.num_eval_examples, js.digits)
    model, tokenizer = build_policy(js)
    model = sft_copy_policy(model, tokenizer, sft_rows, js, tmp_path_factory.mktemp("sft"), progress=False)
    return js, model, tokenizer, rl_set


def train(sft_policy, output, factor: float) -> list[tuple[str, int]]:
    js, model, tokenizer, rl_set = sft_policy
    monitors = default_monitors(action="warn", stop_on_collapse=False)
    with ScriptedChatServer(judge_for(js), model="judge") as judge:
        train_rl(
            fresh_copy(model),
            tokenizer,
            rl_set,
            js,
            js.judge_lambda,
            output,
            judge.base_url,
            monitors=[*monitors, LearningRateTimes(factor, ONSET)],
            config_overrides={"max_steps": STEPS, "beta": 0.04},  # beta > 0: the KL is logged
        )
    return sorted((alert["rule"], alert["step"]) for monitor in monitors for alert in monitor.alerts)


@pytest.mark.slow
def test_a_learning_rate_blow_up_is_caught_within_5_steps_and_the_healthy_run_is_quiet(sft_policy, tmp_path):
    assert train(sft_policy, tmp_path / "healthy", factor=1.0) == []
    sick = train(sft_policy, tmp_path / "sick", factor=30.0)
    assert [alert for alert in sick if alert[1] < ONSET] == []  # nothing before the onset
    caught = [step for rule, step in sick if rule in EXPECTED]
    assert caught and min(caught) - ONSET <= 5, sick
