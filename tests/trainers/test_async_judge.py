"""`AsyncJudgeCreditTrainer` on the CPU without vLLM: the collated per-token advantages of a hand-built batch are
``A + cap_λ(c)`` (numbers worked out by hand), the loss on them equals the loss computed directly, a judge fault
gives zero credit (counted, audited, the worker goes on), and a short run trains against a scripted judge server on
127.0.0.1 with a scripted policy (weight sync a no-op). The run against ``vllm serve`` is the ``vllm`` group's."""

from __future__ import annotations

import itertools
import json
import math
import queue
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
from trl.experimental.async_grpo.packing import TreeRow

from trl_ext.judge import AsyncChatClient, SpanJudge
from trl_ext.judge.credit import rollout_credit
from trl_ext.judge.method import JudgeCredit
from trl_ext.quickstart.scripted_server import ErrorReply, ScriptedChatServer
from trl_ext.rlm import ScriptedGenerator
from trl_ext.rlm.generators import Completion
from trl_ext.samples import TrainingSample
from trl_ext.testing import build_tiny_model_and_tokenizer
from trl_ext.trainers.async_judge import (
    AsyncJudgeCreditConfig,
    AsyncJudgeCreditTrainer,
)
from trl_ext.trainers.async_seam import TOKEN_CREDIT_KEY, TokenCreditCollator, to_rollout_sample
from trl_ext.trainers.async_worker import RolloutWorker
from trl_ext.trainers.judge_credit_config import JudgeCreditConfig

from .test_ext_async_grpo import NoWeightSync
from .test_judge_trainer import SpanPickingJudge

DATASET = Dataset.from_dict({"prompt": ["add 1 and 2", "count to 3"] * 4, "answer": ["3", "1 2 3"] * 4})
ANSWERS = ("1 2 3 ab", "3", "x y z 4", "7 7")  # the scripted policy's completions, in turn


def digits(completions, **kwargs):
    """The fraction of digit characters: differs between the scripted completions, so advantages do too."""
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]


