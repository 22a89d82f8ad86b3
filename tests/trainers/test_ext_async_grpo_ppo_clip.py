"""`ExtAsyncGRPOTrainer`'s ``loss_type="dapo"``: TRL's PPO-clip computed by trl-ext (`trl_ext.losses.ppo_clip_loss`)
against TRL's own ``AsyncGRPOTrainer.compute_loss`` on the same collated micro-batch (loss, gradients and metrics
bit for bit), and its clip rate by version lag, ``clip_ratio/region_mean/lag_<k>``. On the CPU, without vLLM."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo.packing import TreeRow

from trl_ext import ExtAsyncGRPOConfig
from trl_ext.trainers.async_seam import LossWeightCollator, fold_loss_weights, install_cpu_support
from trl_ext.trainers.async_seam.weights import LOSS_WEIGHTS_KEY, MODEL_VERSION_KEY, weighted_sample_metrics

from .test_ext_async_grpo import build_trainer, config_kwargs, model_dir, reference_logps, rollout_samples  # noqa: F401

EPSILONS = {"epsilon": 0.2, "epsilon_high": 0.28}  # clip range [0.8, 1.28]
# Per completion token: log p_old = log p + offset, so ρ = exp(-offset) = 1.65, 1, 0.61 (clipped: high if A > 0,
# low if A < 0) for a sample sampled by version 0, and ρ = 1 (never clipped) for one sampled by version 1.
OFFSETS = {0: torch.tensor([-0.5, 0.0, 0.5]), 1: torch.zeros(3)}


def clipped_samples(model_dir, weights=None):  # noqa: F811
    """8 samples (advantages +1, -1, ...; 3 completion tokens each): the first 4 sampled by version 0, the last 4 by
    version 1, with p_old set from the policy's own log-probs (`OFFSETS`); ``weights``: their loss weights."""
    samples = rollout_samples(8)
    logps = reference_logps(model_dir, samples).view(8, 3)
    out = []
    for index, sample in enumerate(samples):
        version = index // 4
        old = sample.old_log_probs.copy()
        old[sample.completion_mask == 1] = (logps[index] + OFFSETS[version]).numpy()
        metrics = {**sample.metrics, MODEL_VERSION_KEY: float(version)}
        if weights is not None:
            metrics = weighted_sample_metrics(metrics, token_weight=weights[index], root_share=1.0)
        out.append(dataclasses.replace(sample, old_log_probs=old, model_version=version, metrics=metrics))
    return out


def collate(samples) -> dict[str, torch.Tensor]:
    """One micro-batch on one row, as TRL's planner and trl-ext's collator (``sample_versions``, ``loss_weights``)
    build it."""
    row = TreeRow()
    for sample in samples:
        row.add({
            "input_ids": torch.as_tensor(sample.input_ids), "completion_mask": torch.as_tensor(sample.completion_mask),
            "old_log_probs": torch.as_tensor(sample.old_log_probs), "advantage": sample.advantage,
            "group_id": sample.group_id, "metrics": dict(sample.metrics),
        })  # fmt: skip
    return LossWeightCollator(pad_token_id=0).torch_call([[row]])


def loss_and_gradients(trainer, batch):
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    trainer.current_gradient_accumulation_steps = 2  # TRL's normaliser: tokens per rank, then accumulation steps
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}


STEP_ACCOUNTING = ("_step_forward_tokens", "_step_trained_tokens", "_step_seq_len_weighted", "_step_samples")


