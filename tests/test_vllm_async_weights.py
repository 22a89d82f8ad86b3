"""`ExtAsyncGRPOTrainer` without PEFT against a real `vllm serve`: full weights synced through the disk and vLLM's
reload (`trl_ext.serving.weight_sync.DiskWeightTransfer`), no NCCL.

One server for the module (`tests/vllm_server.py`: vLLM's CPU build, float32, dev mode), not the session's shared
one: the run changes its base weights, and it serves an *untied* copy of the tiny chat model (vLLM's reload does not
re-process a tied LM head, and on the CPU the head is a prepacked copy: tied heads are refused, which one test checks
against this server). One run of three asynchronous steps with the IPO loss: after the cold sync and after every
optimizer step the trainer writes its weights under ``<output_dir>/.vllm_weights`` and the server reloads them
(``/collective_rpc`` ``reload_weights``). The tests check that the server then scores a fixed sequence with the
trainer's final weights, and no longer with the initial ones.

Skipped where vLLM is not installed; run with ``.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_async_weights.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .async_rewards import vowel_share_reward
from .test_vllm_async import fixed_sequence, max_gap, transformers_logprobs
from .vllm_server import VLLM_TEST_MARKS, VLLMServer, save_chat_model, start_vllm_server

pytestmark = VLLM_TEST_MARKS

MAX_STEPS = 3
MAX_STALENESS = 1
# Both sides score in float32 with the same weights; they differ in kernels and summation order only (about 1e-6
# nats per token here). The weights must have moved far beyond that: TRAINED_SHIFT_FACTOR times the tolerance.
LOGPROB_TOLERANCE = 1e-3
TRAINED_SHIFT_FACTOR = 10


@dataclass
class TrainedRun:
    trainer: Any
    server: VLLMServer
    model_dir: Path
    history: list[dict]


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm_async_weights")


@pytest.fixture(scope="module")
def model_dir(work_dir) -> Path:
    return save_chat_model(work_dir / "model", tie_word_embeddings=False)  # an LM head of its own


@pytest.fixture(scope="module")
def server(work_dir, model_dir):
    server = start_vllm_server(model_dir, work_dir / "vllm_serve.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def trained(work_dir, model_dir, server) -> TrainedRun:
    from datasets import Dataset

    from trl_ext.serving.weight_sync import DiskWeightTransfer, choose_weight_transfer
    from trl_ext.trainers import ExtAsyncGRPOConfig, ExtAsyncGRPOTrainer

    prompts = [[{"role": "system", "content": "Count."}, {"role": "user", "content": f"to {i}"}] for i in range(32)]
    args = ExtAsyncGRPOConfig(
        output_dir=str(work_dir / "run"),
        loss_type="ipo",
        max_steps=MAX_STEPS,
        max_staleness=MAX_STALENESS,
        per_device_train_batch_size=8,  # 2 prompts x 4 completions a step (see tests/test_vllm_async.py)
        token_budget=0,
        queue_maxsize=16,
        num_generations=4,
        max_completion_length=12,
        learning_rate=1e-3,  # full weights with Adam: every weight moves by about this much a step
        vllm_server_base_url=server.url,
        use_cpu=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
    )
    transfer = choose_weight_transfer(str(model_dir), args)  # no adapter, no CUDA: the disk
    assert isinstance(transfer, DiskWeightTransfer), transfer
    trainer = ExtAsyncGRPOTrainer(
        str(model_dir),
        vowel_share_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        weight_transfer=transfer,
    )
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "train_runtime" not in entry]
    return TrainedRun(trainer=trainer, server=server, model_dir=model_dir, history=history)


def test_every_step_synced_the_full_weights(trained):
    transfer = trained.trainer.weight_transfer
    # One cold sync before training, then one per optimizer step; the names were checked against the checkpoint.
    assert trained.trainer.model_version == transfer.syncs == MAX_STEPS + 1
    assert transfer.expected_names is not None and "lm_head.weight" in transfer.expected_names
    assert not transfer.directory.exists()  # removed on train end
    assert [entry["step"] for entry in trained.history] == list(range(1, MAX_STEPS + 1))
    for entry in trained.history:
        assert 0.0 <= entry["sample/staleness_mean"] <= entry["sample/staleness_max"] <= MAX_STALENESS, entry
        assert isinstance(entry["ipo/masked_ratio"], float) and entry["perf/weight_sync_s"] > 0.0, entry


def test_server_generates_with_the_trained_full_weights(trained):
    import torch
    from transformers import AutoModelForCausalLM

    token_ids = fixed_sequence(trained.model_dir)
    served = trained.server.prompt_logprobs(trained.server.model, token_ids)

    # The trainer's final weights, copied from memory into a plain transformers model (not read from the files).
    trainer_model = trained.trainer.accelerator.unwrap_model(trained.trainer.model)
    policy = AutoModelForCausalLM.from_pretrained(trained.model_dir, dtype=torch.float32).eval()
    initial = transformers_logprobs(policy, token_ids)
    policy.load_state_dict(trainer_model.state_dict())
    final = transformers_logprobs(policy, token_ids)

    report = {"served vs trainer final": max_gap(served, final), "served vs initial": max_gap(served, initial)}
    print(f"\n{len(token_ids) - 1} tokens, max |Δ log-prob| (nats): {report}")
    assert report["served vs trainer final"] < LOGPROB_TOLERANCE, report
    assert report["served vs initial"] > TRAINED_SHIFT_FACTOR * LOGPROB_TOLERANCE, report


def test_a_tied_head_is_refused_by_this_cpu_server(server, tmp_path):
    from trl_ext.serving.weight_sync import DiskWeightTransfer

    transfer = DiskWeightTransfer(server.url, tmp_path / "weights", tied_lm_head=True)
    with pytest.raises(RuntimeError, match="ties its LM head.*runs on the CPU"):
        transfer.check_server()
