"""`ExtAsyncGRPOTrainer` / `ExtAsyncGRPOConfig` on the CPU, without vLLM: an in-process rollout worker pushes
hand-built `RolloutSample`s into a queue (TRL's ``rollout_worker=``) and the weight sync is a no-op
(``weight_transfer=``). Runs against ``vllm serve`` are the ``vllm`` test group's."""

from __future__ import annotations

import logging
import math
import queue
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
from trl.experimental.async_grpo.packing import TreeRow

from trl_ext import ClipRateMonitor, EntropyMonitor, ExtAsyncGRPOConfig, ExtAsyncGRPOTrainer
from trl_ext.fields import documented
from trl_ext.losses import LOSSES, LossSpec, ipo_loss, register_loss
from trl_ext.trainers import ext_grpo_config
from trl_ext.trainers.async_seam import install_cpu_support

from ..utils import saved_tiny_model

PROMPTS = ([5, 6, 7, 8], [9, 10, 11])  # two prompts, two completions each per micro-batch


# ----------------------------------------------------------------------------------------------------------------
# An in-process rollout worker and a no-op weight sync (TRL's RolloutWorkerProtocol / WeightTransferProtocol)
# ----------------------------------------------------------------------------------------------------------------
class QueueWorker:
    """Pushes its samples into the queue TRL drains, all at once when training starts."""

    def __init__(self, samples: list[RolloutSample]):
        self.rollout_buffer: queue.Queue = queue.Queue()
        self.metrics_queue: queue.Queue = queue.Queue()
        self.samples = samples
        self.versions: list[int] = []
        self.stopped = False

    def start(self) -> None:
        for sample in self.samples:
            self.rollout_buffer.put_nowait(sample)

    def stop(self) -> None:
        self.stopped = True

    def update_model_version(self, model_version: int) -> None:
        self.versions.append(model_version)

    def check_health(self, stale_after_s: float) -> None:
        raise RuntimeError("QueueWorker ran out of samples: push more than the run trains on.")


class NoWeightSync:
    def init_weight_transfer(self) -> None: ...
    def pause(self) -> None: ...
    def send_weights(self, iterator) -> None: ...
    def resume(self) -> None: ...
    def destroy(self) -> None: ...


def rollout_samples(count: int, seed: int = 0) -> list[RolloutSample]:
    """``count`` samples: completions of 3 random tokens after one of `PROMPTS` (4 consecutive samples share a
    prompt pairwise), sampler log-probs in [-1.5, -0.1] (p_old large next to the tiny model's p, so IPO masks some
    tokens), advantages alternating +1 / -1."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(count):
        prompt = PROMPTS[(index // 2) % 2]
        completion = torch.randint(20, 60, (3,), generator=generator).tolist()
        mask = np.array([0] * len(prompt) + [1] * 3)
        old = -0.1 - 1.4 * torch.rand(len(mask), generator=generator).numpy()
        samples.append(
            RolloutSample(
                prompt=[],
                completion=[],
                input_ids=np.array(prompt + completion),
                completion_mask=mask,
                old_log_probs=np.where(mask == 1, old, 0.0).astype(np.float32),
                advantage=1.0 if index % 2 == 0 else -1.0,
                model_version=0,
                group_id=index // 2,
                metrics={"reward": float(index % 2)},
            )
        )
    return samples


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("tiny"))


def config_kwargs(output_dir, **overrides):
    kwargs = dict(
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=4,
        token_budget=0,  # a fixed 4 samples per micro-batch (None would ask the vLLM server)
        max_staleness=100,  # every pushed sample is trained
        gradient_checkpointing=False,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    kwargs.update(overrides)
    return kwargs


def build_trainer(
    model_dir, output_dir, samples=None, trainer_class=ExtAsyncGRPOTrainer, args=None, callbacks=None, **overrides
):
    args = args or ExtAsyncGRPOConfig(**config_kwargs(output_dir, **overrides))
    worker = QueueWorker(samples if samples is not None else rollout_samples(16))
    prompts = Dataset.from_dict({"prompt": ["unused: the worker is a stub"] * 8})
    trainer = trainer_class(
        model_dir,
        args=args,
        train_dataset=prompts,
        callbacks=callbacks,
        rollout_worker=worker,
        weight_transfer=NoWeightSync(),
    )
    return trainer, worker


def collated_batch(samples: list[RolloutSample]) -> dict[str, torch.Tensor]:
    """One micro-batch as TRL's planner and collator build it (one row: one process)."""
    row = TreeRow()
    for sample in samples:
        row.add({
            "input_ids": torch.as_tensor(sample.input_ids), "completion_mask": torch.as_tensor(sample.completion_mask),
            "old_log_probs": torch.as_tensor(sample.old_log_probs), "advantage": sample.advantage,
            "group_id": sample.group_id, "metrics": sample.metrics,
        })  # fmt: skip
    return DataCollatorForRollout(pad_token_id=0).torch_call([[row]])


