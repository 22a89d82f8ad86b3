"""The synchronous and the asynchronous judge-credit trainers agree: the same completions (scripted), the same judge
(a scripted server that picks spans from the trace) and the same rewards give each completion token the same
advantage ``A + cap_λ(c)_t`` in `JudgeCreditTrainer`'s scored batch and in `JudgeRolloutWorker`'s samples, and both
write the same audit-log layout and judge metric names."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from trl_ext.judge import AsyncChatClient, SpanJudge
from trl_ext.judge.audit import JudgeAuditLog
from trl_ext.judge.credit import DEFAULT_LABEL_SCORES
from trl_ext.quickstart.scripted_server import ScriptedChatServer
from trl_ext.testing import build_tiny_model_and_tokenizer
from trl_ext.trainers.async_judge import JudgeRolloutWorker
from trl_ext.trainers.async_seam import TOKEN_CREDIT_KEY
from trl_ext.trainers.judge_credit import JudgeCreditConfig, JudgeCreditTrainer

from ..utils import cpu_config_kwargs, generator_rollout_func
from .test_async_judge import ANSWERS, TurnTakingGenerator, digits
from .test_judge_trainer import SpanPickingJudge, capturing, judge_kwargs

PROMPT = "add 1 and 2"


def test_sync_and_async_judge_credit_give_every_token_the_same_advantage(tmp_path):
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    judge = SpanPickingJudge()
    dataset = Dataset.from_dict({"prompt": [PROMPT] * 4})
    with ScriptedChatServer(judge) as server:
        config = JudgeCreditConfig(
            **cpu_config_kwargs(str(tmp_path / "sync"), max_completion_length=16), **judge_kwargs(server)
        )
        worker = JudgeRolloutWorker(
            dataset=dataset,
            reward_funcs=[digits],
            tokenizer=tokenizer,
            generator=TurnTakingGenerator(tokenizer),
            judge=SpanJudge(
                AsyncChatClient.from_settings(config.judge_endpoint()), label_scores=DEFAULT_LABEL_SCORES, tools=[]
            ),
            num_generations=4,
            marker_every=1,
            audit=JudgeAuditLog(tmp_path / "async" / "judge_audit.jsonl"),
        )
        sync = capturing(JudgeCreditTrainer)(
            model,
            digits,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            # the worker's prompt rendering and sampler: both trainers score and judge the very same tokens
            rollout_func=generator_rollout_func(TurnTakingGenerator(tokenizer), worker.prompt_ids),
        )
        sync.model.train()
        sync._generate_and_score_completions([dict(row) for row in dataset])
        batch = sync.captured[-1]

        try:
            samples = worker.rollout([dataset[0]])
        finally:
            worker.stop()

    sync_rows = {}
    for row in range(batch["completion_ids"].shape[0]):
        mask = batch["completion_mask"][row].bool()
        ids = batch["completion_ids"][row][mask].tolist()
        sync_rows[tuple(ids)] = (batch["advantages"][row][mask], float(batch["outcome"][row]))
    async_rows = {}
    for sample in samples:
        completion = sample.completion_mask.astype(bool)
        credit = torch.as_tensor(sample.metrics[TOKEN_CREDIT_KEY])[completion]
        async_rows[tuple(sample.input_ids[completion].tolist())] = torch.tensor(sample.advantage) + credit
    assert len(sync_rows) == len(async_rows) == len(ANSWERS)  # each scripted completion once per group
    assert sync_rows.keys() == async_rows.keys()
    credited = 0
    for ids, (advantages, outcome) in sync_rows.items():
        torch.testing.assert_close(async_rows[ids].float(), advantages.float(), rtol=1e-6, atol=1e-6)
        credited += bool((advantages != outcome).any())
    assert credited >= 2  # the judge's spans were there: tokens with credit

    # The same metric names (less each runtime's own: the sync step's blocking time) and the same audit lines.
    pushed = {}
    while not worker.metrics_queue.empty():
        pushed.update({k: v for k, v in worker.metrics_queue.get_nowait().items() if k.startswith("judge/")})
    logged = {name: values[-1] for name, values in sync._metrics["train"].items() if name.startswith("judge/")}
    assert logged.keys() - {"judge/blocking_s"} == pushed.keys() and "judge/label/original_error" in pushed
    for name, value in pushed.items():  # and the same values, timings aside
        if name not in ("judge/latency_p50", "judge/wait_s"):
            expected = value[0] / value[1] if isinstance(value, tuple) else value
            assert logged[name] == pytest.approx(expected, rel=1e-5), name
    sync_audit = JudgeAuditLog(sync.judge_audit_path).read()
    async_audit = JudgeAuditLog(tmp_path / "async" / "judge_audit.jsonl").read()
    assert len(sync_audit) == len(async_audit) == 4
    extras = ("model_version", "group_id")  # where an asynchronous sample came from
    for record in async_audit:
        assert [key for key in record if key not in extras] == list(sync_audit[0]) and set(extras) <= set(record)
    by_hash = {record["completion_hash"]: record["spans"] for record in sync_audit}
    assert all(by_hash[record["completion_hash"]] == record["spans"] for record in async_audit)
