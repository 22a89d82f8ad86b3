"""The synchronous and the asynchronous RLM trainers log the same metrics for the same rollouts (issue 44): the same
scripted trees (`VariantGenerator`, real REPLs) through `StepwiseRLMTrainer`'s generation step and through the
asynchronous `RLMRolloutWorker`, whose pushed values are reduced as TRL's asynchronous trainer reduces a log window."""

from __future__ import annotations

import json
import queue

import pytest
from datasets import Dataset
from trl.experimental.async_grpo.async_grpo_trainer import _reduce_metric

from trl_ext.testing import VariantGenerator, yes_reward
from trl_ext.trainers.async_rlm.worker import RLMRolloutWorker

from .test_stepwise_rlm import generation_inputs, make_trainer

SYNC_ONLY = {"rlm/padding_rows"}  # rows added to keep the synchronous micro-batches equal


def pushed_metrics(worker: RLMRolloutWorker) -> dict[str, list]:
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

    worker = RLMRolloutWorker(
        dataset=Dataset.from_dict({"prompt": ["root task"], "context": ["abcdefgh"]}),
        reward_funcs=[yes_reward],
        tokenizer=trainer.processing_class,
        generator=VariantGenerator(trainer.processing_class),
        scaffold=trainer._rlm_config,
        num_generations=4,
    )
    samples = worker.rollout([generation_inputs(count=1)[0]])
    assert sorted(json.dumps(tree.to_dict(worker.tokenizer)) for tree in worker.last_trees) == sorted(
        json.dumps(tree.to_dict(worker.tokenizer)) for tree in trainer.last_rollout_trees
    )  # the same rollouts (the two engines meet the scripted variants in another order)
    assert len(samples) == sync["rlm/rows_per_root"] * 4
    window = pushed_metrics(worker)
    asynchronous = {key: _reduce_metric(key, values) for key, values in window.items()}

    assert sorted(sync) == sorted(asynchronous)
    assert {"rlm/child_answer_rate", "repl/truncated_answers_total", "rlm/prompt_too_long_total"} <= set(sync)
    for key, value in sync.items():
        assert asynchronous[key] == pytest.approx(value, rel=1e-6), key
