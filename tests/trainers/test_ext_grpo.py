"""`ExtGRPOTrainer` / `ExtGRPOConfig`: real training runs of the tiny model on CPU."""

from __future__ import annotations

import logging

import pytest
import torch
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

from trl_ext import ExtGRPOConfig, ExtGRPOTrainer
from trl_ext.losses import LOSSES
from trl_ext.samples import check_scored_batch, pad_batch
from trl_ext.testing import build_tiny_model_and_tokenizer
from trl_ext.trainers import ext_grpo_config as ext_grpo

from ..utils import cpu_config_kwargs, digit_reward, run_processes, toy_dataset


def distinct_chars_reward(completions, **kwargs):
    return [len(set(text)) / 10 for text in completions]


def lora_config():
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"ipo_threshold": -0.1}, "ipo_threshold"),
        ({"ipo_threshold": 0.0}, "ipo_threshold"),
        ({"ipo_ratio_cap": 1.0}, "ipo_ratio_cap"),
        ({"ipo_ratio_cap": 0.5}, "ipo_ratio_cap"),
        ({"ipo_kl_tau": -1.0}, "ipo_kl_tau"),
        ({"loss_type": "ppo"}, "Set loss_type to one of"),
        ({"loss_type": "ipo", "importance_sampling_level": "sequence"}, "importance_sampling_level='token'"),
        ({"loss_type": "ipo", "entropy_coef": 0.01}, "entropy_coef=0.0"),
        ({"vllm_dtype": "fp8"}, r"vllm_dtype='fp8': use one of \['auto', 'float32', 'bfloat16', 'float16'\]"),
    ],
)
def test_config_rejects_bad_values_with_the_fix(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        ExtGRPOConfig(**cpu_config_kwargs(str(tmp_path), **overrides))


def test_config_defaults_and_plain_grpo_config_for_ipo(tmp_path):
    config = ExtGRPOConfig(**cpu_config_kwargs(str(tmp_path), loss_type="ipo"))
    assert (config.ipo_threshold, config.ipo_ratio_cap, config.ipo_kl_tau) == (0.3, 8.0, 0.0)
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    plain = GRPOConfig(**cpu_config_kwargs(str(tmp_path), loss_type="ipo"))
    with pytest.raises(TypeError, match="ExtGRPOConfig"):
        ExtGRPOTrainer(model, digit_reward, args=plain, train_dataset=toy_dataset(), processing_class=tokenizer)


# ----------------------------------------------------------------------------------------------------------------
# Precision: an unset bf16 means float32 where bf16 cannot run (every docs snippet runs as written on a CPU)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(ext_grpo.bf16_accelerator_available(), reason="this host has a bf16 accelerator")
def test_unset_bf16_trains_in_float32_without_a_bf16_accelerator(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="trl_ext.trainers.ext_grpo_config"):
        config = ExtGRPOConfig(output_dir=str(tmp_path))  # no use_cpu, no bf16: TRL alone fails here
    assert (config.bf16, config.fp16) == (False, False)
    assert "training in float32" in caplog.text and "no accelerator with bf16 support" in caplog.text


@pytest.mark.skipif(not ext_grpo.bf16_accelerator_available(), reason="needs an accelerator with bf16 support")
def test_unset_bf16_keeps_trl_default_on_a_bf16_accelerator(tmp_path):
    assert ExtGRPOConfig(output_dir=str(tmp_path)).bf16 is True


def test_unset_bf16_with_use_cpu_trains_in_float32(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(ext_grpo, "bf16_accelerator_available", lambda: True)  # even next to a bf16 GPU
    with caplog.at_level(logging.INFO, logger="trl_ext.trainers.ext_grpo_config"):
        config = ExtGRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    assert config.bf16 is False
    assert "use_cpu=True: training in float32" in caplog.text


def test_explicit_precision_is_kept_or_refused_with_the_fix(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(ext_grpo, "bf16_accelerator_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="trl_ext.trainers.ext_grpo_config"):
        assert ExtGRPOConfig(output_dir=str(tmp_path), bf16=False).bf16 is False
    assert "float32" not in caplog.text  # nothing to say when the user chose
    with pytest.raises(ValueError, match=r"bf16=True, but this machine has no accelerator .*set bf16=False"):
        ExtGRPOConfig(output_dir=str(tmp_path), bf16=True)


# ----------------------------------------------------------------------------------------------------------------
# IPO with LoRA: the mask fires, only the adapter moves
# ----------------------------------------------------------------------------------------------------------------
def test_ipo_lora_run_masks_tokens_and_trains_only_the_adapter(tmp_path):
    model, tokenizer = build_tiny_model_and_tokenizer(0, initializer_range=1.0)  # peaked policy
    base_before = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = ExtGRPOConfig(
        **cpu_config_kwargs(str(tmp_path), loss_type="ipo", num_iterations=4, max_steps=8, learning_rate=0.1)
    )
    trainer = ExtGRPOTrainer(
        model,
        distinct_chars_reward,
        args=config,
        train_dataset=toy_dataset(),
        processing_class=tokenizer,
        peft_config=lora_config(),
    )
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    trainer.train()

    logs = [h for h in trainer.state.log_history if "ipo/masked_ratio" in h]
    assert len(logs) == 8
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert max(h["ipo/masked_ratio"] for h in logs) > 0.05, "the trust region never masked a token"
    # the first micro-step of each generation is on-policy: nothing can be masked there
    assert logs[0]["ipo/masked_ratio"] == 0.0 and logs[0]["ipo/ratio_mean"] == pytest.approx(1.0)

    changed = [n for n, p in trainer.model.named_parameters() if "lora_" in n and not torch.equal(p, lora_before[n])]
    assert changed, "no LoRA weight changed"
    for name, param in trainer.model.named_parameters():
        if "lora_" in name:
            continue
        base_name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        assert torch.equal(param.detach(), base_before[base_name]), f"base weight {name} changed"


# ----------------------------------------------------------------------------------------------------------------
# Every TRL loss type is unchanged
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("loss_type", [name for name, spec in LOSSES.items() if spec.compute is None])
def test_trl_loss_types_give_the_same_losses_as_grpo_trainer(tmp_path, loss_type):
    level = "sequence" if loss_type == "luspo" else "token"
    histories = []
    for trainer_cls, config_cls in ((GRPOTrainer, GRPOConfig), (ExtGRPOTrainer, ExtGRPOConfig)):
        model, tokenizer = build_tiny_model_and_tokenizer(0, initializer_range=1.0)
        config = config_cls(
            **cpu_config_kwargs(
                str(tmp_path / trainer_cls.__name__),
                loss_type=loss_type,
                importance_sampling_level=level,
                num_iterations=2,
                max_steps=3,
            )
        )
        trainer = trainer_cls(
            model, distinct_chars_reward, args=config, train_dataset=toy_dataset(), processing_class=tokenizer
        )
        trainer.train()
        histories.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    trl_losses, ext_losses = histories
    assert len(trl_losses) == 3
    # ExtGRPOTrainer packs each prompt's completions (prefix_sharing="auto"): the on-policy losses are ~1e-6 of
    # float noise around 0, which the packed forward rounds differently.
    assert ext_losses == pytest.approx(trl_losses, rel=1e-5, abs=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# The hook: per-token advantages, loss weights, changed rows
# ----------------------------------------------------------------------------------------------------------------
class CapturingTrainer(ExtGRPOTrainer):
    """Keeps the last batch the hook produced."""

    def process_scored_batch(self, batch, inputs):
        self.captured = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        return batch


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    model, tokenizer = build_tiny_model_and_tokenizer(0, initializer_range=1.0)
    config = ExtGRPOConfig(**cpu_config_kwargs(str(tmp_path_factory.mktemp("cap")), max_steps=1, beta=0.0))
    trainer = CapturingTrainer(
        model, distinct_chars_reward, args=config, train_dataset=toy_dataset(), processing_class=tokenizer
    )
    trainer.train()
    return trainer, trainer.captured


def _loss(trainer, batch, loss_type):
    trainer.loss_type = loss_type
    if loss_type == "ipo":
        trainer.args.ipo_threshold, trainer.args.ipo_ratio_cap, trainer.args.ipo_kl_tau = 0.3, 8.0, 0.0
    with torch.no_grad():
        return trainer.compute_loss(trainer.model, batch).item()


def test_hook_sees_rewards_and_tokens(captured):
    trainer, batch = captured
    assert batch["rewards"].shape == (4,)
    texts = trainer.processing_class.batch_decode(batch["completion_ids"] * batch["completion_mask"])
    expected = distinct_chars_reward([t.replace("<|endoftext|>", "") for t in texts])
    torch.testing.assert_close(batch["rewards"], torch.tensor(expected), rtol=0, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "ipo"])
def test_loss_weights_and_token_advantages(captured, loss_type):
    trainer, batch = captured
    trainer.model.train()
    base = _loss(trainer, batch, loss_type)
    assert base != 0.0
    token_adv = {**batch, "advantages": batch["advantages"].unsqueeze(1).expand_as(batch["completion_mask"]).clone()}
    assert _loss(trainer, token_adv, loss_type) == pytest.approx(base, rel=1e-6)
    doubled = {**batch, "loss_weights": torch.full(batch["completion_mask"].shape, 2.0)}
    assert _loss(trainer, doubled, loss_type) == pytest.approx(2 * base, rel=1e-6)
    # zero weight on a whole row removes exactly that row's contribution (token-normalised losses)
    if loss_type in ("dapo", "ipo", "bnpo"):
        weights = torch.ones(batch["completion_mask"].shape)
        weights[0] = 0.0
        only_rest = {**batch, "advantages": batch["advantages"].clone()}
        only_rest["advantages"][0] = 0.0
        assert _loss(trainer, {**batch, "loss_weights": weights}, loss_type) == pytest.approx(
            _loss(trainer, only_rest, loss_type), rel=1e-6
        )


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo", "ipo"])
def test_padding_rows_do_not_change_the_loss(captured, loss_type):
    trainer, batch = captured
    trainer.model.train()
    batch = {**batch, "is_padding_row": torch.zeros(4, dtype=torch.bool)}
    padded = pad_batch(batch, 4, 3)
    padded["is_padding_row"] = torch.tensor([False] * 4 + [True] * 3)
    assert padded["completion_mask"][4:].sum() == 0 and padded["advantages"][4:].abs().sum() == 0
    torch.testing.assert_close(padded["prompt_ids"][4:], batch["prompt_ids"][:3])  # copies of real rows
    assert _loss(trainer, padded, loss_type) == pytest.approx(_loss(trainer, batch, loss_type), rel=1e-6)


class RowChangingTrainer(ExtGRPOTrainer):
    """Grows each generation batch from 8 to 11 rows (not a multiple of steps_per_generation = 2)."""

    def process_scored_batch(self, batch, inputs):
        n = len(batch["prompt_ids"])
        extra = torch.arange(3)
        grown = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                grown[key] = torch.cat([value, value[extra]])
            else:
                grown[key] = value
        grown["row_id"] = torch.arange(n + 3)
        self.expected_tokens = int(grown["completion_mask"].sum())
        return grown

    def _compute_loss(self, model, inputs):
        real = ~inputs["is_padding_row"]
        self.seen_rows.extend(inputs["row_id"][real].tolist())
        self.seen_num_items.append(int(inputs["num_items_in_batch"]))
        return super()._compute_loss(model, inputs)


@pytest.mark.parametrize("loss_type", ["grpo", "ipo"])
def test_changed_row_count_loses_no_row(tmp_path, loss_type):
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    config = ExtGRPOConfig(
        **cpu_config_kwargs(str(tmp_path), loss_type=loss_type, steps_per_generation=2, max_steps=2)
    )
    trainer = RowChangingTrainer(
        model, digit_reward, args=config, train_dataset=toy_dataset(), processing_class=tokenizer
    )
    trainer.seen_rows, trainer.seen_num_items = [], []
    trainer.train()
    assert sorted(trainer.seen_rows) == list(range(11))  # 11 real rows over 2 micro-batches of 6 (1 padding row)
    assert trainer.seen_num_items == [trainer.expected_tokens] * 2
    padding = [h["batch/padding_rows"] for h in trainer.state.log_history if "batch/padding_rows" in h]
    assert padding == [1.0]


def test_hook_validation_errors(captured):
    trainer, batch = captured
    bad = {**batch, "advantages": torch.zeros(4, 3)}
    with pytest.raises(ValueError, match="advantages must be"):
        check_scored_batch(bad)
    bad = {**batch, "loss_weights": -torch.ones(batch["completion_mask"].shape)}
    with pytest.raises(ValueError, match="loss_weights must be finite and >= 0"):
        check_scored_batch(bad)
    bad = {**batch, "extra": [1, 2]}
    with pytest.raises(ValueError, match="every value must be"):
        check_scored_batch(bad)


# ----------------------------------------------------------------------------------------------------------------
# Two processes with unequal row counts
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_process_run_with_unequal_row_counts(tmp_path):
    run_processes("ddp_unequal_rows.py", tmp_path, timeout=240)
    reports = sorted((tmp_path / f"rank{rank}.txt").read_text().split() for rank in range(2))
    # rank 0 keeps its 4 rows, rank 1 grows to 7: both end with 7 real + padding rows, none lost
    assert reports[0] == ["rank=0", "real_rows=4", "rows=7", "steps=2"]
    assert reports[1] == ["rank=1", "real_rows=7", "rows=7", "steps=2"]


def test_monitors_passed_as_callbacks_run_before_the_loggers(tmp_path):
    from transformers.trainer_callback import DefaultFlowCallback

    from trl_ext import default_monitors
    from trl_ext.callbacks.monitors import MonitorCallback

    model, tokenizer = build_tiny_model_and_tokenizer(0)
    trainer = ExtGRPOTrainer(
        model,
        digit_reward,
        args=ExtGRPOConfig(**cpu_config_kwargs(str(tmp_path))),
        train_dataset=toy_dataset(),
        processing_class=tokenizer,
        callbacks=default_monitors(),
    )
    kinds = [type(cb) for cb in trainer.callback_handler.callbacks]
    first_monitor = next(
        i for i, cb in enumerate(trainer.callback_handler.callbacks) if isinstance(cb, MonitorCallback)
    )
    assert first_monitor == kinds.index(DefaultFlowCallback) + 1


# ----------------------------------------------------------------------------------------------------------------
# A run that cannot learn
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", ["ipo", "dapo"])
def test_a_sync_run_with_equal_rewards_warns_that_nothing_trains(tmp_path, caplog, loss_type):
    from trl_ext.trainers.learning_signal import NO_SIGNAL_STEPS

    model, tokenizer = build_tiny_model_and_tokenizer(0)
    config = ExtGRPOConfig(**cpu_config_kwargs(str(tmp_path), loss_type=loss_type, max_steps=NO_SIGNAL_STEPS))
    constant = ExtGRPOTrainer(
        model, lambda completions, **kw: [1.0] * len(completions), args=config,
        train_dataset=toy_dataset(), processing_class=tokenizer,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="trl_ext.trainers.learning_signal"):
        constant.train()
    assert constant.learning_signal.warnings == 1 and f"last {NO_SIGNAL_STEPS} optimizer steps" in caplog.text
    learning = ExtGRPOTrainer(
        model, distinct_chars_reward, args=config, train_dataset=toy_dataset(), processing_class=tokenizer
    )
    learning.train()
    assert learning.learning_signal.warnings == 0
