"""The seam between trl-ext and TRL: every override of a private method of `trl.GRPOTrainer` lives here.

TRL 1.16 has no public hooks for what trl-ext needs, so `TRLSeam` overrides nine of its private methods, once each,
and turns each (but ``_save_checkpoint``) into a trl-ext hook with a documented contract. trl-ext's trainers override
the hooks, never TRL's private methods; the per-batch state the hooks share lives in one `BatchScope` object, not in
trainer fields.

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

A failed save leaves its partial ``checkpoint-N`` folder in place: `trl_ext.checkpoints.resolve_resume_checkpoint`
skips it on resume, and removing it is not safe (other ranks may still write into it; after a resume from an earlier
checkpoint it may hold the only copy of some of step N's files).

`check_trl` runs at import: it checks that the installed TRL has the signatures (and `_generate`'s 8-tuple) this
module relies on, and fails with the fix (install ``trl>=1.16,<1.17``) otherwise.
"""

from __future__ import annotations

import ast
import inspect
import logging
import os
import textwrap
from dataclasses import dataclass, fields
from typing import Any

import torch
import trl
from accelerate.utils import send_to_device
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from ..checkpoints import TRAINER_STATE, name_disk_full

logger = logging.getLogger(__name__)

__all__ = ["SEAM", "BatchScope", "GeneratedBatch", "TRLSeam", "check_trl"]

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
    for name, expected in SEAM.items():
        method = getattr(GRPOTrainer, name, None)
        if method is None:
            problems.append(f"GRPOTrainer.{name} is missing")
            continue
        params = tuple(inspect.signature(method).parameters)
        if params != expected:
            problems.append(f"GRPOTrainer.{name}{params} (expected {expected})")
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
