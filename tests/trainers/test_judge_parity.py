"""The synchronous and the asynchronous judge-credit trainers agree: the same completions (scripted), the same judge
(a scripted server that picks spans from the trace) and the same rewards give each completion token the same
advantage ``A + cap_λ(c)_t`` in `JudgeCreditTrainer`'s scored batch and in the asynchronous `RolloutWorker`'s
samples (`JudgeCredit.rollout`), both write the same audit-log layout and judge metric names and values, and, for the
same p_old and policy, one training step has the same loss and gradient in both."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from trl_ext.judge import AsyncChatClient, SpanJudge
from trl_ext.judge.audit import JudgeAuditLog
from trl_ext.judge.credit import DEFAULT_LABEL_SCORES
from trl_ext.judge.method import JudgeCredit
from trl_ext.quickstart.scripted_server import ScriptedChatServer
from trl_ext.testing import build_tiny_model_and_tokenizer
from trl_ext.trainers.async_judge import AsyncJudgeCreditConfig, AsyncJudgeCreditTrainer
from trl_ext.trainers.async_seam import TOKEN_CREDIT_KEY
from trl_ext.trainers.async_worker import RolloutWorker
from trl_ext.trainers.judge_credit import JudgeCreditConfig, JudgeCreditTrainer

from ..utils import cpu_config_kwargs, generator_rollout_func
from .parity import assert_same_gradients, step_both
from .test_async_judge import ANSWERS, TurnTakingGenerator, collate, digits
from .test_ext_async_grpo import NoWeightSync
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
        worker = RolloutWorker(
            dataset=dataset,
            scale_rewards="none",
            reward_funcs=[digits],
            tokenizer=tokenizer,
            generator=TurnTakingGenerator(tokenizer),
            method=JudgeCredit(
                SpanJudge(
                    AsyncChatClient.from_settings(config.judge_endpoint()), label_scores=DEFAULT_LABEL_SCORES, tools=[]
                ),
                tokenizer,
                marker_every=1,
                audit_path=tmp_path / "async" / "judge_audit.jsonl",
            ),
            num_generations=4,
        )
        sync = capturing(JudgeCreditTrainer)(
            model,
            digits,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            # the worker's prompt rendering and sampler: both trainers score and judge the very same tokens
            rollout_func=generator_rollout_func(
                TurnTakingGenerator(tokenizer), lambda prompt: worker.method.prompt_ids(prompt, worker)
            ),
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

    # The same metric names and the same audit lines.
    pushed = {}
    while not worker.metrics_queue.empty():
        pushed.update({k: v for k, v in worker.metrics_queue.get_nowait().items() if k.startswith("judge/")})
    logged = {name: values[-1] for name, values in sync._metrics["train"].items() if name.startswith("judge/")}
    assert logged.keys() == pushed.keys() and "judge/label/original_error" in pushed
    for name, value in pushed.items():  # and the same values, timings aside
        if name not in ("judge/latency_p50", "judge/wait_s", "judge/blocking_s"):
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


@pytest.mark.parametrize("loss_type", ["ipo", "dapo"])
def test_sync_and_async_judge_credit_give_the_same_loss_and_gradient(tmp_path, loss_type):
    """The same judged group through `JudgeCreditTrainer`'s step (padded rows) and through
    `AsyncJudgeCreditTrainer`'s (the worker's samples packed in one row, the credit added by its collator), with
    p_old the sampling-time policy's log-probs and the same moved policy: one loss (rel 1e-5), one gradient (1e-4)."""
    model, tokenizer = build_tiny_model_and_tokenizer(0, initializer_range=0.2)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    dataset = Dataset.from_dict({"prompt": [PROMPT] * 4})
    with ScriptedChatServer(SpanPickingJudge()) as server:
        shared = dict(loss_type=loss_type, max_completion_length=16, **judge_kwargs(server))
        asynchronous = AsyncJudgeCreditTrainer(
            str(model_dir),
            digits,
            args=AsyncJudgeCreditConfig(
                **cpu_config_kwargs(str(tmp_path / "async"), max_steps=1, **shared),
                token_budget=0,
                max_staleness=100,
                max_inflight_tasks=8,
            ),
            train_dataset=dataset,
            processing_class=tokenizer,
            generator=TurnTakingGenerator(tokenizer),
            weight_transfer=NoWeightSync(),
        )
        worker = asynchronous.rollout_worker
        # num_iterations=2: TRL keeps the sampling-time log-probs as p_old, so the ratios move off 1
        sync = JudgeCreditTrainer(
            model,
            digits,
            args=JudgeCreditConfig(**cpu_config_kwargs(str(tmp_path / "sync"), num_iterations=2, **shared)),
            train_dataset=dataset,
            processing_class=tokenizer,
            rollout_func=generator_rollout_func(
                TurnTakingGenerator(tokenizer), lambda prompt: worker.method.prompt_ids(prompt, worker)
            ),
        )
        sync.model.train()
        sync.current_gradient_accumulation_steps = 1
        batch = sync._generate_and_score_completions([dict(row) for row in dataset])
        samples = worker.rollout([dataset[0]])
        worker.stop()

    # p_old, the sampling-time policy's log-probs (the scripted sampler's are made up): TRL's old log-probs of the sync
    # batch, for PPO-clip (TRL reads old_per_token_logps) and IPO (trl-ext reads the sampler's, as the async samples
    # carry them), and the same for each sample of the same completion.
    batch["sampling_per_token_logps"] = batch["old_per_token_logps"]
    old_by_ids = {}
    for row in range(batch["completion_ids"].shape[0]):
        mask = batch["completion_mask"][row].bool()
        old_by_ids[tuple(batch["completion_ids"][row][mask].tolist())] = batch["old_per_token_logps"][row][mask]
    for sample in samples:
        completion = sample.completion_mask.astype(bool)
        sample.old_log_probs[completion] = old_by_ids[tuple(sample.input_ids[completion].tolist())].numpy()
    sync_loss, async_loss = step_both(sync, batch, asynchronous, collate(samples), scale=0.05)

    assert abs(sync_loss.item()) > 1e-3
    if loss_type == "ipo":  # the policy moved enough that the trust region masks some tokens, not all
        assert 0.0 < sync._metrics["train"]["ipo/masked_ratio"][-1] < 1.0
    assert async_loss.item() == pytest.approx(sync_loss.item(), rel=1e-5)
    assert_same_gradients(sync.model, asynchronous.model)
