"""Shared-prefix packing is exact: packed passes give the unpacked rows' log-probs, entropies, losses and gradients.

Each test scores one real generation batch, moves the policy off it (so ratios, clipping and masks matter), then
computes everything twice on the same batch: ``prefix_sharing="off"`` (TRL's rows) and ``"on"`` (packed; ``"auto"``
would leave these small batches unpacked, see the last tests).
Tolerances: per-token log-probs and entropies 1e-5 (float32); loss 1e-6 relative and every gradient 1e-4 relative
with float64 weights. (TRL's fused LM head returns float32 log-probs whatever the model's dtype, so float64 weights
still leave ~3e-7 of float32 rounding in the loss; with float32 weights the two paths round differently by up to
~1e-5 of a loss whose token terms cancel, as rows with a different left padding do too: RoPE at shifted positions.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig

from trl_ext import ExtGRPOConfig, ExtGRPOTrainer
from trl_ext.losses import LOSSES
from trl_ext.testing import build_tiny_model_and_tokenizer

from ..utils import cpu_config_kwargs, digit_reward, run_processes
from .test_stepwise_rlm import generation_inputs, make_trainer

# A long shared prompt: the packed pass encodes it once per group instead of once per completion.
LONG_PROMPTS = [
    "You are a helpful assistant. Answer the question. What is 2 + 3? The answer is 5. What is 7 * 6?",
    "The quick brown fox jumps over the lazy dog. Hello world! Count to five. 0 1 2 3 4 5 6 7 8 9 10",
]


def grpo_trainer(
    tmp_path, loss_type: str = "dapo", peft_config=None, dtype=torch.float32, **overrides
) -> ExtGRPOTrainer:
    model, tokenizer = build_tiny_model_and_tokenizer(0, initializer_range=0.2)
    model.to(dtype)
    if peft_config is None:  # a saved model: TRL builds the β-KL reference model from its path
        path = Path(tmp_path) / "tiny-model"
        model.save_pretrained(path)
        model = str(path)
    settings = dict(
        loss_type=loss_type,
        importance_sampling_level="sequence" if loss_type == "luspo" else "token",
        num_iterations=2,  # TRL keeps old log-probs
        beta=0.04,  # and reference log-probs (a reference model; with LoRA: the adapter disabled)
        max_completion_length=12,
        temperature=1.0,
        prefix_sharing="on",  # these batches are small: "auto" would keep TRL's rows
    )
    settings.update(overrides)
    if dtype != torch.float32:
        settings["model_init_kwargs"] = {"dtype": dtype}
    config = ExtGRPOConfig(**cpu_config_kwargs(str(tmp_path), **settings))
    dataset = Dataset.from_dict({"prompt": LONG_PROMPTS * 4})
    trainer = ExtGRPOTrainer(
        model, digit_reward, args=config, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); each loss below is one full step
    return trainer


def grpo_batch(trainer: ExtGRPOTrainer) -> dict:
    inputs = [{"prompt": LONG_PROMPTS[i // 4]} for i in range(8)]  # 2 prompts x G = 4
    return trainer._generate_and_score_completions(inputs)


def perturb(model) -> None:
    """An "update": every ratio moves off 1, so clipping, IPO masks and KL terms are exercised."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.02 * torch.randn(param.shape, generator=generator))


def loss_and_grads(trainer, batch, mode: str):
    trainer.args.prefix_sharing = mode
    packed_before = len(trainer._metrics["train"]["packing/token_ratio"])
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    packed = len(trainer._metrics["train"]["packing/token_ratio"]) > packed_before
    return loss.detach(), grads, packed


