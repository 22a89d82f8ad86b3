"""The synchronous and the asynchronous RLMT trainers agree: the same scripted completions (each running past its
stop string) through `RLMTTrainer` (TRL's ``rollout_func``) and the asynchronous `RolloutWorker` of `RLMT` are cut
at the same token, get the same rewards and advantages, and log the same stop-cut ratio."""

from __future__ import annotations

import pytest
from datasets import Dataset

from trl_ext.rewards.rlmt.method import RLMT
from trl_ext.testing import build_tiny_model_and_tokenizer
from trl_ext.trainers.async_worker import RolloutWorker
from trl_ext.trainers.rlmt import RLMTConfig, RLMTTrainer

from ..utils import cpu_config_kwargs, generator_rollout_func
from .test_async_rlmt import QUESTIONS, ZERO_COMPLETIONS, CyclingGenerator


def response_length(completions, **kwargs):
    return [float(len(text)) for text in completions]


def test_sync_and_async_rlmt_cut_score_and_advantage_alike(tmp_path):
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    config = RLMTConfig(**cpu_config_kwargs(str(tmp_path), rlmt_format="zero", max_completion_length=64, beta=0.0))
    worker = RolloutWorker(
        method=RLMT(config.stop_strings),
        dataset=config.rlmt_dataset(Dataset.from_dict({"prompt": [QUESTIONS[0]] * 4})),
        reward_funcs=[response_length],
        tokenizer=tokenizer,
        generator=CyclingGenerator(tokenizer, ZERO_COMPLETIONS),
        num_generations=4,
    )
    sync = RLMTTrainer(
        model,
        response_length,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": [QUESTIONS[0]] * 4}),
        processing_class=tokenizer,
        # the worker's prompt rendering and sampler: both trainers cut, score and train the very same tokens
        rollout_func=generator_rollout_func(
            CyclingGenerator(tokenizer, ZERO_COMPLETIONS), lambda prompt: worker.method.prompt_ids(prompt, worker)
        ),
    )
    rows = [dict(row) for row in sync.train_dataset]
    batch = sync._generate_and_score_completions(rows)
    samples = worker.rollout([rows[0]])

    sync_rows = {}
    for row in range(batch["completion_ids"].shape[0]):
        ids = batch["completion_ids"][row][batch["completion_mask"][row].bool()].tolist()
        sync_rows[tuple(ids)] = float(batch["advantages"][row])
    async_rows = {tuple(s.input_ids[s.completion_mask.astype(bool)].tolist()): s.advantage for s in samples}
    assert len(sync_rows) == len(async_rows) == len(ZERO_COMPLETIONS)
    assert sync_rows.keys() == async_rows.keys()  # cut at the same token, nothing past the stop string kept
    assert all(tokenizer.decode(ids).endswith("</response>") for ids in sync_rows)
    for ids, advantage in sync_rows.items():
        assert async_rows[ids] == pytest.approx(advantage, rel=1e-5, abs=1e-6)
    assert len(set(sync_rows.values())) > 1  # the rewards differ: a real advantage

    pushed = {}
    while not worker.metrics_queue.empty():
        pushed.update(worker.metrics_queue.get_nowait())
    numerator, denominator = pushed["rlmt/stop_cut_ratio"]
    assert sync._metrics["train"]["rlmt/stop_cut_ratio"][-1] == numerator / denominator == 1.0
