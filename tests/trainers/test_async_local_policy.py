"""Asynchronous training without a server (docs/async.md, "Without a server"): `ExtAsyncGRPOTrainer` and the method
trainers sampling from a `LocalPolicy`, and the staleness bound measured at the loss with a real lag."""

from __future__ import annotations

import logging
import socket
import time
import warnings

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from trl_ext import ExtAsyncGRPOConfig, ExtAsyncGRPOTrainer
from trl_ext.rlm.generators import SamplingSettings
from trl_ext.rollouts import GRPOGroups
from trl_ext.testing import build_tiny_model_and_tokenizer, save_tiny_model
from trl_ext.trainers import LocalPolicy
from trl_ext.trainers.async_seam.trainer import STALE_TOKENS_METRIC
from trl_ext.trainers.async_seam.weights import LOSS_WEIGHTS_KEY, stale_token_mask, without_tokens
from trl_ext.trainers.async_worker import RolloutWorker
from trl_ext.trainers.learning_signal import NO_SIGNAL_STEPS, LearningSignalWatch

from .test_async_faults import train_within

CLOSED_PORT_URL = "http://127.0.0.1:9"  # nothing listens there: a trainer that probed it would fail or wait


def letter_reward(completions, **kwargs):
    """1 per completion holding an "a", a module-level function as TRL's reward interface takes."""
    return [float("a" in completion[0]["content"]) for completion in completions]


PROMPTS = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"say {word}"}] for word in "abcdefgh"]})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    return save_tiny_model(model, tokenizer, tmp_path_factory.mktemp("tiny"))


def local_grpo(model_path, output_dir, *, policy=None, callbacks=None, **overrides):
    _, tokenizer = build_tiny_model_and_tokenizer(0)
    settings = dict(
        output_dir=str(output_dir), num_generations=4, max_inflight_tasks=8, per_device_train_batch_size=8,
        max_completion_length=8, max_staleness=1, max_steps=2, learning_rate=1e-2, logging_steps=1,
        save_strategy="no", report_to=[], disable_tqdm=True, seed=0, loss_type="ipo",
        vllm_server_base_url=CLOSED_PORT_URL, vllm_server_timeout=5,
    )  # fmt: skip
    settings.update(overrides)
    args = ExtAsyncGRPOConfig(**settings)
    if policy is None:
        policy = LocalPolicy(str(model_path), tokenizer, settings=SamplingSettings(max_new_tokens=8, temperature=1.0))
    trainer = ExtAsyncGRPOTrainer(
        str(model_path), letter_reward, args=args, train_dataset=PROMPTS, processing_class=tokenizer,
        generator=policy, callbacks=callbacks,
    )  # fmt: skip
    return trainer, policy


def test_ext_async_grpo_trains_from_a_local_policy_without_a_server(model_path, tmp_path):
    trainer, policy = local_grpo(model_path, tmp_path)
    assert trainer.weight_transfer is policy  # passed once, as generator=: it receives the weights too
    assert isinstance(trainer.rollout_worker, RolloutWorker) and isinstance(trainer.rollout_worker.method, GRPOGroups)
    assert trainer.args.token_budget == policy.max_model_len  # not asked of a server
    tick = time.monotonic()
    assert train_within(trainer) is None
    assert time.monotonic() - tick < 60  # no wait on the closed port's server
    assert trainer.state.global_step == 2
    assert policy.version == trainer.model_version  # every sync reached the sampler
    trained = trainer.accelerator.unwrap_model(trainer.model)
    for name, param in trained.named_parameters():
        assert torch.equal(param.detach(), policy.model.get_parameter(name).detach()), name
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"reward", "ipo/masked_ratio"} <= logged


def test_a_local_policy_of_another_model_is_refused_at_construction(model_path, tmp_path):
    other, tokenizer = build_tiny_model_and_tokenizer(0, num_hidden_layers=3)
    policy = LocalPolicy(other, tokenizer)
    with pytest.raises(ValueError, match=r"num_hidden_layers: trained 2, sampling copy 3.*same path"):
        local_grpo(model_path, tmp_path, policy=policy)


def test_stale_tokens_get_weight_zero_and_leave_the_token_count():
    token_index = torch.tensor([[0, 1, 2, 3, -1]])
    inputs = {
        "token_index": token_index,
        "sample_versions": torch.tensor([[5.0, 5.0, 3.0, 4.0, -1.0]]),
        "global_n_tokens": torch.tensor([4.0]),
    }
    stale = stale_token_mask(inputs, model_version=5, max_staleness=1)
    assert stale.tolist() == [[False, False, True, False, False]]  # lag 2 > 1; padding never counts
    out = without_tokens(inputs, stale, dropped_total=1.0)
    assert out[LOSS_WEIGHTS_KEY].tolist() == [[1.0, 1.0, 0.0, 1.0, 0.0]]
    assert out["global_n_tokens"].tolist() == [3.0]
    weighted = {**inputs, LOSS_WEIGHTS_KEY: torch.tensor([[2.0, 2.0, 0.5, 0.5, 0.0]])}
    assert without_tokens(weighted, stale, 1.0)[LOSS_WEIGHTS_KEY].tolist() == [[2.0, 2.0, 0.0, 0.5, 0.0]]
    assert stale_token_mask({"token_index": token_index}, 5, 1) is None  # no versions carried: nothing to check


