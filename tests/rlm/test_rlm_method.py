"""`trl_ext.rlm.method.StepwiseRLM`, the stepwise RLM method both trainers drive: built the same from the synchronous
and the asynchronous config, the no-answer rule, the prompt cap, the tasks (its tree files: tests/test_jsonl.py)."""

from __future__ import annotations

import torch

from trl_ext.rlm.method import StepwiseRLM, answered_rewards
from trl_ext.rlm.tree_files import TREES_FOLDER
from trl_ext.testing import build_tiny_model_and_tokenizer
from trl_ext.trainers.async_rlm import AsyncStepwiseRLMConfig
from trl_ext.trainers.stepwise_rlm_config import StepwiseRLMConfig


def test_the_sync_and_async_configs_build_the_same_method(tmp_path):
    _, tokenizer = build_tiny_model_and_tokenizer(0)
    fields = dict(
        output_dir=str(tmp_path), use_cpu=True, max_depth=2, max_turns=3, context_column="doc",
        train_children=False, child_sampling="one", save_rollout_trees=True,
        chat_template_kwargs={"enable_thinking": False}, repl_timeout_s=5.0,
    )  # fmt: skip
    sync, sync_report = StepwiseRLM.from_arguments(StepwiseRLMConfig(**fields), tokenizer)
    asynchronous, async_report = StepwiseRLM.from_arguments(AsyncStepwiseRLMConfig(**fields), tokenizer)
    for method in (sync, asynchronous):
        assert method.scaffold == sync.scaffold and method.scaffold.max_turns == 3
        assert method.scaffold.sandbox.timeout_s == 5.0
        assert (method.context_column, method.train_children, method.child_sampling) == ("doc", False, "one")
        assert method.trees_dir == tmp_path / TREES_FOLDER
        # the engine renders every turn with the config's chat-template arguments, in both runtimes
        assert method.chat_template_kwargs == {"enable_thinking": False}
    assert sync_report == async_report
    off, _ = StepwiseRLM.from_arguments(StepwiseRLMConfig(**{**fields, "save_rollout_trees": False}), tokenizer)
    assert off.trees_dir is None and off.save_trees([], "train", 0, "rank0") == []


def test_a_root_without_an_answer_gets_zero_whatever_the_functions_said():
    rewards = torch.tensor([[1.0, 0.5], [0.75, -1.0], [0.25, 0.125]])
    out = answered_rewards(rewards, torch.tensor([True, False, True]))
    assert out is rewards  # in place: the trainer keeps this tensor
    assert out.tolist() == [[1.0, 0.5], [0.0, 0.0], [0.25, 0.125]]


def test_prompts_are_capped_only_where_the_scaffold_sets_no_cap(tmp_path):
    _, tokenizer = build_tiny_model_and_tokenizer(0)
    method, _ = StepwiseRLM.from_arguments(StepwiseRLMConfig(output_dir=str(tmp_path), use_cpu=True), tokenizer)
    assert method.scaffold.max_prompt_tokens is None
    method.cap_prompts(None)
    assert method.scaffold.max_prompt_tokens is None
    method.cap_prompts(300)
    method.cap_prompts(100)  # a cap once set is kept
    assert method.scaffold.max_prompt_tokens == 300
    tasks = method.tasks(["plain task", [{"role": "user", "content": "chat task"}]], ["ctx", None])
    assert [(task.prompt, task.context) for task in tasks] == [("plain task", "ctx"), ("chat task", None)]
    assert method.contexts([{"context": "a"}, {"prompt": "b"}]) == ["a", None]
