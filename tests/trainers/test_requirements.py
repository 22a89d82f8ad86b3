"""What the trainers check when they are built (`trl_ext.trainers.requirements`): columns named in a setting, the
packages, columns and prompt format of the reward functions. Each failure is an error at construction naming the
value and the fix, where it used to be an error (or a silent fallback) minutes into training."""

from __future__ import annotations

import re

import pytest
from datasets import Dataset, IterableDataset
from trl.rewards import accuracy_reward, get_cosine_scaled_reward, think_format_reward

from trl_ext.rewards import CharSpanF1Reward, RubricJudgeReward
from trl_ext.rlm import ScriptedGenerator
from trl_ext.testing import build_tiny_model_and_tokenizer
from trl_ext.trainers import requirements
from trl_ext.trainers.judge_credit import JudgeCreditConfig, JudgeCreditTrainer
from trl_ext.trainers.requirements import check_reward_requirements, dataset_columns
from trl_ext.trainers.stepwise_rlm import StepwiseRLMConfig, StepwiseRLMTrainer

from ..utils import cpu_config_kwargs, digit_reward, toy_dataset

DEAD_JUDGE = dict(judge_base_url="http://127.0.0.1:1/v1", judge_model="m", judge_tools=[])


def chat_dataset(**columns) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 2 + 3?"}]] * 4, **columns})


def judge_trainer(tmp_path, reward, dataset, **overrides):
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    config = JudgeCreditConfig(**cpu_config_kwargs(str(tmp_path)), **{**DEAD_JUDGE, **overrides})
    return JudgeCreditTrainer(model, reward, args=config, train_dataset=dataset, processing_class=tokenizer)


@pytest.fixture
def math_verify(monkeypatch):
    """Set whether math-verify counts as installed (the check reads `is_math_verify_available`)."""

    def set_available(available: bool) -> None:
        monkeypatch.setattr(requirements, "is_math_verify_available", lambda: available)

    return set_available


# ----------------------------------------------------------------------------------------------------------------
# Reward functions: packages, prompt format, columns
# ----------------------------------------------------------------------------------------------------------------
def test_trl_accuracy_reward_without_math_verify_fails_at_construction(tmp_path, math_verify):
    math_verify(False)
    with pytest.raises(
        ImportError, match=re.escape("'accuracy_reward' (trl.rewards) verifies answers with math-verify")
    ):
        judge_trainer(tmp_path, accuracy_reward, chat_dataset(solution=["5"] * 4))
    with pytest.raises(ImportError, match=re.escape("pip install math-verify")):
        check_reward_requirements([get_cosine_scaled_reward(16)], [], owner="T")


def test_trl_rewards_reject_string_prompts_naming_the_conversational_fix(tmp_path, math_verify):
    math_verify(True)
    dataset = Dataset.from_dict({"prompt": ["What is 2 + 3?"] * 4, "solution": ["5"] * 4})
    with pytest.raises(ValueError, match="reads conversational completions") as caught:
        judge_trainer(tmp_path, accuracy_reward, dataset)
    assert "the train dataset's prompts are strings" in str(caught.value)
    assert "{'prompt': [{'role': 'user', 'content': row['prompt']}]}" in str(caught.value)
    with pytest.raises(ValueError, match="'think_format_reward' \\(trl.rewards\\) reads conversational"):
        check_reward_requirements([think_format_reward], [("eval", dataset)], owner="T")
    check_reward_requirements([think_format_reward], [("train", chat_dataset())], owner="T")  # conversational: fine


