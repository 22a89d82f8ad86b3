"""Staleness in asynchronous training (docs/async.md), on the CPU without vLLM: the worker's gate (`StalenessGate`: a
run starts only while its samples cannot go stale), where a resumed worker's prompts continue, each sample's policy
version carried to the loss (``<metric>/lag_<k>``), and `LocalPolicy`, the in-process sampler that receives the
trainer's weights."""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from trl.experimental.async_grpo.packing import TreeRow

from trl_ext.losses import version_lags
from trl_ext.rlm.generators import SamplingSettings
from trl_ext.rollouts import RolloutMethod
from trl_ext.samples import TrainingSample
from trl_ext.serving.server_watch import ServerWatch
from trl_ext.testing import build_tiny_model_and_tokenizer, yes_reward
from trl_ext.trainers import LocalPolicy
from trl_ext.trainers.async_rlm import AsyncStepwiseRLMConfig, AsyncStepwiseRLMTrainer
from trl_ext.trainers.async_seam import LossWeightCollator, to_rollout_sample
from trl_ext.trainers.async_seam.weights import MODEL_VERSION_KEY, SAMPLE_VERSIONS_KEY, VersionTaggedQueue
from trl_ext.trainers.async_worker import RolloutWorker, StalenessGate

from .test_async_rlm import DATASET, make_trainer, model_dir  # noqa: F401  (model_dir: a fixture)


# ----------------------------------------------------------------------------------------------------------------
# The gate: c + q + r <= (max_staleness + 1) * samples_per_version
# ----------------------------------------------------------------------------------------------------------------
def test_gate_lets_a_run_start_only_while_it_cannot_go_stale():
    gate = StalenessGate(max_staleness=1, samples_per_version=10)
    gate.new_version(consumed=0)
    assert gate.room(consumed=0, queued=5)  # no run size known yet
    gate.last_run_samples = 8
    # 3 taken at this version, 7 queued, a run of 8: the last sample is trained at version +1 (18 <= 20)
    assert gate.room(consumed=3, queued=7)
    # 3 + 10 + 8 = 21 > 20: its last sample would be trained 2 versions later, past max_staleness=1
    assert not gate.room(consumed=3, queued=10)
    assert gate.room(consumed=3, queued=0)  # nothing queued: the trainer would wait for ever
    gate.new_version(consumed=10)  # the trainer took 7 more and published: 0 taken at the new version
    assert gate.room(consumed=10, queued=12)  # 0 + 12 + 8 = 20


def test_gate_at_staleness_zero_waits_for_the_queue_to_drain():
    gate = StalenessGate(max_staleness=0, samples_per_version=8)
    gate.last_run_samples = 8
    gate.new_version(consumed=0)
    assert not gate.room(consumed=0, queued=8)
    assert not gate.room(consumed=4, queued=4)
    assert gate.room(consumed=8, queued=0)


def test_gate_measures_samples_per_version_without_a_figure():
    gate = StalenessGate(max_staleness=0)  # a token budget: the trainer gives no count
    gate.last_run_samples = 5
    gate.new_version(consumed=0)
    assert gate.room(consumed=0, queued=50)  # nothing measured yet
    gate.new_version(consumed=6)
    assert gate.measured_per_version == 6
    assert not gate.room(consumed=6, queued=2)  # 0 + 2 + 5 > 6
    assert gate.room(consumed=6, queued=1)  # 0 + 1 + 5 = 6
    assert not gate.room(consumed=7, queued=1)  # 1 taken at this version: 1 + 1 + 5 > 6


class Counting(RolloutMethod):
    """A method whose run turns each row into ``per_row`` one-token samples; records the rows of every run."""

    name = "counting"

    def __init__(self, per_row: int) -> None:
        self.per_row = per_row
        self.runs: list[list[int]] = []

    def rollout(self, rows, runtime, version):
        self.runs.append([row["index"] for row in rows])
        samples = []
        for _ in rows:
            group_id = runtime.next_group_id()
            samples += [TrainingSample([1], [2], [-0.5], advantage=0.0, group_id=group_id)] * self.per_row
        return samples


class CountingWorker(RolloutWorker):
    """The rollout worker of `Counting`; ``runs``: the rows of every run."""

    def __init__(self, dataset: Any, per_row: int = 2, groups_per_run: int = 1, queue_maxsize: int = 0) -> None:
        super().__init__(
            method=Counting(per_row),
            dataset=dataset,
            reward_funcs=[lambda **kwargs: [0.0]],
            tokenizer=None,
            generator=None,
            num_generations=1,
            groups_per_run=groups_per_run,
            queue_maxsize=queue_maxsize,
            max_consecutive_errors=1,
        )

    @property
    def runs(self) -> list[list[int]]:
        return self.method.runs


