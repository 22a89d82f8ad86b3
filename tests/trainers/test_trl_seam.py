"""`trl_ext.trainers.trl_seam`: each override of a TRL private method, exercised against the pinned TRL, and the
seam closed: nothing outside it names a private attribute of TRL."""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer
from trl.experimental.async_grpo import AsyncGRPOTrainer, async_grpo_trainer, packing
from trl.generation.vllm_generation import VLLMGeneration

import trl_ext
from trl_ext.fields import documented
from trl_ext.losses import LOSSES, LossSpec, register_loss
from trl_ext.testing import build_tiny_model_and_tokenizer
from trl_ext.trainers import ExtGRPOConfig, ExtGRPOTrainer
from trl_ext.trainers.trl_seam import (
    SEAM,
    SEAM_ATTRIBUTES,
    SEAM_CALLS,
    VLLM_GENERATION_SEAM,
    BatchScope,
    GeneratedBatch,
    LayerwiseReloadVLLMGeneration,
    TRLSeam,
    check_trl,
    tied_modules,
    use_layerwise_reload,
)
from trl_ext.trainers.trl_seam import check as seam_check

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
    assert seam_check._generate_return_names() == tuple(GeneratedBatch.__dataclass_fields__)
    monkeypatch.setattr(seam_check, "_generate_return_names", lambda: ("prompt_ids", "completion_ids"))
    with pytest.raises(ImportError, match="_generate returns"):
        check_trl()


def test_check_trl_checks_the_private_attributes_the_seam_touches(monkeypatch):
    """An attribute TRL sets in ``GRPOTrainer.__init__`` (read from its source) or a method the seam calls."""
    monkeypatch.setattr(seam_check, "SEAM_ATTRIBUTES", (*SEAM_ATTRIBUTES, "_renamed_in_a_new_trl"))
    with pytest.raises(ImportError, match=r"GRPOTrainer has no attribute _renamed_in_a_new_trl.*pip install"):
        check_trl()
    monkeypatch.delattr(GRPOTrainer, "_log_completion_extra")
    with pytest.raises(ImportError, match=r"GRPOTrainer\._log_completion_extra is missing"):
        check_trl()


# ---------------------------------------------------------------------------------- the seam is closed for attributes
def _trl_private_names() -> set[str]:
    """The private names TRL's GRPOTrainer, its experimental AsyncGRPOTrainer and transformers' Trainer define: class
    attributes, methods, and the ``self._x = ...`` assignments in their source; and the private module attributes of
    the async trainer's modules (``packing._flash_attn``)."""
    names: set[str] = {
        name for module in (async_grpo_trainer, packing) for name in vars(module) if name.startswith("_")
    }
    names -= {name for name in names if name.startswith("__")}
    for cls in dict.fromkeys((*GRPOTrainer.__mro__, *AsyncGRPOTrainer.__mro__)):
        if not cls.__module__.startswith(("trl.", "transformers.")):
            continue
        names |= {name for name in vars(cls) if name.startswith("_") and not name.startswith("__")}
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                if isinstance(node.ctx, ast.Store) and node.attr.startswith("_") and not node.attr.startswith("__"):
                    names.add(node.attr)
    return names


_OWNERS = ("self", "cls", "trainer", "GRPOTrainer", "AsyncGRPOTrainer", "packing", "async_grpo_trainer")


