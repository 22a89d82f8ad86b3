"""`TRLSeam`: `trl.GRPOTrainer` with its private methods turned into trl-ext hooks, and the services trl-ext's
trainers use instead of TRL's private attributes (see the package docstring for the table of overrides).

Services (the only way trl-ext reaches TRL's private state): `mode`, `log_metric`/`relog_metric` (TRL's
``_metrics``), `global_sums`/`global_max` (one collective each, unpacked), `tokenizer` (TRL's ``_tokenizer``),
`entropy_bonus_enabled`, `log_completion_column` and `reward_logging_kwargs` (TRL's completions table and reward
metrics), ``model_card`` (TRL's ``_tag_names``/``_name``/``_paper``), and the buffered generation batch of resuming.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from accelerate.utils import send_to_device
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from ...checkpoints import TRAINER_STATE, name_disk_full
from .vllm import use_layerwise_reload

logger = logging.getLogger(__name__)

__all__ = ["BatchScope", "GeneratedBatch", "TRLSeam", "generation_buffer_file"]


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
        replaces_rows: `process_scored_batch` replaces every row TRL builds (and computes the new rows' log-probs
            itself): TRL's old-policy and reference log-prob passes over the rows it builds are skipped (they get
            zeros, never trained on).
    """

    inputs: list[dict[str, Any]]
    rewards_per_func: Any = None
    replaces_rows: bool = False


