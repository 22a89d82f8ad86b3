"""The synchronous and the asynchronous RLM trainers agree on the same rollouts: the same scripted trees
(`VariantGenerator`, real REPLs) through `StepwiseRLMTrainer`'s generation step and through the asynchronous
`RolloutWorker` (of `StepwiseRLM`) give the same metrics (the worker's pushed values reduced as TRL's asynchronous
trainer reduces a log window), and, for the same p_old and policy, the same loss and gradient."""

from __future__ import annotations

import json
import queue

import pytest
import torch
from datasets import Dataset
from trl.experimental.async_grpo.async_grpo_trainer import _reduce_metric

from trl_ext.testing import VariantGenerator, yes_reward
from trl_ext.trainers.async_rlm import AsyncStepwiseRLMConfig, AsyncStepwiseRLMTrainer
from trl_ext.trainers.async_worker import RolloutWorker

from .parity import assert_same_gradients, step_both
from .test_async_rlm import collate
from .test_ext_async_grpo import NoWeightSync
from .test_stepwise_rlm import generation_inputs, make_trainer, turn_logps

SYNC_ONLY = {"rlm/padding_rows"}  # rows added to keep the synchronous micro-batches equal


def pushed_metrics(worker: RolloutWorker) -> dict[str, list]:
    window: dict[str, list] = {}
    while True:
        try:
            for key, value in worker.metrics_queue.get_nowait().items():
                window.setdefault(key, []).append(value)
        except queue.Empty:
            return window


def test_sync_and_async_trainers_log_the_same_rlm_metric_names_and_values(tmp_path):
    trainer = make_trainer(tmp_path, save_rollout_trees=False)
    trainer.model.train()
    trainer._generate_and_score_completions(generation_inputs(count=4))
    sync = {
        key: values[-1]
        for key, values in trainer._metrics["train"].items()
        if key.startswith(("rlm/", "repl/")) and key not in SYNC_ONLY
    }

    worker = RolloutWorker(
        dataset=Dataset.from_dict({"prompt": ["root task"], "context": ["abcdefgh"]}),
        reward_funcs=[yes_reward],
        tokenizer=trainer.processing_class,
        generator=VariantGenerator(trainer.processing_class),
        method=trainer.method,  # the very method object the synchronous trainer drives
        num_generations=4,
    )
    samples = worker.rollout([generation_inputs(count=1)[0]])
    assert sorted(json.dumps(tree.to_dict(worker.tokenizer)) for tree in worker.method.last_trees) == sorted(
        json.dumps(tree.to_dict(worker.tokenizer)) for tree in trainer.last_rollout_trees
    )  # the same rollouts (the two engines meet the scripted variants in another order)
    assert len(samples) == sync["rlm/rows_per_root"] * 4
    window = pushed_metrics(worker)
    asynchronous = {key: _reduce_metric(key, values) for key, values in window.items()}

    assert sorted(sync) == sorted(asynchronous)
    assert {"rlm/child_answer_rate", "repl/truncated_answers_total", "rlm/prompt_too_long_total"} <= set(sync)
    for key, value in sync.items():
        assert asynchronous[key] == pytest.approx(value, rel=1e-6), key


def test_sync_and_async_trainers_give_the_same_loss_and_gradient(tmp_path):
    """The same scripted trees, the same p_old (the policy at sampling time) and the same moved policy: the
    synchronous trainer's padded turn rows and the asynchronous trainer's tree-packed samples give one loss
    (mean_g L_subtree(root_g)) and one gradient."""
    sync = make_trainer(tmp_path / "sync", num_iterations=2)  # TRL keeps the old log-probs: ratios move off 1
    sync.model.train()
    sync.current_gradient_accumulation_steps = 1
    batch = sync._generate_and_score_completions(generation_inputs(count=4))

    model_dir = tmp_path / "model"
    sync.model.save_pretrained(model_dir)
    sync.processing_class.save_pretrained(model_dir)
    asynchronous = make_async_trainer(model_dir, tmp_path / "async", sync.processing_class)
    worker = asynchronous.rollout_worker
    worker.method.scaffold = sync.method.scaffold  # the same scaffold: the same prompt cap, the same trees
    samples = worker.rollout([generation_inputs(count=1)[0]])
    assert sorted(json.dumps(tree.to_dict()) for tree in worker.method.last_trees) == sorted(
        json.dumps(tree.to_dict()) for tree in sync.last_rollout_trees
    )
    with torch.no_grad():  # p_old = the sampling-time policy's log-probs (the scripted sampler's are made up)
        old = [
            turn_logps(sync.model, turn).tolist()
            for tree in worker.method.last_trees
            for turn in tree.turn_samples(train_children=True, child_sampling="all")
        ]
    assert len(old) == len(samples)
    for sample, logps in zip(samples, old, strict=True):
        sample.old_log_probs[-len(logps) :] = logps
    # the same update for both: every ratio moves, PPO-clip clips some tokens
    sync_loss, async_loss = step_both(sync, batch, asynchronous, collate(samples), scale=0.1)

    assert 0.0 < sync._metrics["train"]["clip_ratio/region_mean"][-1] < 1.0
    assert abs(sync_loss.item()) > 1e-3
    assert async_loss.item() == pytest.approx(sync_loss.item(), rel=1e-5)
    assert_same_gradients(sync.model, asynchronous.model)


def make_async_trainer(model_dir, output_dir, tokenizer):
    args = AsyncStepwiseRLMConfig(
        output_dir=str(output_dir), max_depth=2, max_turns=4, num_generations=4, max_inflight_tasks=4,
        per_device_train_batch_size=14, token_budget=0, max_staleness=100, max_steps=1, max_completion_length=64,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0, gradient_checkpointing=False,
        save_rollout_trees=False,
    )  # fmt: skip
    return AsyncStepwiseRLMTrainer(
        str(model_dir),
        yes_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["root task"] * 4, "context": ["abcdefgh"] * 4}),
        processing_class=tokenizer,
        generator=VariantGenerator(tokenizer),
        weight_transfer=NoWeightSync(),
    )