def private_trl_uses(source: str, trl_names: set[str]) -> list[str]:
    """``line: expression`` of each place ``source`` names a private TRL name: ``self._x``, ``cls._x``,
    ``trainer._x``, ``super()._x``, ``GRPOTrainer._x``, ``AsyncGRPOTrainer._x`` or a private attribute of the async
    trainer's modules (``packing._x``, ``async_grpo_trainer._x``), read or written, and class-body names that shadow
    one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in trl_names:
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in _OWNERS) or (
                isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"
            ):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                targets = statement.targets if isinstance(statement, ast.Assign) else []
                named = [t.id for t in targets if isinstance(t, ast.Name)]
                if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    named.append(statement.name)
                found += [f"{statement.lineno}: {node.name}.{name}" for name in named if name in trl_names]
    return found


def test_nothing_outside_the_seam_names_a_private_trl_attribute():
    """Only `trl_ext.trainers.trl_seam` (and `async_seam`, for TRL's experimental async trainer) reaches TRL's
    private state: a TRL bump then fails at `check_trl` / `check_trl_async`, at import, instead of at a metric
    KeyError in training."""
    trl_names = _trl_private_names()
    assert {"_metrics", "_buffered_inputs", "_tokenizer", "_log_completion_extra"} <= trl_names
    assert {"_step_forward_tokens", "_flash_attn"} <= trl_names  # the async trainer's
    package = Path(trl_ext.__file__).parent
    seams = (package / "trainers" / "trl_seam", package / "trainers" / "async_seam")
    offenders = {
        str(path.relative_to(package)): uses
        for path in sorted(package.rglob("*.py"))
        if not any(seam in path.parents for seam in seams)
        and (uses := private_trl_uses(path.read_text(), trl_names))
        and "callbacks" not in path.parts  # a callback's `self` is the callback (its own `_evaluate`)
    }
    assert not offenders, f"TRL's private names outside the seams (use the seam's services): {offenders}"
    # The scan catches what it must: a trainer writing TRL's metrics itself.
    source = "class T(ExtGRPOTrainer):\n    def f(self):\n        self._metrics['train']['x'].append(1.0)\n"
    assert private_trl_uses(source, trl_names) == ["3: self._metrics"]
    assert private_trl_uses("class T:\n    _tag_names = []\n", trl_names) == ["2: T._tag_names"]
    assert private_trl_uses("packing._flash_attn = f\n", trl_names) == ["1: packing._flash_attn"]


def test_the_seam_checks_every_private_name_it_uses():
    """Every private TRL name the seam's code names is checked by `check_trl` (a method overridden or called, or an
    attribute); those of TRL's vLLM backend too."""
    trl_names = _trl_private_names()
    seam = Path(trl_ext.__file__).parent / "trainers" / "trl_seam"
    used = {
        use.split(".")[-1].split("(")[0]
        for path in seam.glob("*.py")
        for use in private_trl_uses(path.read_text(), trl_names)
    }
    checked = set(SEAM) | set(SEAM_CALLS) | set(SEAM_ATTRIBUTES)
    assert used - checked == set(), used - checked


def test_trl_log_prob_passes_over_rows_that_will_be_replaced_are_skipped():
    """Inside a batch whose rows the hook replaces, TRL's old/reference passes return zeros without a forward; any
    other pass goes through the hook."""
    calls = []
    trainer = SimpleNamespace(
        _batch_scope=BatchScope(inputs=[], replaces_rows=True),
        per_token_logps_and_entropies=lambda *args, **kwargs: calls.append(args) or ("hook", None, None),
    )
    input_ids = torch.ones(3, 7, dtype=torch.long)
    logps, entropies, aux = TRLSeam._get_per_token_logps_and_entropies(trainer, None, input_ids, input_ids, 4)
    assert logps.shape == (3, 4) and not logps.any() and entropies is None and aux is None and not calls
    trainer._batch_scope = BatchScope(inputs=[])
    assert TRLSeam._get_per_token_logps_and_entropies(trainer, None, input_ids, input_ids, 4)[0] == "hook"


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

    def process_scored_batch(self, batch, inputs):
        self.calls.append(("process_scored_batch", self.batch_scope.rewards_per_func))
        return super().process_scored_batch(batch, inputs)

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
        "process_scored_batch",
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
    scope_rewards = dict(trainer.calls)["process_scored_batch"]
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

    @dataclass(frozen=True)
    class MeanLogpSettings:
        scale: float = documented(1.0, "Multiplies the loss.")

    spec = LossSpec("test_mean_logp", "tokens", mean_logp_loss, settings=MeanLogpSettings)
    register_loss(spec)
    try:
        model, tokenizer = build_tiny_model_and_tokenizer(0)
        config = ExtGRPOConfig(
            **cpu_config_kwargs(str(tmp_path), max_steps=1, loss_type="test_mean_logp", loss_kwargs={"scale": 8.0})
        )
        trainer = ExtGRPOTrainer(
            model, digit_reward, args=config, train_dataset=toy_dataset(), processing_class=tokenizer
        )
        trainer.train()
    finally:
        del LOSSES["test_mean_logp"]
    assert calls and all(scale == 8.0 for scale in calls)  # from loss_kwargs, not the class default
    assert trainer.state.log_history[0]["test_mean_logp/scale"] == pytest.approx(8.0)


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


def test_both_seams_check_against_the_one_pin_the_package_requires():
    from trl_ext.trainers.async_seam import check as async_check
    from trl_ext.trainers.trl_seam import check as sync_check

    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert f'"{sync_check.TRL_PIN}"' in pyproject
    assert async_check.raise_if_problems is sync_check.raise_if_problems  # the async seam extends the sync one
