"""`ExtGRPOTrainer`: TRL's GRPOTrainer with the loss registry, per-token advantages and a row-changing hook.

Everything TRL does (generation with transformers or vLLM, LoRA, Accelerate, reward functions, logging) is left to
`trl.GRPOTrainer`; the TRL internals this builds on are reached in one place, `trl_seam`. This subclass is glue:

1. ``loss_type`` picks a loss from the registry of `trl_ext.losses` (TRL's own, or ``"ipo"``: the
   probability-difference trust region of docs/ipo_loss.md).
2. `process_scored_batch`, the one hook on the scored generation batch, runs inside the batch contract of
   `trl_ext.samples` (`ScoredBatch`): a subclass may replace the ``(B,)`` advantages by ``(B, T)`` per-token
   ones, attach per-token loss weights, or change the rows (split rollouts into turns); rows are then padded (with
   zero-loss copies) so that none is dropped and every rank holds the same count, and ``num_items_in_batch`` is
   recomputed from the final masks.
3. Shared-prefix packing of the log-prob passes (docs/packing.md; its policy is `trl_ext.packing`'s), the prompt
   cap (`trl_ext.trainers.prompt_cap`) and resuming inside a generation batch.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import random
from typing import Any

import torch
from trl import GRPOConfig
from trl.trainer.utils import nanmax, nanmin, split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from ..callback_order import put_before_loggers_where_asked
from ..checkpoints import checkpoint_step, required_checkpoint_files, resolve_resume_checkpoint
from ..losses import LossSpec, folded_advantages, get_loss, sampling_mismatch
from ..methods import METHODS
from ..packing import (
    Packing,
    group_micro_batches,
    pack_rows,
    packed_logps_and_entropies,
    packing_obstacle,
    rows_from_padded,
    worth_packing,
)
from ..samples import check_scored_batch, loss_mask, pad_batch, padding_rows
from .ext_grpo_config import ExtGRPOConfig
from .learning_signal import LearningSignalWatch
from .prompt_cap import cap_prompt_ids, prompt_cap
from .trl_seam import FORWARD_KEYS, BatchScope, TRLSeam

logger = logging.getLogger(__name__)
# The arguments of a log-prob pass, declared once by the seam; the packed override reads them by name.
_PASS_SIGNATURE = inspect.signature(TRLSeam.per_token_logps_and_entropies)


@contextlib.contextmanager
def _vllm_dtype(dtype: str):
    """While TRL builds its colocated engine, give ``vllm.LLM`` our dtype (TRL 1.16 has no setting for it)."""
    if dtype == "auto":
        yield
        return
    from trl.generation import vllm_generation

    original = getattr(vllm_generation, "LLM", None)
    if original is None:  # vLLM is not installed: TRL will say so if it is needed
        yield
        return
    vllm_generation.LLM = functools.partial(original, dtype=dtype)
    try:
        yield
    finally:
        vllm_generation.LLM = original


class ExtGRPOTrainer(TRLSeam):
    """`trl.GRPOTrainer` plus the IPO loss, per-token advantages and the `process_scored_batch` hook.

    Use it exactly like `GRPOTrainer`; pass an [`ExtGRPOConfig`] (a plain `GRPOConfig` works for TRL's loss types).
    Metrics added under the IPO loss: ``ipo/masked_ratio``, ``ipo/capped_ratio``, ``ipo/ratio_mean``. When a
    subclass changes the row count, ``batch/padding_rows`` counts the zero-loss rows added (all ranks).
    """

    model_card = METHODS["grpo"]
    # The metrics that count the padding rows of a generation batch (all ranks).
    padding_metrics: tuple[str, ...] = ("batch/padding_rows",)
    # The method a subclass drives (`trl_ext.rollouts.RolloutMethod`: its records); none for plain GRPO.
    method: Any = None

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *pargs, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            args = ExtGRPOConfig(f"{name.rstrip('/').split('/')[-1]}-GRPO")
        if get_loss(args.loss_type).compute is not None and not isinstance(args, ExtGRPOConfig):
            raise TypeError(
                f"loss_type={args.loss_type!r} needs trl-ext's settings: pass args=trl_ext.ExtGRPOConfig(...)."
            )
        with _vllm_dtype(getattr(args, "vllm_dtype", "auto")):
            super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        put_before_loggers_where_asked(self)  # monitors passed as callbacks= ahead of the trackers: alerts reach them
        self._packing_notes: set[str] = set()  # the reasons packing was skipped, each logged once
        self._packing_verified: bool | None = None  # the first packed pass is checked against TRL's rows
        self.max_prompt_length = prompt_cap(getattr(args, "max_prompt_length", None), self.model, args)
        self._prompt_cap_warned = False
        self._draws: dict[str, tuple[tuple[str, int], int]] = {}  # purpose -> ((mode, global step), batches drawn)
        self.learning_signal = LearningSignalWatch()  # warns when every advantage has been 0 for several steps
        self.add_callback(self.learning_signal)

    # ------------------------------------------------------------------------------------------------------------
    # Resuming
    # ------------------------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`transformers.Trainer.train`, with three things added for runs that resume after a crash or a kill:

        - ``resume_from_checkpoint=True`` takes the latest *complete* checkpoint: one left half-written by a kill or
          a full disk is skipped with a warning naming it (`trl_ext.checkpoints.resolve_resume_checkpoint`); a path
          to an incomplete checkpoint fails with what is missing.
        - The per-step records this trainer writes next to the checkpoints (rollout trees, the judge audit log) are
          cut back to the step training starts from (`discard_records_after`), so the steps the run does again
          replace their records instead of duplicating them.
        - A checkpoint saved inside a generation batch (``num_iterations > 1``) holds that batch, and training goes
          on with it (`restore_generation_buffer`) instead of generating a new one.
        """
        checkpoint = resolve_resume_checkpoint(
            resume_from_checkpoint, self.args.output_dir, required_checkpoint_files(self.args)
        )
        self.discard_records_after(checkpoint_step(checkpoint) if checkpoint else 0)
        if checkpoint:
            self.restore_generation_buffer(checkpoint)
        return super().train(checkpoint, *args, **kwargs)

    def discard_records_after(self, step: int) -> None:
        """Drop what this rank recorded for the steps after ``step``, the step `train` starts from (0 for a new run):
        the method's records (`trl_ext.rollouts.RolloutMethod.discard_records_after`: the judge's audit lines, the
        rollout-tree files), which the resumed run writes again."""
        if self.method is not None:
            self.method.discard_records_after(step, f"rank{self.accelerator.process_index}")

    @property
    def loss_spec(self) -> LossSpec:
        """The registry entry (`trl_ext.losses.LOSSES`) of this trainer's ``loss_type``."""
        return get_loss(self.loss_type)

    def batch_random_key(self, purpose: str) -> str:
        """The seed of this generation batch's draws for ``purpose``: a function of the run's seed, the rank, the
        mode, the global step and how many batches drew for ``purpose`` at this step before, so a resumed run draws
        what the uninterrupted run would have, without a generator state to checkpoint. The trainer's own draws come
        from generators seeded with it, never from the global random stream TRL samples from."""
        mode, step = self.mode, self.state.global_step
        key, count = self._draws.get(purpose, ((mode, -1), 0))
        count = count + 1 if key == (mode, step) else 0
        self._draws[purpose] = ((mode, step), count)
        return f"trl-ext/{purpose}/{self.args.seed}/{self.accelerator.process_index}/{mode}/{step}/{count}"

    # ------------------------------------------------------------------------------------------------------------
    # Prompt cap
    # ------------------------------------------------------------------------------------------------------------
    def limit_prompt_ids(self, prompt_ids: list, multimodal: bool) -> list:
        """Cut prompts longer than ``max_prompt_length`` from the left; log ``prompts/truncated_ratio`` (all ranks).

        A prompt with images cannot be cut (its image tokens would no longer match the pixels): the run stops with
        the row's length and the fix, on every rank.
        """
        cap = self.max_prompt_length
        if cap is None:
            return prompt_ids
        capped, long = cap_prompt_ids(prompt_ids, cap)
        sums = self.global_sums(len(long), len(prompt_ids), len(long) if multimodal else 0)
        num_long, num_prompts, num_uncuttable = sums.tolist()
        if num_uncuttable:
            raise ValueError(
                f"{int(num_uncuttable)} prompt(s) with images are longer than max_prompt_length={cap} tokens "
                f"(e.g. {len(prompt_ids[long[0]]) if long and multimodal else 'on another rank'} tokens) and cannot "
                "be cut without breaking their images: drop the long rows from the dataset, or raise "
                "max_prompt_length (the model's positions minus max_completion_length at most)."
            )
        self.log_metric("prompts/truncated_ratio", num_long / num_prompts)
        if long and not self._prompt_cap_warned:
            self._prompt_cap_warned = True
            logger.warning(
                "%d prompt(s) of this batch are longer than max_prompt_length=%d tokens (the longest: %d) and were "
                "cut from the left; prompts/truncated_ratio counts them. Raise max_prompt_length or shorten the "
                "prompts. (Warned once.)",
                len(long),
                cap,
                max(len(prompt_ids[index]) for index in long),
            )
        return capped

    # ------------------------------------------------------------------------------------------------------------
    # The batch contract around the hook (trl_ext.samples)
    # ------------------------------------------------------------------------------------------------------------
    def _run_scored_batch_hook(self, batch: dict[str, Any], scope: BatchScope) -> dict[str, Any]:
        batch["rewards"] = self._local_rewards(scope, len(scope.inputs))
        # Image fields per row (TRL's own split: flat pixel_values by image_grid_thw, image_sizes, several images a
        # row...), so that the hook and the padding index every value by row; joined back at the end, as TRL keeps
        # them.
        batch = split_pixel_values_by_grid(batch)
        rows = batch["completion_ids"]
        batch = self.process_scored_batch(batch, scope.inputs)
        same_rows = batch["completion_ids"] is rows
        if not same_rows:
            self._relog_sampling_metrics(batch)
        if batch.get("prefix_group") is None:
            # TRL's rows come in groups of num_generations completions of one prompt; changed rows name their own.
            num_rows = len(batch["completion_ids"])
            group_size = self.num_generations if same_rows else 1
            batch["prefix_group"] = torch.arange(num_rows, device=rows.device) // group_size
        return unsplit_pixel_values_by_grid(self._pad_rows(batch))

    def _relog_sampling_metrics(self, batch: dict[str, Any]) -> None:
        """TRL logged the sampler-vs-policy metrics of the rows it built; the hook replaced them: log the new ones.

        Every rank calls this (the gathers below are collective): the hook replaces rows on all ranks or none.
        """
        sampling, old = batch.get("sampling_per_token_logps"), batch.get("old_per_token_logps")
        is_ratio = batch.get("importance_sampling_ratio")
        if not (self.use_vllm and self.vllm_importance_sampling_correction) or sampling is None or old is None:
            return
        if is_ratio is None:
            is_ratio = torch.ones_like(old)
        stats = sampling_mismatch(old, sampling, loss_mask(batch), is_ratio)
        gather = self.accelerator.gather
        values = {
            "sampling/sampling_logp_difference/mean": gather(stats["logp_diff_mean"]).mean(),
            "sampling/sampling_logp_difference/max": gather(stats["logp_diff_max"]).max(),
            "sampling/importance_sampling_ratio/min": nanmin(gather(stats["is_ratio_min"])),
            "sampling/importance_sampling_ratio/mean": gather(stats["is_ratio_mean"]).nanmean(),
            "sampling/importance_sampling_ratio/max": nanmax(gather(stats["is_ratio_max"])),
        }
        for name, value in values.items():
            self.relog_metric(name, value.item())

    def _local_rewards(self, scope: BatchScope, num_local: int) -> torch.Tensor:
        """This rank's rows of the weighted total reward TRL just computed, ``(B,)``; NaN where unscorable."""
        start = self.accelerator.process_index * num_local
        local = scope.rewards_per_func[start : start + num_local]
        total = (local * self.reward_weights.to(local.device).unsqueeze(0)).nansum(dim=1)
        total[torch.isnan(local).all(dim=1)] = float("nan")
        return total

    def _pad_rows(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Check the batch, pad its rows (no row dropped, equal counts on all ranks), recompute token counts."""
        num_rows = check_scored_batch(batch)
        num_micro_batches = self.args.steps_per_generation if self.mode == "train" else 1
        num_padding = padding_rows(num_rows, int(self.global_max(num_rows).item()), num_micro_batches)
        if num_padding:
            if self.entropy_bonus_enabled and self.loss_spec.normalization == "rows":
                raise ValueError(
                    f"Padding rows with loss_type={self.loss_type!r} and TRL's entropy bonus would rescale the "
                    "bonus: set entropy_coef=0.0 (and use_adaptive_entropy=False), or use a token-normalised loss "
                    "(loss_type='dapo', 'bnpo' or 'ipo')."
                )
            batch = pad_batch(batch, num_rows, num_padding)
        padding = torch.zeros(num_rows + num_padding, dtype=torch.bool, device=batch["completion_mask"].device)
        padding[num_rows:] = True
        batch["is_padding_row"] = padding
        batch["num_items_in_batch"] = self.accelerator.gather(loss_mask(batch).sum()).sum()
        total_padding = self.global_sums(num_padding)[0].item()
        for name in self.padding_metrics:
            self.log_metric(name, total_padding)
        return batch

    # ------------------------------------------------------------------------------------------------------------
    # Shared-prefix packing (docs/packing.md)
    # ------------------------------------------------------------------------------------------------------------
    def per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """The seam's log-prob pass (same arguments: ``args``/``kwargs`` are its ``batch_size``,
        ``compute_entropy``, ``compute_aux_loss`` and TRL's forward keywords), shared-prefix packed where
        `_plan_packing` finds it worth it, else TRL's forward."""
        options = _PASS_SIGNATURE.bind(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        options.apply_defaults()
        compute_entropy, compute_aux_loss = options.arguments["compute_entropy"], options.arguments["compute_aux_loss"]
        if self._packing_mode() != "off" and not torch.is_grad_enabled():
            # Without gradients, run the bare model on either path: the packed path's forward count may differ
            # between ranks, and a DDP forward (even without gradients) broadcasts buffers, a collective. With
            # gradients both paths run exactly one forward of the wrapped model, as TRL does.
            model = _without_ddp(model)
        forward_kwargs = options.arguments["forward_kwargs"]
        packing = self._plan_packing(
            model, input_ids, attention_mask, logits_to_keep, compute_aux_loss, forward_kwargs
        )
        if packing is None:
            return super().per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        logps, entropies = self._packed_pass(model, packing, compute_entropy)
        return logps, entropies, None

    def arrange_micro_batches(self, micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each prefix group in one micro-batch, so that its rows can share their prefix, but only where a training
        pass is then packed: otherwise TRL's split is kept, and losses and gradients add up in TRL's order (with
        TRL's settings, bit for bit `GRPOTrainer`'s run)."""
        if self._packing_mode() == "off" or self._packing_verified is False:
            return micro_batches
        forward_kwargs = {key: micro_batches[0].get(key) for key in FORWARD_KEYS}
        if self._packing_obstacle(self.model, self.aux_loss_enabled, forward_kwargs) is not None:
            return micro_batches  # e.g. image tensors, which are not indexed by row: TRL's rows, TRL's split
        seed = random.Random(self.batch_random_key("micro-batches")).getrandbits(63)
        generator = torch.Generator().manual_seed(seed)
        arranged = group_micro_batches(micro_batches, generator=generator)
        return arranged if any(self._packs_training_pass(batch) for batch in arranged) else micro_batches

    def _packs_training_pass(self, batch: dict[str, Any]) -> bool:
        """Whether the training forward of micro-batch ``batch`` is worth packing (`_plan_packing`'s layout test)."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        logits_to_keep = batch["completion_ids"].size(1)
        rows = rows_from_padded(input_ids, attention_mask, logits_to_keep)
        return rows is not None and self._worth_packing(rows, input_ids.numel(), logits_to_keep) is not None

    def _packing_mode(self) -> str:
        return getattr(self.args, "prefix_sharing", "off")  # a plain GRPOConfig: TRL's rows

    def _packed_pass(self, model, packing: Packing, compute_entropy: bool):
        return packed_logps_and_entropies(
            model,
            packing,
            compute_entropy,
            _attention_implementation(model),
            autocast=self.accelerator.autocast,
            max_forward_tokens=self.args.max_packed_tokens,
        )

    def _plan_packing(self, model, input_ids, attention_mask, logits_to_keep, compute_aux_loss, forward_kwargs):
        """The packed layout of this log-prob pass, or None for TRL's rows (why: logged once)."""
        if self._packing_mode() == "off" or self._packing_verified is False:
            return None
        obstacle = self._packing_obstacle(model, compute_aux_loss, forward_kwargs)
        if obstacle is not None:
            return self._skip_packing(obstacle)
        rows = rows_from_padded(input_ids, attention_mask, logits_to_keep)
        if rows is None:
            return self._skip_packing("the rows are not padded as TRL pads them (left prompts, right completions)")
        packing = self._worth_packing(rows, input_ids.numel(), logits_to_keep)
        if packing is None:
            return None
        if self._packing_verified is None and not self._verify_packing(
            model, input_ids, attention_mask, logits_to_keep, packing
        ):
            return None
        self.log_metric("packing/token_ratio", packing.packed_tokens / input_ids.numel())
        return packing

    def _packing_obstacle(self, model, compute_aux_loss: bool, forward_kwargs: dict[str, Any]) -> str | None:
        return packing_obstacle(
            multimodal=any(value is not None for value in forward_kwargs.values()),
            router_loss=compute_aux_loss,
            sharded=self.is_fsdp_enabled or self.is_deepspeed_enabled,
            attention=_attention_implementation(model),
        )

    def _worth_packing(self, rows, padded_tokens: int, logits_to_keep: int) -> Packing | None:
        """The packed layout of `rows_from_padded`'s ``rows``, or None where `prefix_sharing` does not pack it."""
        packing = pack_rows(*rows, completion_length=logits_to_keep, max_packed_tokens=self.args.max_packed_tokens)
        return packing if worth_packing(self._packing_mode(), padded_tokens, packing.packed_tokens) else None

    @torch.no_grad()
    def _verify_packing(self, model, input_ids, attention_mask, logits_to_keep, packing: Packing) -> bool:
        """Once per run: the packed log-probs of this pass must match TRL's rows, else packing stays off."""
        bare = _without_ddp(model)
        rows = super().per_token_logps_and_entropies(bare, input_ids, attention_mask, logits_to_keep)[0]
        packed = self._packed_pass(bare, packing, compute_entropy=False)[0]
        mask = attention_mask[:, -logits_to_keep:].bool()
        difference = (rows - packed).abs()[mask].mean().item() if mask.any() else 0.0
        dtype = next(p.dtype for p in bare.parameters() if p.is_floating_point())
        tolerance = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
        self._packing_verified = bool(difference <= tolerance)  # NaN fails too
        if not self._packing_verified:
            self._skip_packing(
                f"the packed log-probs differ from the rows' by {difference:.3g} on average (tolerance {tolerance:g}): "
                "this model does not honour a custom attention mask and position ids"
            )
        return self._packing_verified

    def _skip_packing(self, reason: str) -> None:
        if reason not in self._packing_notes:
            self._packing_notes.add(reason)
            logger.warning("Shared-prefix packing is off for these passes: %s. Training uses TRL's rows.", reason)
        return None

    # ------------------------------------------------------------------------------------------------------------
    # Loss
    # ------------------------------------------------------------------------------------------------------------
    def _watch_learning_signal(self, inputs: dict[str, Any]) -> None:
        """Tell `learning_signal` whether any loss token of the training micro-batch (all ranks) has a non-zero
        advantage (times its loss weight, when the batch carries weights). One collective: every rank calls it."""
        if self.mode != "train":
            return
        mask = loss_mask(inputs).bool()
        signal = _fold_loss_weights(inputs)["advantages"]
        signal = signal.expand(mask.shape) if signal.dim() == 2 else signal.unsqueeze(1).expand(mask.shape)
        self.learning_signal.saw(float(self.global_sums(((signal != 0) & mask).sum())[0]) > 0)

    def compute_policy_loss(self, model, inputs):
        self._watch_learning_signal(inputs)
        if self.loss_spec.compute is not None:
            return self._compute_registered_loss(model, inputs)
        loss = super().compute_policy_loss(model, _fold_loss_weights(inputs))
        padding = inputs.get("is_padding_row")
        if self.loss_spec.normalization == "rows" and padding is not None and padding.any():
            # TRL averages these losses over rows; padding rows add 0 but count, so undo their dilution.
            real_rows = (~padding).sum().clamp(min=1)
            loss = loss * (padding.numel() / real_rows)
        return loss

    def _compute_registered_loss(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        """A trl-ext loss of the registry on TRL's batch: log-probs from TRL's forward, the loss from the spec's pure
        function with ``loss_weights`` on each token's whole loss, normalised like ``dapo``."""
        mode = self.mode
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        mask = loss_mask(inputs)

        per_token_logps, entropies, aux_loss = self.per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in FORWARD_KEYS},
        )

        # p_old: the generator's own log-probs (vLLM) when present, else TRL's old log-probs, else on-policy.
        old_logps = inputs.get("sampling_per_token_logps")
        if old_logps is None:
            old_logps = inputs.get("old_per_token_logps")
        if old_logps is None:
            old_logps = per_token_logps.detach()

        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        trained = mask
        if self.top_entropy_quantile < 1.0:
            trained = trained * self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        if self.off_policy_mask_threshold is not None:
            trained = trained * self.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=per_token_logps,
                sampling_per_token_logps=old_logps,
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )

        # Normalise by the loss tokens of one accumulation window on all ranks, exactly as TRL's "dapo".
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        weights = inputs.get("loss_weights")
        spec = self.loss_spec
        loss, metrics = spec.compute(
            per_token_logps,
            old_logps,
            advantages,
            trained,
            normalizer=normalizer,
            weights=weights,
            **spec.settings_from(self.args),
        )

        if self.beta != 0.0:
            ref_logps = inputs["ref_per_token_logps"]
            per_token_kl = torch.exp(ref_logps - per_token_logps) - (ref_logps - per_token_logps) - 1
            if self.args.use_bias_correction_kl:
                per_token_kl = per_token_kl * torch.exp(per_token_logps - old_logps).nan_to_num(0.0)
            # β·KL to the reference stays a plain token average for every loss type (TRL's fold the weights into
            # the advantages, which leaves it unweighted too): a regulariser, not part of the weighted objective.
            loss = loss + self.beta * (per_token_kl * mask).sum() / normalizer
            self.log_metric("kl", self._global_mean((per_token_kl * mask).sum(), mask.sum()))
        if self.aux_loss_enabled:
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self.log_metric("aux_loss", self.accelerator.gather_for_metrics(aux_loss).mean().item())

        self.log_metric("entropy", self._global_mean((entropies * mask).sum(), mask.sum()))
        num_tokens = metrics.pop("num_tokens")
        for name, value in metrics.items():
            self.log_metric(f"{spec.name}/{name}", self._global_mean(value * num_tokens, num_tokens))
        return loss

    def _global_mean(self, local_sum: torch.Tensor, local_count: torch.Tensor) -> float:
        totals = self.global_sums(local_sum, local_count, dtype=torch.float32)
        return (totals[0] / totals[1].clamp(min=1.0)).item()


def _without_ddp(model):
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _attention_implementation(model) -> str | None:
    config = getattr(_without_ddp(model), "config", None)
    return getattr(config, "_attn_implementation", None)


def _fold_loss_weights(inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` with the advantages times ``loss_weights`` (B, T) (`folded_advantages`: TRL's loss types are linear
    in A); ``inputs`` itself without weights."""
    weights = inputs.get("loss_weights")
    return inputs if weights is None else {**inputs, "advantages": folded_advantages(inputs["advantages"], weights)}