def wait_until(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


ROWS = Dataset.from_dict({"index": list(range(10))})


def test_worker_waits_for_the_trainer_at_staleness_zero():
    worker = CountingWorker(ROWS, per_row=4)
    worker.staleness.max_staleness, worker.staleness.samples_per_version = 0, 4
    worker.update_model_version(1)
    worker.start()
    try:
        assert wait_until(lambda: worker.rollout_buffer.qsize() == 4)
        time.sleep(0.3)
        assert len(worker.runs) == 1, "a second run started while the first one's samples were still queued"
        taken = [worker.rollout_buffer.get(timeout=5) for _ in range(4)]  # the trainer's step
        assert {sample.model_version for sample in taken} == {1}
        worker.update_model_version(2)
        assert wait_until(lambda: len(worker.runs) == 2)
        assert worker.rollout_buffer.get(timeout=5).model_version == 2  # sampled by the new version: lag 0
    finally:
        worker.stop()


def test_ungated_worker_fills_its_queue():
    worker = CountingWorker(ROWS, per_row=4, queue_maxsize=12)
    worker.update_model_version(1)
    worker.start()
    try:
        assert wait_until(lambda: worker.rollout_buffer.qsize() == 12)
        assert len(worker.runs) >= 3
    finally:
        worker.stop()


# ----------------------------------------------------------------------------------------------------------------
# Resume: the prompts continue after the last run whose groups were all trained
# ----------------------------------------------------------------------------------------------------------------
def test_resume_state_is_after_the_last_fully_trained_run():
    worker = CountingWorker(ROWS, per_row=1, groups_per_run=2)
    worker.start()
    try:
        assert wait_until(lambda: len(worker.runs) >= 3)
    finally:
        worker.stop()
    assert worker.runs[:3] == [[0, 1], [2, 3], [4, 5]]
    assert worker.resume_state([]) == {"rows": 0, "groups": 0}
    assert worker.resume_state([0]) == {"rows": 0, "groups": 0}  # run 1 half trained: redone
    assert worker.resume_state([0, 1, 2]) == {"rows": 2, "groups": 2}
    assert worker.resume_state(range(6)) == {"rows": 6, "groups": 6}

    resumed = CountingWorker(ROWS, per_row=1, groups_per_run=2)
    resumed.restore_state({"rows": 8, "groups": 8})
    resumed.start()
    try:
        assert wait_until(lambda: len(resumed.runs) >= 2)
    finally:
        resumed.stop()
    assert resumed.runs[:2] == [[8, 9], [0, 1]]  # from row 8, cycling
    assert resumed.rollout_buffer.get(timeout=5).group_id == 8
    assert resumed.resume_state([]) == {"rows": 8, "groups": 8}  # nothing trained since: the same position


def test_resumed_trainer_continues_the_prompts(model_dir, tmp_path):  # noqa: F811
    from .test_async_faults import train_within

    first = make_trainer(model_dir, tmp_path, max_steps=2, save_strategy="steps", save_steps=2, queue_maxsize=64)
    assert train_within(first) is None
    state = json.loads((Path(tmp_path) / "checkpoint-2" / "rollout_state.json").read_text())
    assert state["rows"] >= 1 and state["groups"] == state["rows"]  # one group per prompt row, all trained
    resumed = make_trainer(model_dir, tmp_path, max_steps=3, save_strategy="steps", save_steps=2, queue_maxsize=64)
    assert train_within(resumed, resume_from_checkpoint=True) is None
    assert resumed.rollout_worker._resumed_from == (state["rows"], state["groups"])
    assert resumed.rollout_worker.groups > state["groups"]


# ----------------------------------------------------------------------------------------------------------------
# Versions to the loss
# ----------------------------------------------------------------------------------------------------------------
def test_version_lags_are_clamped():
    versions = torch.tensor([5.0, 4.0, 2.0, 6.0, 0.0])
    assert version_lags(versions, 5, max_lag=2).tolist() == [0, 1, 2, 0, 2]


def test_queue_tags_versions_and_the_collator_spreads_them_per_token():
    buffer: queue.Queue = queue.Queue()
    buffer.put(to_rollout_sample(TrainingSample([1, 2], [3, 4], [-1.0, -1.0], advantage=1.0), 3))
    buffer.put(to_rollout_sample(TrainingSample([1, 2], [5, 6, 7], [-1.0] * 3, advantage=1.0), 5))
    tagged = VersionTaggedQueue(buffer)
    assert tagged.qsize() == 2
    row = TreeRow()
    for _ in range(2):
        sample = tagged.get(timeout=1)
        assert sample.metrics[MODEL_VERSION_KEY] == float(sample.model_version)
        row.add({
            "input_ids": torch.as_tensor(sample.input_ids), "completion_mask": torch.as_tensor(sample.completion_mask),
            "old_log_probs": torch.as_tensor(sample.old_log_probs), "advantage": sample.advantage,
            "group_id": sample.group_id, "metrics": sample.metrics,
        })  # fmt: skip
    batch = LossWeightCollator(pad_token_id=0).torch_call([[row]])
    valid = batch["token_index"][0] >= 0
    assert batch[SAMPLE_VERSIONS_KEY][0][valid].tolist() == [3.0, 3.0, 5.0, 5.0, 5.0]
    assert "loss_weights" not in batch  # unweighted samples: TRL's batch plus the versions only


# ----------------------------------------------------------------------------------------------------------------
# LocalPolicy: the in-process sampler
# ----------------------------------------------------------------------------------------------------------------
def test_local_policy_samples_from_the_weights_it_receives():
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    policy = LocalPolicy(model, tokenizer, settings=SamplingSettings(max_new_tokens=4, temperature=0.0))
    prompt = [[5, 6, 7]]
    before = policy.generate(prompt)[0]
    other, _ = build_tiny_model_and_tokenizer(1)
    policy.pause()
    policy.send_weights(other.named_parameters())
    policy.resume()
    after = policy.generate(prompt)[0]
    assert policy.version == 1
    reference = LocalPolicy(other, tokenizer, settings=SamplingSettings(max_new_tokens=4, temperature=0.0))
    assert after.token_ids == reference.generate(prompt)[0].token_ids
    assert after.logprobs == pytest.approx(reference.generate(prompt)[0].logprobs, abs=1e-6)
    assert before.logprobs != pytest.approx(after.logprobs, abs=1e-3)
    assert all(not param.requires_grad for param in policy.model.parameters())


def test_local_policy_refuses_a_weight_it_does_not_have():
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    policy = LocalPolicy(model, tokenizer)
    policy.pause()
    with pytest.raises(KeyError, match="model.layers.0.extra"):
        policy.send_weights([("model.layers.0.extra", torch.zeros(2))])
    assert not policy._lock.locked()  # a failed sync never leaves the worker's thread waiting
    policy.pause()
    name, param = next(iter(model.named_parameters()))
    with pytest.raises(ValueError, match="shape"):
        policy.send_weights([(name, torch.zeros(param.shape[0] + 1))])


def local_trainer(model_path, output_dir, peft_config=None, **overrides):
    """`AsyncStepwiseRLMTrainer` sampling from a `LocalPolicy` of the tiny model (no server); returns both."""
    _, tokenizer = build_tiny_model_and_tokenizer(0)
    policy = LocalPolicy(str(model_path), tokenizer, settings=SamplingSettings(max_new_tokens=12, temperature=1.0))
    settings = dict(
        output_dir=str(output_dir), max_depth=1, max_turns=2, num_generations=4, max_inflight_tasks=4,
        per_device_train_batch_size=4, token_budget=0, max_staleness=1, max_steps=3, max_completion_length=12,
        learning_rate=5e-2, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        gradient_checkpointing=False, loss_type="ipo",
    )  # fmt: skip
    settings.update(overrides)
    trainer = AsyncStepwiseRLMTrainer(
        str(model_path), yes_reward, args=AsyncStepwiseRLMConfig(**settings), train_dataset=DATASET,
        generator=policy, weight_transfer=policy, peft_config=peft_config,
    )  # fmt: skip
    return trainer, policy


def test_async_rlm_trains_with_a_local_policy_and_logs_the_mask_by_lag(model_dir, tmp_path):  # noqa: F811
    from .test_async_faults import train_within

    trainer, policy = local_trainer(model_dir, tmp_path)
    assert not isinstance(trainer.rollout_worker.check_health, ServerWatch)  # no server to watch
    assert train_within(trainer) is None
    history = trainer.state.log_history
    lag_keys = {key for entry in history for key in entry if key.startswith("ipo/masked_ratio/lag_")}
    assert lag_keys and lag_keys <= {"ipo/masked_ratio/lag_0", "ipo/masked_ratio/lag_1", "ipo/masked_ratio/lag_2"}
    assert not any(MODEL_VERSION_KEY in key for entry in history for key in entry)  # not logged as a metric
    assert policy.version == trainer.model_version  # every sync reached the sampler
    trained = trainer.accelerator.unwrap_model(trainer.model)
    for name, param in trained.named_parameters():
        assert torch.equal(param.detach(), policy.model.get_parameter(name).detach()), name


def test_async_rlm_with_lora_syncs_merged_weights_into_a_local_policy(model_dir, tmp_path):  # noqa: F811
    from .test_async_faults import train_within

    trainer, policy = local_trainer(
        model_dir, tmp_path, peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), max_steps=2
    )
    assert train_within(trainer) is None
    merged = trainer.accelerator.unwrap_model(trainer.model).merge_and_unload()
    for name, param in merged.named_parameters():
        assert torch.allclose(param.detach(), policy.model.get_parameter(name).detach(), atol=1e-6), name