def reference_logps(model_dir, samples: list[RolloutSample]) -> torch.Tensor:
    """``(M,)`` log p of every completion token, sample after sample, from one plain forward per sample (eager
    attention, no packing, no fused head): the order of TRL's collator."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    values = []
    with torch.no_grad():
        for sample in samples:
            ids = torch.as_tensor(sample.input_ids).unsqueeze(0)
            logps = model(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            values.append(logps[torch.as_tensor(sample.completion_mask[1:]).bool()])
    return torch.cat(values)


# ----------------------------------------------------------------------------------------------------------------
# (a) IPO: the loss of one fixed batch, and a 2-step run
# ----------------------------------------------------------------------------------------------------------------
def test_ipo_loss_of_a_fixed_batch_equals_ipo_loss_on_the_same_logprobs(model_dir, tmp_path):
    # the probability region alone (ipo_ratio_band=None), checked by hand; the band is tested in tests/test_losses.py
    trainer, _ = build_trainer(
        model_dir, tmp_path, loss_type="ipo", ipo_threshold=0.3, ipo_ratio_cap=8.0, ipo_ratio_band=None
    )
    samples = rollout_samples(4)
    batch = collated_batch(samples)
    logps = reference_logps(model_dir, samples)  # (M,) = 4 samples x 3 tokens
    old = torch.cat([torch.as_tensor(s.old_log_probs[s.completion_mask == 1]) for s in samples])
    advantages = torch.tensor([s.advantage for s in samples]).repeat_interleave(3)
    assert logps.shape == old.shape == advantages.shape == (12,)

    trainer.model.eval()
    loss = trainer.compute_loss(trainer.model, batch)

    # Hand-checked: every kept token contributes -A·ρ (ρ = p / p_old < 8, no cap on this tiny policy), masked ones 0;
    # the sum is divided by the micro-batch's 12 loss tokens (one process, one accumulation step).
    keep = (logps.exp() - old.exp()).abs() <= 0.3
    ratio = (logps - old).exp()
    assert 0 < int((~keep).sum()) < 12 and bool((ratio < 8).all())
    by_hand = -(keep * advantages * ratio).sum() / 12
    expected, metrics = ipo_loss(
        logps[None], old[None], advantages[None], torch.ones(1, 12, dtype=torch.bool), ratio_band=None
    )
    torch.testing.assert_close(expected, by_hand)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-4, atol=1e-6)
    logged = {name: values[-1] for name, values in trainer._metrics["eval"].items()}
    assert logged["ipo/masked_ratio"] == pytest.approx(float((~keep).float().mean()))
    assert logged["ipo/ratio_mean"] == pytest.approx(float(ratio.mean()), rel=1e-4)
    assert logged["ratio"] == pytest.approx(float(ratio.mean()), rel=1e-4)
    assert logged["kl"] == pytest.approx(float(((ratio - 1) - (logps - old)).mean()), rel=1e-4)
    assert "clip_ratio/region_mean" not in logged  # PPO-clip's, not IPO's

    # TRL's normaliser: tokens per rank times the micro-batches of the optimizer step.
    trainer.current_gradient_accumulation_steps = 2
    torch.testing.assert_close(trainer.compute_loss(trainer.model, batch).detach(), expected / 2, rtol=1e-4, atol=1e-6)


def test_ipo_trains_two_steps_and_logs_its_metrics_for_the_monitors(model_dir, tmp_path):
    monitors = [ClipRateMonitor(), EntropyMonitor(baseline_logs=1)]
    trainer, worker = build_trainer(model_dir, tmp_path, callbacks=monitors, loss_type="ipo")
    names = [type(cb).__name__ for cb in trainer.callback_handler.callbacks]
    assert names[names.index("DefaultFlowCallback") + 1 :][:2] == ["ClipRateMonitor", "EntropyMonitor"]
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()

    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and trainer.state.global_step == 2
    for entry in logs:
        assert {"ipo/masked_ratio", "ipo/capped_ratio", "ipo/ratio_mean", "ratio", "kl", "entropy"} <= set(entry)
        assert math.isfinite(entry["loss"]) and 0.0 <= entry["ipo/masked_ratio"] <= 1.0
        assert entry["batch/trained_tokens_per_step"] == 12  # TRL's step accounting saw the micro-batch
    assert any(not torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())
    assert worker.versions == [1, 2, 3] and worker.stopped  # a sync at start and after each step
    assert monitors[0].monitor_state["metric"] == "ipo/masked_ratio"  # the monitor found the run's metric
    assert monitors[1].entropy_baseline == pytest.approx(logs[0]["entropy"])


# ----------------------------------------------------------------------------------------------------------------
# (b) dapo: TRL's own loss, unchanged (computed by trl-ext: tests/trainers/test_ext_async_grpo_ppo_clip.py)
# ----------------------------------------------------------------------------------------------------------------
def test_dapo_is_trls_async_loss_unchanged(model_dir, tmp_path):
    install_cpu_support()  # what ExtAsyncGRPOTrainer does off CUDA; TRL's trainer needs it to build on the CPU
    histories = []
    for trainer_class, config_class in (
        (ExtAsyncGRPOTrainer, ExtAsyncGRPOConfig),
        (AsyncGRPOTrainer, AsyncGRPOConfig),
    ):
        args = config_class(**config_kwargs(tmp_path / trainer_class.__name__, bf16=False))
        trainer, _ = build_trainer(model_dir, tmp_path, trainer_class=trainer_class, args=args)
        trainer.train()
        histories.append([
            {key: value for key, value in entry.items() if not key.startswith(("perf/", "train_", "sample/time"))}
            for entry in trainer.state.log_history
        ])  # fmt: skip
    ours, trls = histories
    # trl-ext computes TRL's loss itself (`trl_ext.losses.ppo_clip_loss`) to add its clip rate by version lag
    assert all(
        any(key.startswith("clip_ratio/region_mean/lag_") for key in entry) for entry in ours if "loss" in entry
    )
    # trl-ext reads the loader on demand (`OnDemandLoader`): TRL's look-ahead fetches the next step's first micro-batch
    # during this step, so its queue size at fetch and its groups of the step (counted at collation) differ; the
    # batches trained, the losses and the gradients do not.
    timing = ("/lag_", "sample/rollout_queue_size", "batch/groups_per_step")
    assert [{key: value for key, value in entry.items() if not any(t in key for t in timing)} for entry in ours] == [
        {key: value for key, value in entry.items() if not any(t in key for t in timing)} for entry in trls
    ]
    assert [entry["batch/groups_per_step"] for entry in ours if "loss" in entry] == [2.0, 2.0]  # those trained
    assert "clip_ratio/region_mean" in ours[0] and "loss" in ours[0]


# ----------------------------------------------------------------------------------------------------------------
# A loss registered from outside, with settings
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScaleSettings:
    scale: float = documented(1.0, "Multiplies the loss.")


def scaled_pg_loss(logps, old_logps, advantages, mask, *, normalizer=None, weights=None, scale=1.0):
    """-scale · A · log p summed over the mask, divided by the normaliser; metric ``scale``."""
    loss = -(scale * advantages * logps * mask).sum() / normalizer
    return loss, {"scale": torch.tensor(scale), "num_tokens": mask.sum().float()}


@pytest.fixture
def scaled_loss():
    register_loss(LossSpec("scaled_pg_async", "tokens", scaled_pg_loss, settings=ScaleSettings))
    yield "scaled_pg_async"
    LOSSES.pop("scaled_pg_async")


def test_a_loss_registered_from_outside_gets_its_settings_and_logs_its_metrics(model_dir, tmp_path, scaled_loss):
    trainer, _ = build_trainer(model_dir, tmp_path, loss_type=scaled_loss, loss_kwargs='{"scale": 3.0}')
    samples = rollout_samples(4)
    trainer.model.eval()
    loss = trainer.compute_loss(trainer.model, collated_batch(samples))
    logps = reference_logps(model_dir, samples)
    advantages = torch.tensor([s.advantage for s in samples]).repeat_interleave(3)
    torch.testing.assert_close(loss.detach(), -(3.0 * advantages * logps).sum() / 12, rtol=1e-4, atol=1e-6)
    assert trainer._metrics["eval"][f"{scaled_loss}/scale"] == [3.0]


# ----------------------------------------------------------------------------------------------------------------
# (e) Config
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"loss_type": "grpo"},
            r"loss_type='grpo' is not available here: TRL's asynchronous trainer .*\['dapo', 'ipo'",
        ),
        ({"loss_type": "ppo"}, r"loss_type='ppo' is not available here.*Set loss_type to one of \['dapo', 'ipo'"),
        ({"ipo_threshold": 0.0}, "ipo_threshold"),
        ({"loss_type": "ipo", "ipo_ratio_cap": 1.0}, "ipo_ratio_cap"),
        ({"loss_type": "ipo", "ipo_kl_tau": -1.0}, "ipo_kl_tau"),
        ({"loss_type": "ipo", "loss_kwargs": {"scale": 2.0}}, "remove loss_kwargs"),
        ({"loss_kwargs": "{not json"}, "is not JSON"),
    ],
)
def test_config_rejects_bad_values_with_the_fix(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        ExtAsyncGRPOConfig(**config_kwargs(tmp_path, **overrides))


def test_config_accepts_the_losses_the_async_trainer_trains(tmp_path, scaled_loss):
    for loss_type in ("dapo", "ipo", scaled_loss):
        assert ExtAsyncGRPOConfig(**config_kwargs(tmp_path, loss_type=loss_type)).loss_type == loss_type
    config = ExtAsyncGRPOConfig(**config_kwargs(tmp_path, loss_type="ipo"))
    assert (config.ipo_threshold, config.ipo_ratio_cap, config.ipo_kl_tau) == (0.3, 8.0, 0.0)
    assert config.importance_sampling_level == "token" and config.entropy_coef == 0.0


@pytest.mark.skipif(ext_grpo_config.bf16_accelerator_available(), reason="this host has a bf16 accelerator")
def test_a_cpu_run_needs_no_precision_setting(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="trl_ext.trainers.ext_grpo_config"):
        config = ExtAsyncGRPOConfig(output_dir=str(tmp_path))  # TRL's AsyncGRPOConfig alone fails here
    assert (config.bf16, config.fp16, config.dtype) == (False, False, "float32")
    assert "training in float32" in caplog.text


def test_a_plain_async_config_trains_trls_loss_and_ipo_needs_ours(model_dir, tmp_path):
    install_cpu_support()
    plain = AsyncGRPOConfig(**config_kwargs(tmp_path, bf16=False))
    trainer, _ = build_trainer(model_dir, tmp_path, args=plain)
    assert trainer.loss_spec.name == "dapo"
    plain.loss_type = "ipo"  # what a caller could do with a plain config
    with pytest.raises(TypeError, match=r"pass args=trl_ext\.ExtAsyncGRPOConfig"):
        build_trainer(model_dir, tmp_path, args=plain)


# ----------------------------------------------------------------------------------------------------------------
# Model card and seam
# ----------------------------------------------------------------------------------------------------------------
def test_model_card_names_trl_ext_and_the_async_trainer():
    assert ExtAsyncGRPOTrainer._tag_names == ["trl", "async-grpo", "grpo", "trl-ext"]
    assert ExtAsyncGRPOTrainer._name == "Async GRPO"
    assert ExtAsyncGRPOTrainer._paper["id"] == "2402.03300"


def test_the_trainer_overrides_no_private_method_of_trls_async_trainer():
    private = {name for name in vars(AsyncGRPOTrainer) if name.startswith("_") and not name.startswith("__")}
    assert not {name for name, value in vars(ExtAsyncGRPOTrainer).items() if name in private and callable(value)}