class TurnTakingGenerator(ScriptedGenerator):
    """Answers every prompt with the next of `ANSWERS` (EOS appended), whatever the prompt, each token with the
    log-prob -5.3 (near the tiny model's: its entropy is about 5.3 nats, so IPO keeps the tokens)."""

    def __init__(self, tokenizer):
        answers = itertools.cycle(ANSWERS)
        super().__init__(lambda _prompt: next(answers), tokenizer)

    def generate(self, prompts):
        return [Completion(c.token_ids, [-5.3] * len(c.token_ids)) for c in super().generate(prompts)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_judge")
    model, tokenizer = build_tiny_model_and_tokenizer(0, initializer_range=0.2)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def config(output_dir, server_url: str, **overrides) -> AsyncJudgeCreditConfig:
    settings = dict(
        output_dir=str(output_dir), judge_base_url=server_url, judge_model="scripted-judge", judge_tools=[],
        judge_max_retries=0, judge_timeout=5.0, marker_every=1, num_generations=4, max_inflight_tasks=8,
        per_device_train_batch_size=8, token_budget=0, max_staleness=100, max_steps=1, max_completion_length=16,
        learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        use_cpu=True, queue_maxsize=64,
    )  # fmt: skip
    settings.update(overrides)
    return AsyncJudgeCreditConfig(**settings)


def make_trainer(model_dir, output_dir, server_url, **overrides) -> AsyncJudgeCreditTrainer:
    trainer = AsyncJudgeCreditTrainer(
        str(model_dir),
        digits,
        args=config(output_dir, server_url, **overrides),
        train_dataset=DATASET,
        weight_transfer=NoWeightSync(),
        generator=TurnTakingGenerator(build_tiny_model_and_tokenizer(0)[1]),
    )
    return trainer


def collate(samples, collator_class=TokenCreditCollator) -> dict[str, torch.Tensor]:
    """One micro-batch of all ``samples`` on one row, as TRL's planner and the collator build it."""
    row = TreeRow()
    for sample in samples:
        row.add({
            "input_ids": torch.as_tensor(sample.input_ids), "completion_mask": torch.as_tensor(sample.completion_mask),
            "old_log_probs": torch.as_tensor(sample.old_log_probs), "advantage": sample.advantage,
            "group_id": sample.group_id, "metrics": sample.metrics,
        })  # fmt: skip
    return collator_class(pad_token_id=0).torch_call([[row]])


# ----------------------------------------------------------------------------------------------------------------
# A hand-built batch: per-token advantages A + cap_λ(c), worked out by hand
# ----------------------------------------------------------------------------------------------------------------
def span(start, end, label, confidence):
    return SimpleNamespace(start=start, end=end, label=label, confidence=confidence)


PROMPT = [1, 2, 3]
# Rollout 0: A = 0.5; 4 tokens, the last an EOS the judge never read (judged 3). Spans: original_error (-1) x 1.0
# over [0, 2) and key_progress (+0.5) x 0.5 over [1, 3): c = [-1, -0.75, 0.25, 0]; mean |c| over the 3 judged
# tokens = 2/3 > λ = 0.25, so c x 0.25 / (2/3) = 0.375: [-0.375, -0.28125, 0.09375, 0].
# Rollout 1: A = -0.5; 3 tokens, all judged. wasteful_loop (-0.25) x 0.4 over [2, 3): c = [0, 0, -0.1]; mean |c| =
# 0.1/3 <= λ: unchanged. Rollout 2: A = 0.0, a failed verdict: no spans, c = 0.
HAND_ROLLOUTS = [
    ([4, 5, 6, 7], 0.5, 3, [span(0, 2, "original_error", 1.0), span(1, 3, "key_progress", 0.5)]),
    ([4, 8, 9], -0.5, 3, [span(2, 3, "wasteful_loop", 0.4)]),
    ([10, 11], 0.0, 2, []),
]
HAND_ADVANTAGES = [0.125, 0.21875, 0.59375, 0.5] + [-0.5, -0.5, -0.6] + [0.0, 0.0]
LABELS = JudgeCreditConfig(output_dir="unused", judge_base_url="http://127.0.0.1:1/v1", judge_model="m").label_scores


def hand_samples(old_logps=None) -> list:
    samples = []
    for index, (completion, advantage, judged, spans) in enumerate(HAND_ROLLOUTS):
        credit = rollout_credit(spans, len(completion), judged, LABELS, 0.25)
        logps = old_logps[index] if old_logps is not None else [-1.0] * len(completion)
        sample = TrainingSample(
            PROMPT, completion, logps, advantage=advantage, token_credit=credit.tolist(), metrics={"reward": 1.0}
        )
        samples.append(to_rollout_sample(sample, 0))
    return samples


def test_collated_advantages_are_outcome_plus_capped_credit():
    assert rollout_credit(HAND_ROLLOUTS[0][3], 4, 3, LABELS, 0.25).tolist() == [-0.375, -0.28125, 0.09375, 0.0]
    samples = hand_samples()
    assert samples[0].metrics[TOKEN_CREDIT_KEY][:3] == (0.0, 0.0, 0.0)  # 0 over the prompt
    batch = collate(samples)
    torch.testing.assert_close(batch["advantages"][0], torch.tensor(HAND_ADVANTAGES))
    assert batch["segment_id"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2]
    assert all(TOKEN_CREDIT_KEY not in sample["metrics"] for sample in batch_samples(samples))


def batch_samples(samples):
    row = TreeRow()
    for sample in samples:
        row.add({"input_ids": torch.as_tensor(sample.input_ids), "completion_mask": torch.as_tensor(sample.completion_mask),
                 "old_log_probs": torch.as_tensor(sample.old_log_probs), "advantage": sample.advantage,
                 "group_id": 0, "metrics": sample.metrics})  # fmt: skip
    collator = TokenCreditCollator(pad_token_id=0)
    collator.torch_call([[row]])
    assert "reward" in collator.metrics and TOKEN_CREDIT_KEY not in collator.metrics  # the credit is not logged
    return row.samples


def test_samples_without_credit_collate_exactly_as_trl():
    samples = hand_samples()
    for sample in samples:
        sample.metrics = {"reward": 1.0}
    ours, trls = collate(samples), collate(samples, DataCollatorForRollout)
    assert ours.keys() == trls.keys() and all(torch.equal(ours[key], trls[key]) for key in ours)


def test_credit_of_the_wrong_length_is_named():
    sample = hand_samples()[0]
    sample.metrics = {**sample.metrics, TOKEN_CREDIT_KEY: (0.0, 1.0)}
    with pytest.raises(ValueError, match="2 credit values for 7 input_ids positions"):
        collate([sample])


# ----------------------------------------------------------------------------------------------------------------
# The loss on those advantages = the loss computed directly, token by token
# ----------------------------------------------------------------------------------------------------------------
def completion_logps(model, prompt, completion) -> torch.Tensor:
    """(C,) log p of each completion token under ``model``, one plain forward of the whole sequence."""
    ids = torch.tensor([prompt + completion])
    logps = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
    return logps[torch.arange(len(prompt) - 1, ids.shape[1] - 1), ids[0, len(prompt) :]]


@pytest.mark.parametrize("loss_type", ["dapo", "ipo"])
def test_loss_on_credited_advantages_equals_the_direct_loss(model_dir, tmp_path, loss_type):
    tau, cap = 0.5, 8.0
    with ScriptedChatServer(SpanPickingJudge()) as server:
        trainer = make_trainer(model_dir, tmp_path, server.base_url, loss_type=loss_type, ipo_kl_tau=tau,
                               ipo_threshold=1.0)  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    old = [(-0.2 - 2.0 * torch.rand(len(c), generator=generator)).tolist() for c, *_ in HAND_ROLLOUTS]
    trainer.model.eval()
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.compute_loss(trainer.model, collate(hand_samples(old)))

    reference = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    advantages = torch.tensor(HAND_ADVANTAGES).split([len(c) for c, *_ in HAND_ROLLOUTS])
    terms = []
    with torch.no_grad():
        for (completion, *_), advantage, old_logps in zip(HAND_ROLLOUTS, advantages, old, strict=True):
            log_ratio = completion_logps(reference, PROMPT, completion) - torch.tensor(old_logps)
            ratio = log_ratio.exp()
            if loss_type == "dapo":
                eps = trainer.epsilon_low
                terms.append(-torch.min(ratio * advantage, ratio.clamp(1 - eps, 1 + eps) * advantage))
            else:
                terms.append(-advantage * ratio.clamp(max=cap) + tau * log_ratio.pow(2))
    direct = torch.cat(terms).mean()  # TRL's normaliser: the micro-batch's loss tokens
    assert abs(direct.item()) > 1e-3
    assert loss.item() == pytest.approx(direct.item(), rel=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# The worker: judge faults give zero credit, counted and audited; the thread goes on
# ----------------------------------------------------------------------------------------------------------------
def half_broken(judge):
    """Answers like `judge` for traces of an even length, HTTP 500 for the others."""

    def script(request):
        trace = re.search(r"TRACE\n(.*?)\n", request["messages"][1]["content"], re.DOTALL).group(1)
        return judge(request) if len(trace) % 2 == 0 else ErrorReply(500)

    return script


def make_worker(server, tmp_path, **overrides):
    _, tokenizer = build_tiny_model_and_tokenizer(0)
    client = AsyncChatClient(server.base_url, "scripted-judge", max_retries=0, timeout=5.0)
    method = JudgeCredit(
        SpanJudge(client, tools=[]), tokenizer, marker_every=1, audit_path=tmp_path / "judge_audit.jsonl"
    )
    method.verdict_reward = 0
    settings = dict(
        dataset=DATASET, reward_funcs=[digits], tokenizer=tokenizer, generator=TurnTakingGenerator(tokenizer),
        method=method, num_generations=4, scale_rewards="none",
    )  # fmt: skip
    settings.update(overrides)
    return RolloutWorker(**settings)


def drain(worker) -> list[dict]:
    items = []
    while True:
        try:
            items.append(worker.metrics_queue.get_nowait())
        except queue.Empty:
            return items


def credit_of(sample) -> np.ndarray:
    return np.asarray(sample.metrics[TOKEN_CREDIT_KEY])[sample.completion_mask.astype(bool)]


def test_a_judge_fault_gives_zero_credit_counted_and_audited(tmp_path):
    with ScriptedChatServer(half_broken(SpanPickingJudge())) as server:
        worker = make_worker(server, tmp_path)
        samples = worker.rollout([DATASET[0], DATASET[1]])
    verdicts = worker.method.last_verdicts
    assert len(samples) == len(verdicts) == 8
    failed = [not verdict.ok for verdict in verdicts]
    assert 0 < sum(failed) < 8  # both kinds happened
    for sample, verdict in zip(samples, verdicts, strict=True):
        credit = credit_of(sample)
        assert (np.count_nonzero(credit) == 0) == (not verdict.ok or not verdict.spans)
        assert np.abs(credit).mean() <= 0.25 + 1e-6  # the λ cap
    rewards = [sample.metrics["reward"] for sample in samples[:4]]
    assert [s.advantage for s in samples[:4]] == pytest.approx([r - sum(rewards) / 4 for r in rewards])  # Dr. GRPO
    (metrics,) = drain(worker)
    assert metrics["judge/failure_ratio"] == (float(sum(failed)), 8.0)
    assert metrics["judge/refused_ratio"] == (0.0, 8.0)  # HTTP 500s: failed, not refused
    assert metrics["judge/share"][0] > 0 and metrics["judge/latency_p50"] > 0
    records = [json.loads(line) for line in open(tmp_path / "judge_audit.jsonl")]
    assert [record["status"] != "ok" for record in records] == failed
    assert all(r["verdict_given"].startswith("digits = ") for r in records)
    assert {r["group_id"] for r in records} == {0, 1} and all(len(r["prompt_hash"]) == 16 for r in records)


def test_a_judge_that_is_down_never_stops_the_worker(tmp_path):
    with ScriptedChatServer(lambda request: ErrorReply(500)) as server:
        worker = make_worker(server, tmp_path)
        worker.start()
        try:
            samples = [worker.rollout_buffer.get(timeout=120) for _ in range(8)]
            worker.check_health(stale_after_s=300)
        finally:
            worker.stop()
    assert all(np.count_nonzero(credit_of(sample)) == 0 for sample in samples)
    assert worker.errors == 0
    failures = [m["judge/failure_ratio"] for m in drain(worker) if "judge/failure_ratio" in m]
    assert failures and all(numerator == denominator for numerator, denominator in failures)


# ----------------------------------------------------------------------------------------------------------------
# A short run on the worker thread, against the scripted judge server
# ----------------------------------------------------------------------------------------------------------------
def test_trains_two_steps_with_judge_credit(model_dir, tmp_path):
    with ScriptedChatServer(SpanPickingJudge()) as server:
        trainer = make_trainer(model_dir, tmp_path, server.base_url, max_steps=2)
        before = {name: param.detach().clone() for name, param in trainer.model.named_parameters()}
        trainer.train()
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(history) == 2 and all(math.isfinite(entry["loss"]) for entry in history)
    assert all("ipo/masked_ratio" in entry for entry in history)
    # The worker's per-run metrics reach the steps that logged them: a step whose samples came from a run that had not
    # reported yet has none (on AVX2 kernels the first step logged no judge metrics).
    judged = [entry for entry in history if "judge/failure_ratio" in entry]
    assert judged, history
    for entry in judged:
        assert entry["judge/failure_ratio"] == 0.0 and entry["judge/share"] > 0, entry
        assert entry["judge/label/original_error"] >= 1, entry
    assert not any(key.startswith("trl_ext/") for entry in history for key in entry)  # the credit is not logged
    assert any(not torch.equal(before[name], param) for name, param in trainer.model.named_parameters())
    records = [json.loads(line) for line in open(trainer.judge_audit_path)]
    assert len(records) >= 16 and {r["status"] for r in records} == {"ok"}
    assert trainer.rollout_worker._stop.is_set()


# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------
SHARED = ("loss_type", "scale_rewards", "judge_lambda", "label_scores", "marker_every", "judge_base_url",
          "judge_model", "judge_api_key_env", "judge_max_concurrency", "judge_timeout", "judge_max_retries",
          "judge_structured_output", "judge_temperature", "judge_max_tokens", "judge_tools", "judge_max_tool_rounds",
          "judge_verdict_reward", "judge_answer_column", "judge_solution_column", "judge_audit_log")  # fmt: skip


def test_config_shares_the_judge_names_defaults_and_meanings(tmp_path):
    endpoint = dict(judge_base_url="http://127.0.0.1:1/v1", judge_model="m")
    ours = AsyncJudgeCreditConfig(output_dir=str(tmp_path), use_cpu=True, **endpoint)
    sync = JudgeCreditConfig(output_dir=str(tmp_path), use_cpu=True, **endpoint)
    for name in SHARED:
        assert getattr(ours, name) == getattr(sync, name), name
    assert ours.judge_endpoint() == sync.judge_endpoint()
    with pytest.raises(ValueError, match="scale_rewards='batch'"):
        AsyncJudgeCreditConfig(output_dir=str(tmp_path), scale_rewards="batch", **endpoint)
    with pytest.raises(ValueError, match="judge_lambda=-1"):
        AsyncJudgeCreditConfig(output_dir=str(tmp_path), judge_lambda=-1.0, **endpoint)
    with pytest.raises(TypeError, match="AsyncJudgeCreditConfig"):
        AsyncJudgeCreditTrainer("unused", digits, args=None, train_dataset=DATASET)


def test_check_trl_async_names_a_changed_order_of_loss_terms(monkeypatch):
    from trl.experimental.async_grpo import packing

    from trl_ext.trainers.async_seam import check_trl_async

    original = packing.TreeRow.pack

    def reversed_terms(self):  # a TRL that emits each row's loss terms in another order
        packed = original(self)
        for key in ("token_index", "old_log_probs", "advantages", "segment_id"):
            packed[key] = packed[key].flip(0)
        return packed

    monkeypatch.setattr(packing.TreeRow, "pack", reversed_terms)
    with pytest.raises(ImportError, match="per-token advantages|loss terms per sample.*pip install 'trl>=1.16"):
        check_trl_async()