class TRLSeam(GRPOTrainer):
    """`trl.GRPOTrainer` with its private methods turned into trl-ext hooks (see the package docstring).

    Every hook's default leaves TRL's behaviour unchanged. A subclass names its model card's method with
    ``model_card`` (an entry of `trl_ext.methods.METHODS`: tags, name, paper).
    """

    batch_scope_class: type[BatchScope] = BatchScope
    model_card: ClassVar[Any] = None
    _batch_scope: BatchScope | None = None
    _generated_new_batch: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        card = cls.__dict__.get("model_card")
        if card is not None:  # TRL's model card (create_model_card, push_to_hub) reads these class attributes
            cls._tag_names, cls._name, cls._paper = card.tag_names, card.name, card.paper

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.use_vllm:
            use_layerwise_reload(self.vllm_generation)
        if self.rollout_func is not None:  # TRL calls it in place of generation: its samples go through the hook too
            self.rollout_func = _postprocessed(self.rollout_func)

    @property
    def batch_scope(self) -> BatchScope:
        """The current generation batch's `BatchScope` (only while TRL generates and scores a batch)."""
        if self._batch_scope is None:
            raise RuntimeError("batch_scope is only available while a generation batch is generated and scored.")
        return self._batch_scope

    # ---------------------------------------------------------------------------------------------- services
    @property
    def mode(self) -> str:
        """``"train"`` or ``"eval"``: which of TRL's metric series (and settings) the current pass uses."""
        return "train" if self.model.training else "eval"

    @property
    def tokenizer(self) -> Any:
        """The tokenizer: ``processing_class``, or its tokenizer when that is a processor (vision-language)."""
        return self._tokenizer

    @property
    def entropy_bonus_enabled(self) -> bool:
        """Whether TRL adds its entropy bonus to the loss (``entropy_coef != 0`` or ``use_adaptive_entropy``)."""
        return self._entropy_bonus_enabled

    def log_metric(self, name: str, value: float) -> None:
        """Log ``value`` under ``name`` in the current mode; TRL averages a step's values into its next log."""
        self._metrics[self.mode][name].append(float(value))

    def relog_metric(self, name: str, value: float) -> None:
        """Replace the value logged last under ``name`` (one TRL logged for rows that were then replaced), or log it."""
        series = self._metrics[self.mode][name]
        if series:
            series[-1] = float(value)
        else:
            series.append(float(value))

    def global_sums(self, *values: float | torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``(len(values),)`` sums of each value over all ranks, in one collective (every rank must call it)."""
        local = torch.stack([torch.as_tensor(value).detach().to(self.accelerator.device, dtype) for value in values])
        return self.accelerator.reduce(local, reduction="sum")

    def log_rollout_metrics(
        self,
        metrics: Mapping[str, float | tuple[float, float]],
        *,
        counts: Collection[str] = (),
    ) -> None:
        """Log a method's metrics of this rank's rollouts, reduced over all ranks as TRL's asynchronous trainer reduces
        a log window (`trl_ext.rlm.metrics`): a ``(numerator, denominator)`` pair as Σ numerators / Σ denominators
        (nothing logged when that is 0/0: the rate has no value), a name with the word ``total`` summed, one with
        ``max`` the largest; the names in ``counts`` (a count of the generation batch, `trl_ext.judge.metrics`) are
        summed too. Every rank must call it with the same names."""
        pairs, totals, maxima = [], [], []
        for name, value in metrics.items():
            words = name.rsplit("/", 1)[-1].split("_")
            if isinstance(value, tuple):
                pairs.append(name)
            elif "total" in words or name in counts:
                totals.append(name)
            elif "max" in words:
                maxima.append(name)
            else:
                raise ValueError(
                    f"metric {name!r} is neither a (numerator, denominator) pair nor a counter (the word 'total' in "
                    "its name) nor an extremum ('max'): give a rate as a pair so ranks are reduced as TRL does."
                )
        flat = [part for name in pairs for part in metrics[name]] + [metrics[name] for name in totals]
        sums = self.global_sums(*flat).tolist() if flat else []
        for i, name in enumerate(pairs):
            numerator, denominator = sums[2 * i], sums[2 * i + 1]
            if denominator:
                self.log_metric(name, numerator / denominator)
        for name, total in zip(totals, sums[2 * len(pairs) :], strict=True):
            self.log_metric(name, total)
        if maxima:
            for name, largest in zip(
                maxima, self.global_max(*(metrics[name] for name in maxima)).tolist(), strict=True
            ):
                self.log_metric(name, largest)

    def global_max(self, *values: float | torch.Tensor) -> torch.Tensor:
        """``(len(values),)`` maxima of each value over all ranks, in one collective (every rank must call it)."""
        local = torch.tensor([float(value) for value in values], device=self.accelerator.device)
        return self.accelerator.gather(local.unsqueeze(0)).view(-1, len(values)).max(dim=0).values

    def log_completion_column(self, column: str, values: list) -> None:
        """Add a column to TRL's completions table (one value per row of this rank's batch)."""
        self._log_completion_extra(column, values)

    def reward_logging_kwargs(self) -> dict[str, Any]:
        """The logging keyword arguments TRL passes a reward function (``log_extra``, ``log_metric``)."""
        return {"log_extra": self._log_completion_extra, "log_metric": self._log_metric}

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

    def process_scored_batch(self, batch: dict[str, Any], inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """Transform this rank's scored generation batch (rewards and group advantages final) before TRL shuffles
        and splits it; the default keeps it. `ExtGRPOTrainer` documents the batch (`trl_ext.samples`)."""
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

    def _run_scored_batch_hook(self, batch: dict[str, Any], scope: BatchScope) -> dict[str, Any]:
        """Runs `process_scored_batch` on TRL's scored batch. Not a hook: `ExtGRPOTrainer` wraps the hook in its
        batch contract (`trl_ext.samples`) here; subclasses override `process_scored_batch`."""
        return self.process_scored_batch(batch, scope.inputs)

    # ---------------------------------------------------------------------------------------------- overrides
    def _generate_and_score_completions(self, inputs):
        self._generated_new_batch = True
        scope = self._batch_scope = self.batch_scope_class(inputs=inputs)
        try:
            self.on_batch_start(scope)
            batch = super()._generate_and_score_completions(inputs)
            return self._run_scored_batch_hook(batch, scope)
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

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        # Only TRL calls this (trl-ext calls the hook): inside a batch scope, its old/reference passes.
        if self._batch_scope is not None and self._batch_scope.replaces_rows:
            return input_ids.new_zeros((input_ids.size(0), logits_to_keep), dtype=torch.float32), None, None
        return self.per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

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


def _postprocessed(rollout_func: Any) -> Any:
    """TRL's ``rollout_func`` whose completions (and their log-probs) then go through the trainer's
    `TRLSeam.postprocess_samples`, as generated ones do (TRL calls the function in place of generation)."""

    @functools.wraps(rollout_func)
    def rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        output = dict(rollout_func(prompts, trainer))
        output["completion_ids"], output["logprobs"] = trainer.postprocess_samples(
            output["completion_ids"], output["logprobs"]
        )
        return output

    return rollout