def assert_same_loss_and_grads(trainer, batch) -> None:
    # Positive advantages: the token terms of the loss do not cancel, so a relative tolerance on the sum is
    # meaningful (with mixed signs a loss of ~1e-3 from terms of ~1 carries ~1e-5 relative float32 noise).
    batch = {**batch, "advantages": batch["advantages"].abs() + 0.1}
    loss_rows, grads_rows, packed_rows = loss_and_grads(trainer, batch, "off")
    loss_packed, grads_packed, packed = loss_and_grads(trainer, batch, "on")
    assert packed and not packed_rows, "the 'on' pass must actually pack, the 'off' pass must not"
    assert abs(loss_rows.item()) > 1e-4, "a near-zero loss would make the comparison vacuous"
    assert loss_packed.item() == pytest.approx(loss_rows.item(), rel=1e-6, abs=1e-8)
    assert grads_rows.keys() == grads_packed.keys() and grads_rows
    for name, grad in grads_rows.items():
        error = (grads_packed[name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert error < 1e-4, f"{name}: relative gradient error {error:.2e}"


def assert_same_logps_and_entropies(trainer, batch) -> None:
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    width = batch["completion_ids"].shape[1]
    results = {}
    for mode in ("off", "on"):
        trainer.args.prefix_sharing = mode
        with torch.no_grad():
            logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids, attention_mask, width, compute_entropy=True
            )
        results[mode] = logps, entropies
    mask = batch["completion_mask"].bool()
    assert mask.sum() > 20
    for rows, packed in zip(results["off"], results["on"]):
        assert (rows - packed)[mask].abs().max().item() < 1e-5


@pytest.fixture(scope="module")
def dapo_run(tmp_path_factory):
    trainer = grpo_trainer(tmp_path_factory.mktemp("packing"))
    batch = grpo_batch(trainer)
    perturb(trainer.model)
    return trainer, batch


def test_grpo_groups_pack_to_fewer_tokens(dapo_run):
    trainer, batch = dapo_run
    ratios = trainer._metrics["train"]["packing/token_ratio"]
    assert ratios and max(ratios) < 0.6  # old and reference passes packed: each prompt once per group of 4


def test_grpo_groups_same_logps_and_entropies(dapo_run):
    assert_same_logps_and_entropies(*dapo_run)


@pytest.mark.parametrize("loss_type", sorted(LOSSES))
def test_grpo_groups_same_loss_and_gradients_for_every_loss_type(dapo_run, tmp_path, loss_type):
    _, batch = dapo_run
    overrides = {"ipo_threshold": 0.02} if loss_type == "ipo" else {}  # a tight trust region: some tokens masked
    trainer = grpo_trainer(tmp_path, loss_type=loss_type, dtype=torch.float64, **overrides)
    perturb(trainer.model)  # the same weights as the run that scored the batch, moved the same way
    assert_same_loss_and_grads(trainer, batch)
    metrics = trainer._metrics["train"]
    assert metrics["kl"][-1] > 0
    if loss_type == "dapo":
        assert metrics["clip_ratio/region_mean"][-1] > 0, "the update should clip some tokens"
    if loss_type == "ipo":
        assert 0 < metrics["ipo/masked_ratio"][-1] < 1, "the update should mask some tokens and not others"


def test_lora_with_gradient_checkpointing_same_loss_and_gradients(tmp_path):
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = grpo_trainer(
        tmp_path, loss_type="ipo", peft_config=peft_config, dtype=torch.float64, gradient_checkpointing=True
    )
    batch = grpo_batch(trainer)  # the reference pass runs with the adapter disabled
    perturb(trainer.model)
    assert_same_logps_and_entropies(trainer, batch)
    assert_same_loss_and_grads(trainer, batch)
    assert any("lora_" in name for name in trainer.model.state_dict())


@pytest.fixture(scope="module")
def stepwise_run(tmp_path_factory):
    # 4 trees, 2 per prompt group: the 2 groups of the regrouping test (a group shares its prompt's prefixes)
    trainer = make_trainer(tmp_path_factory.mktemp("stepwise"), num_iterations=2, num_generations=2)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = trainer._generate_and_score_completions(generation_inputs())
    perturb(trainer.model)
    return trainer, batch


def test_stepwise_trees_with_children_same_logps_and_entropies(stepwise_run):
    trainer, batch = stepwise_run
    assert batch["rlm_depth"].max() == 2  # children and grandchildren
    assert_same_logps_and_entropies(trainer, batch)


def test_stepwise_trees_with_children_same_loss_and_gradients(stepwise_run):
    trainer, batch = stepwise_run
    trainer.model.to(torch.float64)
    try:
        assert_same_loss_and_grads(trainer, batch)
    finally:
        trainer.model.to(torch.float32)


def _causal_only_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention that ignores custom masks (as flash attention does): plain causal over the whole row."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, **{**kwargs, "is_causal": True})


def test_an_attention_without_custom_masks_keeps_trl_rows(tmp_path, caplog):
    from transformers import AttentionInterface

    AttentionInterface.register("causal_only", _causal_only_attention)
    trainer = grpo_trainer(tmp_path, prefix_sharing="off")
    batch = grpo_batch(trainer)
    trainer.model.config._attn_implementation = "causal_only"
    with caplog.at_level("WARNING"):
        _, _, packed = loss_and_grads(trainer, batch, "on")
    assert not packed and "takes no custom mask" in caplog.text


def test_a_model_that_ignores_the_mask_is_caught_once_and_keeps_trl_rows(tmp_path, caplog, monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    trainer = grpo_trainer(tmp_path, prefix_sharing="off")
    batch = grpo_batch(trainer)
    # "sdpa" that silently drops the tree mask: the one-time check against TRL's rows must catch it
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", _causal_only_attention)
    with caplog.at_level("WARNING"):
        loss_and_grads(trainer, batch, "on")
        _, _, packed = loss_and_grads(trainer, batch, "on")
    assert not packed and trainer._packing_verified is False
    assert caplog.text.count("packed log-probs differ") == 1


def packs(trainer, batch, mode: str) -> bool:
    """Whether a log-prob pass over ``batch`` under ``mode`` packs."""
    trainer.args.prefix_sharing = mode
    before = len(trainer._metrics["train"]["packing/token_ratio"])
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
            batch["completion_ids"].shape[1],
        )
    return len(trainer._metrics["train"]["packing/token_ratio"]) > before


def test_auto_packs_the_passes_that_save_enough_tokens(dapo_run, stepwise_run):
    trainer, small = dapo_run  # 8 rows of ~40 tokens: saves fewer than 1,024 tokens
    assert not packs(trainer, small, "auto") and packs(trainer, small, "on")
    trainer, large = stepwise_run  # 56 turn rows re-encoding their histories
    assert packs(trainer, large, "auto")
    trainer.args.prefix_sharing = "on"


def test_micro_batches_keep_each_prompts_completions_together(tmp_path):
    trainer = grpo_trainer(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1)
    seen = []
    original = trainer.compute_policy_loss

    def recording(model, inputs):
        seen.append(inputs["prefix_group"].tolist())
        return original(model, inputs)

    trainer.compute_policy_loss = recording
    trainer.train()
    assert len(seen) == 2 and all(len(set(groups)) == 1 for groups in seen)


def _interleaved_micro_batches(batch: dict) -> list[dict]:
    """The batch's rows in 2 micro-batches, alternately: each holds rows of every prefix group."""
    rows = len(batch["prompt_ids"])
    micro = []
    for start in (0, 1):
        index = torch.arange(start, rows, 2)
        micro.append(
            {
                key: value[index]
                if isinstance(value, torch.Tensor) and value.dim() > 0
                else [value[i] for i in index.tolist()]
                if isinstance(value, list)
                else value
                for key, value in batch.items()
            }
        )
    return micro


def test_auto_regroups_micro_batches_only_where_a_training_pass_packs(dapo_run, stepwise_run):
    """``"auto"`` keeps TRL's split where no training pass would be packed, so losses and gradients add up in TRL's
    order (tests/trainers/test_drop_in.py: bit for bit TRL's run), and puts each prefix group in one micro-batch
    where a pass packs; ``"on"`` always groups."""
    for (trainer, batch), auto_packs in ((dapo_run, False), (stepwise_run, True)):
        micro = _interleaved_micro_batches(batch)
        assert all(len(set(b["prefix_group"].tolist())) > 1 for b in micro)
        trainer.args.prefix_sharing = "auto"
        arranged = trainer.arrange_micro_batches(micro)
        assert (arranged is not micro) == auto_packs
        trainer.args.prefix_sharing = "on"
        grouped = trainer.arrange_micro_batches(micro)
        for split in (grouped, arranged) if auto_packs else (grouped,):
            groups = [set(b["prefix_group"].tolist()) for b in split]
            assert not groups[0] & groups[1]  # no prefix group split across micro-batches


def test_micro_batches_with_images_keep_trl_split(dapo_run):
    trainer, _ = dapo_run
    micro = [{"prefix_group": torch.tensor([i, 1 - i]), "pixel_values": torch.zeros(3, 4)} for i in range(2)]
    assert trainer.arrange_micro_batches(micro) is micro


@pytest.mark.slow
def test_two_processes_packed_equals_rows(tmp_path):
    run_processes("packing_ddp.py", tmp_path)
    for rank in range(2):
        report = (tmp_path / f"rank{rank}.txt").read_text()
        assert report.startswith("ok"), report