def test_reward_arguments_without_default_must_be_dataset_columns(tmp_path, math_verify):
    math_verify(True)
    with pytest.raises(ValueError, match="'accuracy_reward' needs the dataset column 'solution'") as caught:
        judge_trainer(tmp_path, accuracy_reward, chat_dataset(answer=["5"] * 4))
    assert "its columns: ['prompt', 'answer']" in str(caught.value)
    trainer = judge_trainer(tmp_path, accuracy_reward, chat_dataset(solution=["5"] * 4))  # all there: builds
    assert trainer.reward_func_names == ["accuracy_reward"]

    def needs_answer(completions, answer, **kwargs):
        return [0.0] * len(completions)

    datasets = [("train", Dataset.from_dict({"prompt": ["p"], "answers": ["a"]}))]
    with pytest.raises(ValueError, match=re.escape("needs the dataset column 'answer'")) as caught:
        check_reward_requirements([needs_answer], datasets, owner="T")
    assert "Did you mean 'answers'?" in str(caught.value)
    check_reward_requirements([needs_answer], datasets, owner="T", extra_columns=None)  # a rollout_func may add it
    check_reward_requirements([needs_answer], datasets, owner="T", extra_columns=["answer"])


def test_trl_ext_rewards_declare_their_columns():
    datasets = [("train", Dataset.from_dict({"prompt": ["p"], "evidence": [[]]}))]
    with pytest.raises(ValueError, match="'char_span_f1' needs the dataset column 'context'"):
        check_reward_requirements([CharSpanF1Reward()], datasets, owner="T")
    check_reward_requirements([CharSpanF1Reward(context_column=None)], datasets, owner="T")
    rubric = RubricJudgeReward(base_url="http://127.0.0.1:1/v1", model="m", query_column="question")
    assert rubric.required_columns == ["answer", "question"]
    with pytest.raises(ValueError, match="needs the dataset column 'answer'"):
        check_reward_requirements([rubric], datasets, owner="T")


# ----------------------------------------------------------------------------------------------------------------
# Columns named in a setting
# ----------------------------------------------------------------------------------------------------------------
def test_judge_reference_columns_set_explicitly_must_exist(tmp_path):
    judge_trainer(tmp_path, digit_reward, toy_dataset())  # the default 'answer'/'solution' are optional
    with pytest.raises(ValueError, match=re.escape("judge_answer_column='ans', but the train dataset has no")):
        judge_trainer(tmp_path, digit_reward, toy_dataset(), judge_answer_column="ans")


def stepwise_trainer(tmp_path, train_dataset, eval_dataset=None, **overrides):
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    config = StepwiseRLMConfig(**cpu_config_kwargs(str(tmp_path), loss_type="dapo", **overrides))
    return StepwiseRLMTrainer(
        model,
        digit_reward,
        args=config,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        generator=ScriptedGenerator(lambda prompt: "FINAL(yes)", tokenizer),
    )


def test_stepwise_context_column_typo_is_an_error_for_every_dataset_kind(tmp_path):
    rows = {"prompt": ["task"] * 4, "context": ["abcd"] * 4}
    with pytest.raises(ValueError) as caught:
        stepwise_trainer(tmp_path, Dataset.from_dict(rows), context_column="contexts")
    message = str(caught.value)
    assert "StepwiseRLMTrainer: context_column='contexts', but the train dataset has no column 'contexts'" in message
    assert "(its columns: ['prompt', 'context']). Did you mean 'context'?" in message

    def rows_without_features():
        yield from ({"prompt": "task", "context": "abcd"} for _ in range(4))

    iterable = IterableDataset.from_generator(rows_without_features)
    assert iterable.column_names is None and dataset_columns(iterable) == ["prompt", "context"]  # read from row 1
    with pytest.raises(ValueError, match="context_column='contexts', but the train dataset has no column"):
        stepwise_trainer(tmp_path, iterable, context_column="contexts", max_steps=1)
    with pytest.raises(
        ValueError, match=re.escape("context_column='task_context', but the eval ('held_out') dataset")
    ):
        stepwise_trainer(
            tmp_path,
            Dataset.from_dict({**rows, "task_context": rows["context"]}),
            {"held_out": Dataset.from_dict(rows)},
            context_column="task_context",
        )
    trainer = stepwise_trainer(tmp_path, Dataset.from_dict({"prompt": ["task"] * 4}))  # default 'context': optional
    assert trainer.args.context_column == "context"