class SlowTrainer(TrainerCallback):
    """Sleeps after every optimizer step, so the sampler runs ahead and the samples arrive really stale."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


@pytest.mark.slow
def test_no_loss_token_is_older_than_max_staleness_under_a_real_lag(model_path, tmp_path):
    """The worker samples while the trainer sleeps, so the samples lag by up to max_staleness; the loss must see no
    token older (before the on-demand loader, the micro-batch fetched ahead of each sync was one version older)."""
    trainer, policy = local_grpo(
        model_path, tmp_path, callbacks=[SlowTrainer(1.0)], max_staleness=1, max_steps=6,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, max_inflight_tasks=4, queue_maxsize=0,
        token_budget=0,
    )  # fmt: skip
    assert train_within(trainer) is None
    history = trainer.state.log_history
    lags = {key.rsplit("_", 1)[-1] for entry in history for key in entry if key.startswith("ipo/masked_ratio/lag_")}
    assert "1" in lags  # the lag is real: samples one version old were trained
    assert lags <= {"0", "1"}
    assert not any(STALE_TOKENS_METRIC in entry for entry in history)  # none fetched too early on one process
    assert max(entry.get("sample/staleness_max", 0) for entry in history) <= 1


# ----------------------------------------------------------------------------------------------------------------
# A run that cannot learn
# ----------------------------------------------------------------------------------------------------------------
def test_learning_signal_watch_warns_once_per_dead_stretch(caplog):
    watch = LearningSignalWatch(patience=2)
    with caplog.at_level(logging.WARNING, logger="trl_ext.trainers.learning_signal"):
        for signal in (False, False, False, True, False, False):
            watch.saw(signal)
            watch.on_step_end(None, None, None)
    assert watch.warnings == 2  # steps 1-2 warn; step 3 is the same stretch; step 4 re-arms; steps 5-6 warn again
    assert "non-zero advantage" in caplog.text and "max_completion_length" in caplog.text
    with pytest.raises(ValueError, match="patience"):
        LearningSignalWatch(patience=0)


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_a_run_with_equal_rewards_everywhere_warns_that_nothing_trains(model_path, tmp_path, caplog):
    trainer, _ = local_grpo(model_path, tmp_path, max_steps=NO_SIGNAL_STEPS, token_budget=0)
    trainer.rollout_worker.reward_funcs = [zero_reward]
    with caplog.at_level(logging.WARNING, logger="trl_ext.trainers.learning_signal"):
        assert train_within(trainer) is None
    assert trainer.learning_signal.warnings == 1
    assert f"last {NO_SIGNAL_STEPS} optimizer steps" in caplog.text
    zero_std = [
        entry["frac_reward_zero_std"] for entry in trainer.state.log_history if "frac_reward_zero_std" in entry
    ]
    assert zero_std and all(value == 1.0 for value in zero_std)  # what the monitors' reward_no_signal reads


def test_a_run_that_learns_does_not_warn(model_path, tmp_path):
    trainer, _ = local_grpo(model_path, tmp_path, max_steps=NO_SIGNAL_STEPS, token_budget=0)
    assert train_within(trainer) is None
    assert trainer.learning_signal.warnings == 0


# ----------------------------------------------------------------------------------------------------------------
# Construction: a missing server fails at once; no spurious notices
# ----------------------------------------------------------------------------------------------------------------
def free_local_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # closed again: nothing listens there


def test_a_run_that_needs_a_server_nobody_started_fails_at_once(model_path, tmp_path):
    url = free_local_url()
    args = ExtAsyncGRPOConfig(
        output_dir=str(tmp_path), vllm_server_base_url=url, vllm_server_timeout=240, report_to=[], max_steps=1
    )
    tick = time.monotonic()
    with pytest.raises(ConnectionError, match=r"cannot be reached: connection refused: nothing listens.*LocalPolicy"):
        ExtAsyncGRPOTrainer(str(model_path), letter_reward, args=args, train_dataset=PROMPTS)
    assert time.monotonic() - tick < 30  # not after vllm_server_timeout=240 s


def test_construction_prints_no_duplicate_callback_notice_and_no_deprecation(model_path, tmp_path, monkeypatch):
    from transformers import trainer_callback

    notices = []
    monkeypatch.setattr(trainer_callback.logger, "warning", lambda message, *args: notices.append(str(message)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _ = local_grpo(model_path, tmp_path)
    assert not [notice for notice in notices if "already one" in notice]
    names = [type(callback).__name__ for callback in trainer.callback_handler.callbacks]
    assert names.count("StepIntervalCallback") == 2  # TRL's weight sync and step metrics, both kept
    assert not [w for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))], [
        str(w.message) for w in caught
    ]


def test_a_misspelt_trainer_keyword_names_the_closest(model_path, tmp_path):
    _, tokenizer = build_tiny_model_and_tokenizer(0)
    policy = LocalPolicy(str(model_path), tokenizer)
    args = ExtAsyncGRPOConfig(output_dir=str(tmp_path), report_to=[], max_steps=1)
    with pytest.raises(TypeError, match=r"'generater' \(did you mean 'generator'\?\)"):
        ExtAsyncGRPOTrainer(str(model_path), letter_reward, args=args, train_dataset=PROMPTS, generater=policy)