@pytest.fixture
def trainers(model_dir, tmp_path):  # noqa: F811
    """Ours (`ExtAsyncGRPOTrainer`, ``loss_type="dapo"``) and TRL's `AsyncGRPOTrainer`, same model and settings."""
    install_cpu_support()  # what ExtAsyncGRPOTrainer does off CUDA; TRL's trainer needs it to build on the CPU
    ours, _ = build_trainer(model_dir, tmp_path / "ours", **EPSILONS)
    plain = AsyncGRPOConfig(**config_kwargs(tmp_path / "trl", bf16=False, **EPSILONS))
    trls, _ = build_trainer(model_dir, tmp_path / "trl", trainer_class=AsyncGRPOTrainer, args=plain)
    assert ours.loss_spec.name == "dapo" and (ours.epsilon_low, ours.epsilon_high) == (0.2, 0.28)
    return ours, trls


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "loss_weights"])
def test_dapo_loss_gradients_and_metrics_equal_trls_compute_loss(model_dir, trainers, weighted):  # noqa: F811
    ours, trls = trainers
    weights = [0.5, 2.0, 0.0, 1.0, 1.5, 1.0, 3.0, 0.25] if weighted else None
    batch = collate(clipped_samples(model_dir, weights))
    assert (LOSS_WEIGHTS_KEY in batch) == weighted
    # TRL's loss takes no weights: they reach it folded into the advantages, as before trl-ext computed it.
    loss, grads = loss_and_gradients(ours, batch)
    trl_loss, trl_grads = loss_and_gradients(trls, fold_loss_weights(batch))

    assert torch.equal(loss, trl_loss)
    assert grads.keys() == trl_grads.keys() and len(grads) > 0
    assert all(torch.equal(grads[name], trl_grads[name]) for name in grads)
    logged = {name: values for name, values in ours._metrics["train"].items() if "/lag_" not in name}
    assert logged == dict(trls._metrics["train"])
    assert set(logged) == {
        "ratio", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
        "clip_ratio/low_min", "clip_ratio/high_max",
    }  # fmt: skip
    assert all(getattr(ours, name) == getattr(trls, name) for name in STEP_ACCOUNTING)
    if weighted:  # the weights matter: TRL's loss on the unfolded advantages differs
        assert not torch.equal(loss, loss_and_gradients(trls, batch)[0])


def test_dapo_logs_its_clip_rate_by_version_lag(model_dir, trainers):  # noqa: F811
    ours, _ = trainers
    ours.model_version = 1  # samples of version 1: lag 0 (never clipped); of version 0: lag 1 (1 token in 3)
    ours.compute_loss(ours.model, collate(clipped_samples(model_dir)))
    logged = {name: values[-1] for name, values in ours._metrics[ours.mode].items()}
    # Hand-checked from `OFFSETS`: lag 1 holds 12 tokens, 4 clipped (2 high with A = +1, 2 low with A = -1).
    assert logged["clip_ratio/region_mean/lag_0"] == 0.0
    assert logged["clip_ratio/region_mean/lag_1"] == pytest.approx(1 / 3)
    assert {name for name in logged if "/lag_" in name} == {
        "clip_ratio/region_mean/lag_0",
        "clip_ratio/region_mean/lag_1",
    }
    assert logged["clip_ratio/region_mean"] == pytest.approx(4 / 24)
    assert logged["clip_ratio/low_mean"] == logged["clip_ratio/high_mean"] == pytest.approx(2 / 24)
    assert (logged["clip_ratio/low_min"], logged["clip_ratio/high_max"]) == (0.0, pytest.approx(1 / 3))


def test_a_plain_async_config_logs_the_clip_rate_by_lag_too(model_dir, tmp_path):  # noqa: F811
    install_cpu_support()
    plain = AsyncGRPOConfig(**config_kwargs(tmp_path, bf16=False))  # no loss_type: TRL's loss
    trainer, _ = build_trainer(model_dir, tmp_path, args=plain)
    assert not isinstance(trainer.args, ExtAsyncGRPOConfig) and trainer.loss_spec.name == "dapo"
    trainer.model_version = 1
    trainer.compute_loss(trainer.model, collate(clipped_samples(model_dir)))
    logged = trainer._metrics[trainer.mode]
    assert {"clip_ratio/region_mean", "clip_ratio/region_mean/lag_0", "clip_ratio/region_mean/lag_1"} <= set(logged)
