"""The group scoring every asynchronous method shares (`RolloutWorker.sample_groups`, `GRPOGroups`, `RLMT`): rewards
weighted by ``reward_weights`` and summed with a None skipped, as `GRPOTrainer` sums them; ``async def`` reward
functions awaited; ``log_metric`` passed; GRPOTrainer's group advantage under ``scale_rewards``. Real workers, a
tokenizer built in code and a generator that returns fixed completions."""

import math

import pytest

from trl_ext.advantages import async_group_advantages, group_advantages
from trl_ext.rewards.rlmt.method import RLMT
from trl_ext.rlm.generators import Completion
from trl_ext.rollouts import GRPOGroups
from trl_ext.testing import build_tiny_tokenizer
from trl_ext.trainers.async_worker import RolloutWorker

TEXTS = ["a b", "a b c d", "a", "a b c"]


class FixedGenerator:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompts):
        texts = [TEXTS[index % len(TEXTS)] for index in range(len(prompts))]
        ids = [list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
        return [Completion(token_ids=row, logprobs=[-0.5] * len(row)) for row in ids]


def length(completions, **kwargs):
    return [float(len(text)) for text in completions]


def sometimes_none(completions, **kwargs):
    return [None if index % 2 else 10.0 for index in range(len(completions))]


async def awaited(completions, log_metric, **kwargs):
    log_metric("custom/seen", float(len(completions)))
    return [1.0 for _ in completions]


def worker(method=None, **settings):
    tokenizer = build_tiny_tokenizer()
    return RolloutWorker(
        method=GRPOGroups() if method is None else method,
        dataset=[{"prompt": "q", "answer": "x"}],
        tokenizer=tokenizer,
        generator=FixedGenerator(tokenizer),
        num_generations=4,
        **settings,
    )


def test_rewards_are_weighted_sums_with_none_skipped_and_async_functions_awaited():
    group_worker = worker(reward_funcs=[length, sometimes_none, awaited], reward_weights=[1.0, 0.5, -2.0])
    samples = group_worker.rollout(group_worker.dataset)
    expected = [len(text) + (5.0 if index % 2 == 0 else 0.0) - 2.0 for index, text in enumerate(TEXTS)]
    assert [s.metrics["reward"] for s in samples] == pytest.approx(expected)
    assert [s.advantage for s in samples] == pytest.approx(async_group_advantages(expected))  # TRL's async worker's
    assert math.isnan(samples[1].metrics["rewards/sometimes_none"])
    logged = [group_worker.metrics_queue.get_nowait() for _ in range(group_worker.metrics_queue.qsize())]
    assert {"custom/seen": 4.0} in logged


@pytest.mark.parametrize("scale_rewards", ["group", "none"])
def test_method_workers_use_grpo_trainers_group_advantage(scale_rewards):
    rlmt = worker(RLMT(), reward_funcs=[length], scale_rewards=scale_rewards, reward_weights=[3.0])
    samples = rlmt.rollout(rlmt.dataset)
    rewards = [3.0 * len(text) for text in TEXTS]
    assert [s.metrics["reward"] for s in samples] == pytest.approx(rewards)
    assert [s.advantage for s in samples] == pytest.approx(group_advantages(rewards, scale_rewards))


def test_a_completion_no_function_scores_gets_zero_reward_or_no_advantage():
    def never(completions, **kwargs):
        return [None] * len(completions)

    grpo = worker(reward_funcs=[never])  # GRPOTrainer's nansum: 0
    assert [s.metrics["reward"] for s in grpo.rollout(grpo.dataset)] == [0.0] * 4
    rlmt = worker(RLMT(), reward_funcs=[never])  # unscored: left out of the advantage
    assert [s.advantage for s in rlmt.rollout(rlmt.dataset)] == [0.0] * 4


def test_bad_weights_and_scalings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"reward_weights=\[1.0, 2.0\] has 2 weight\(s\) for 1 reward function"):
        worker(reward_funcs=[length], reward_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="scale_rewards='batch'.*'group'.*'none'"):
        worker(reward_funcs=[length], scale_rewards="batch")
