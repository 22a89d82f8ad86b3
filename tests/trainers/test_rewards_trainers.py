"""Every reward plugs into `trl.GRPOTrainer` and `trl_ext.ExtGRPOTrainer` unchanged: real short runs of the tiny model.

One run per trainer with all four rewards at once (rubric judge over a real local HTTP server, char-span F1, the
local reward-model scorer, the served reward-model scorer): standard prompts for TRL's trainer, conversational
prompts for ours, so both completion formats go through every reward.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

from trl_ext import ExtGRPOConfig, ExtGRPOTrainer
from trl_ext.quickstart.scripted_server import ScriptedChatServer
from trl_ext.rewards import CharSpanF1Reward, RewardModelScorer, RubricJudgeReward, ServedRewardModelScorer
from trl_ext.testing import build_tiny_model_and_tokenizer, build_tiny_reward_model

from ..rewards.test_rlmt import ClassifyServer
from ..utils import cpu_config_kwargs

CONTEXT = "The cat sat on the mat."
QUESTIONS = ["Where did the cat sit?", "What sat on the mat?", "Which animal sat?", "Where is the mat?"]


def judge_script(request):
    """Scores that vary with the prediction, so that group advantages are non-zero."""
    prediction = request["messages"][1]["content"].split("PREDICTION\n", 1)[1]
    code = sum(map(ord, prediction))
    return json.dumps({"explanation": "scripted", "precision": 1 + code % 10, "recall": 1 + (code // 10) % 10})


def dataset(conversational: bool) -> Dataset:
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS] if conversational else QUESTIONS
    return Dataset.from_dict(
        {
            "prompt": prompts,
            "answer": ["on the mat"] * 4,
            "evidence": [json.dumps(["cat sat on the mat"])] * 4,
            "context": [CONTEXT] * 4,
        }
    )


def rewards(judge_url: str, rm_url: str, rm, rm_tokenizer) -> list:
    return [
        RubricJudgeReward(
            base_url=judge_url, model="judge", api_key_env=None, max_retries=0, timeout=10, repair_attempts=0
        ),
        CharSpanF1Reward(gold_column="evidence", context_column="context"),
        RewardModelScorer(rm, rm_tokenizer, strict=False),  # the untrained policy writes no <think>
        ServedRewardModelScorer(rm_url, "tiny-rm", strict=False, max_retries=0, timeout=10, name="served_rm"),
    ]


NAMES = ("rubric_judge", "char_span_f1", "reward_model", "served_rm")


@pytest.mark.parametrize(
    ("trainer_cls", "config_cls", "conversational", "extra"),
    [
        (GRPOTrainer, GRPOConfig, False, {}),
        (ExtGRPOTrainer, ExtGRPOConfig, True, {"loss_type": "ipo"}),
    ],
    ids=["trl-GRPOTrainer", "ExtGRPOTrainer-ipo"],
)
def test_all_rewards_train_the_tiny_model(tmp_path, trainer_cls, config_cls, conversational, extra):
    policy, tokenizer = build_tiny_model_and_tokenizer(seed=0)
    rm, rm_tokenizer = build_tiny_reward_model(seed=2, initializer_range=0.5)
    with ScriptedChatServer(judge_script) as judge, ClassifyServer(rm, rm_tokenizer) as rm_server:
        funcs = rewards(judge.base_url, rm_server.base_url, rm, rm_tokenizer)
        config = config_cls(**cpu_config_kwargs(str(tmp_path), max_completion_length=10, **extra))
        trainer = trainer_cls(
            policy,
            funcs,
            args=config,
            train_dataset=dataset(conversational),
            processing_class=tokenizer,
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        )
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
        trainer.train()
        judge_requests = len(judge.requests)
    logs = [h for h in trainer.state.log_history if "reward" in h and "loss" in h]
    assert len(logs) == 2
    for log in logs:
        for name in NAMES:
            assert math.isfinite(log[f"rewards/{name}/mean"]), (name, log)
        assert 0.0 < log["rewards/rubric_judge/mean"] <= 1.0  # the judge answered: no fallback zeros
        assert log["rubric_judge/fallback_ratio"] == 0.0
        assert log["rewards/char_span_f1/mean"] == 0.0  # the untrained policy quotes no evidence
        # Served and local scorers read the same reward model the same way.
        assert log["rewards/served_rm/mean"] == pytest.approx(log["rewards/reward_model/mean"], abs=1e-4)
        assert log["reward_std"] > 0
    assert judge_requests == 2 * 4  # one request per completion: 2 steps of 4 completions
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)
