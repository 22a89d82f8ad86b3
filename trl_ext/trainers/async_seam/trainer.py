"""`AsyncSeam`: TRL's experimental `AsyncGRPOTrainer` with CPU support and the services a trl-ext trainer needs, so
that the trainer itself names nothing private of TRL's.

- ``model_card`` (an entry of `trl_ext.methods.METHODS`) gives TRL's model card its tags, name and paper.
- `tree_forward` runs TRL's forward of one collated micro-batch exactly as ``AsyncGRPOTrainer.compute_loss`` does
  (the padding-free row, tree-attention keywords, fused LM head) and returns the selected tokens' tensors.
- `record_micro_batch` adds the micro-batch to TRL's per-step accounting (tokens, samples, forward time), which TRL's
  ``compute_loss`` does and a loss computed by trl-ext must do too.
- `tokens_per_rank`, `loss_normalizer`, `log_metric`, `global_sums`, `mode`: TRL's normaliser, metric store and
  collectives.
- Faults and resuming (`faults`): a weight sync that cannot reach the server names it; TRL's own worker process, when it died, is named and reaped instead of hanging the
  run; a trl-ext worker's policy version counter is saved with each checkpoint and restored on resume.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import requests
import torch
from torch import Tensor
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import StepIntervalCallback
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

from .cpu import install_cpu_support
from .faults import guard_rollout_worker, restore_rollout_state, save_rollout_state
from .weights import LOSS_WEIGHTS_KEY, SAMPLE_VERSIONS_KEY, VersionTaggedQueue, stale_token_mask, without_tokens

__all__ = ["STALE_TOKENS_METRIC", "AsyncSeam", "OnDemandLoader", "TreeForward"]

STALE_TOKENS_METRIC = "sample/dropped_stale_tokens_total"  # loss tokens older than max_staleness when trained


class OnDemandLoader:
    """The training loader accelerate prepared, read without its one-batch look-ahead (one process).

    Accelerate's loaders fetch the next batch before they hand out the current one. The trainer takes an optimizer
    step's micro-batches when the step begins, so the look-ahead takes the first micro-batch of the *next* step from
    the rollout queue (and checks its staleness) before this step's weight sync: trained one version later than
    checked. Read on demand, a micro-batch is fetched when its step begins, after the sync before it, so the version
    TRL checks it against is the version that trains it. Everything else is the prepared loader's.
    """

    def __init__(self, loader: Any, device: torch.device) -> None:
        self.loader = loader
        self.device = device

    def __iter__(self):
        from accelerate.utils import send_to_device

        for batch in self.loader.base_dataloader:
            yield send_to_device(batch, self.device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


@dataclass
class TreeForward:
    """One micro-batch's forward, over its ``M`` loss tokens (the collator's flat selection, in its order).

    Attributes:
        logps: ``(M,)`` log p of each loss token under the current policy (carries the gradient).
        entropy: ``(M,)`` entropy of the policy at each loss token's position.
        old_logps: ``(M,)`` the sampler's log-probs (vLLM's, at sampling time): p_old.
        advantages: ``(M,)`` the advantage of each token's completion.
        segment_id: ``(M,)`` the index of each token's completion in this rank's row.
        loss_weights: ``(M,)`` per-token loss weights when the batch carries them (`weights.LossWeightCollator`),
            else None.
        sample_versions: ``(M,)`` the policy version that sampled each token when the batch carries them
            (`weights.LossWeightCollator`), else None.
        aux_loss: the MoE load-balancing loss of the forward, or None when TRL does not add it.
        seconds: how long the forward took (TRL's ``perf/fwd_s``).
    """

    logps: Tensor
    entropy: Tensor
    old_logps: Tensor
    advantages: Tensor
    segment_id: Tensor
    aux_loss: Tensor | None
    seconds: float
    loss_weights: Tensor | None = None
    sample_versions: Tensor | None = None


class AsyncSeam(AsyncGRPOTrainer):
    """`trl.experimental.async_grpo.AsyncGRPOTrainer`, trained on the CPU too, with trl-ext's services (see the
    module docstring). A subclass names its model card's method with ``model_card``."""

    model_card: ClassVar[Any] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        card = cls.__dict__.get("model_card")
        if card is not None:  # TRL's model card (create_model_card, push_to_hub) reads these class attributes
            cls._tag_names = list(dict.fromkeys([*AsyncGRPOTrainer._tag_names, *card.tag_names]))
            cls._name = f"Async {card.name}"
            cls._paper = card.paper

    def __init__(self, model: str, reward_funcs: Any = None, args: Any = None, *pargs: Any, **kwargs: Any) -> None:
        if args is not None and args.device.type != "cuda":
            install_cpu_support()  # before TRL's __init__, which looks up the device's peak FLOPs
        super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        guard_rollout_worker(self.rollout_worker)  # a dead worker process: its exit named, no hang on stop
        if self.rollout_queue is not None:  # each sample's policy version rides to the loss (`weights`)
            self.rollout_queue = VersionTaggedQueue(self.rollout_queue)

    def add_callback(self, callback: Any) -> None:
        """transformers' ``add_callback``, except for TRL's `StepIntervalCallback`: TRL adds one per periodic task
        (the weight sync, the step metrics), and transformers would print a duplicate-callback notice for the second
        at every construction. A real duplicate of any other callback still gets the notice."""
        if isinstance(callback, StepIntervalCallback):
            self.callback_handler.callbacks.append(callback)
            return
        super().add_callback(callback)

    def _sync_weight(self):
        try:
            return super()._sync_weight()
        except Exception as error:  # TRL's messages (e.g. "Request failed: 500, ...") name neither server nor fix
            url = getattr(self.args, "vllm_server_base_url", None)
            if not url or not getattr(self.weight_transfer, "uses_server", True):
                raise
            cause = f"({type(error).__name__}: {error})"
            fix = "Restart `vllm serve`, then resume from the last checkpoint (resume_from_checkpoint=True)."
            if isinstance(error, requests.ConnectionError):
                raise ConnectionError(
                    f"The weight sync could not reach the vLLM server at {url} {cause}. {fix}"
                ) from error
            raise RuntimeError(
                f"The weight sync to the vLLM server at {url} failed {cause}. If the server stopped or restarted: "
                f"{fix}"
            ) from error

    # ---------------------------------------------------------------------------------------------- resuming
    def _save_checkpoint(self, model, trial):
        worker = self.rollout_worker
        if self.accelerator.is_main_process and worker is not None and not isinstance(worker, AsyncRolloutWorker):
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            resume_state = getattr(worker, "resume_state", None)  # a RolloutWorker's dataset position
            worker_state = resume_state(self._trained_groups) if callable(resume_state) else None
            save_rollout_state(folder, self.model_version, worker_state)  # TRL saves it for its own worker only
        super()._save_checkpoint(model, trial)

    def _inner_training_loop(self, *args, **kwargs):
        worker, checkpoint = self.rollout_worker, kwargs.get("resume_from_checkpoint")
        if checkpoint and worker is not None and not isinstance(worker, AsyncRolloutWorker):
            state = restore_rollout_state(checkpoint)
            if state is not None:  # adapters keep counting: a running server still holds the earlier names
                self.model_version = state["model_version"]
                worker.update_model_version(self.model_version)
                if "rows" in state and callable(getattr(worker, "restore_state", None)):
                    worker.restore_state(state)  # the prompts continue where the trained ones end
        return super()._inner_training_loop(*args, **kwargs)

    # ---------------------------------------------------------------------------------------------- staleness
    def get_train_dataloader(self):
        """TRL's training loader; on one process read on demand (`OnDemandLoader`), so a micro-batch's staleness is
        checked against the version that trains it."""
        loader = super().get_train_dataloader()
        if self.accelerator.num_processes == 1 and getattr(loader, "base_dataloader", None) is not None:
            return OnDemandLoader(loader, self.accelerator.device)
        return loader

    def drop_stale_tokens(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """``inputs`` without the loss tokens sampled more than ``max_staleness`` versions before the policy being
        trained (`weights.without_tokens`), counted in `STALE_TOKENS_METRIC`; ``inputs`` itself when there are none
        on any rank. On one process `OnDemandLoader` fetches none; with several, accelerate's dispatcher reads one
        micro-batch ahead, and the one it fetched before a sync is trained a version later than TRL checked it. Every
        rank must call it (one collective)."""
        stale = stale_token_mask(inputs, self.model_version, self.args.max_staleness)
        if stale is None:
            return inputs
        dropped = float(self.global_sums(stale.sum())[0])  # each rank holds its own row of the micro-batch
        if dropped == 0:
            return inputs
        self.log_metric(STALE_TOKENS_METRIC, dropped)
        return without_tokens(inputs, stale, dropped)

    # ---------------------------------------------------------------------------------------------- services
    @property
    def mode(self) -> str:
        """``"train"`` or ``"eval"``: which of TRL's metric series the current pass logs to."""
        return "train" if self.model.training else "eval"

    @property
    def accumulation_steps(self) -> int:
        """The micro-batches of the current optimizer step (transformers sets it in its loop; outside it, the
        configured ``gradient_accumulation_steps``)."""
        return getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)

    def log_metric(self, name: str, value: float) -> None:
        """Log ``value`` under ``name`` in the current mode; TRL reduces a log window's values (a mean, or a sum /
        max / min when the name's last part has the word ``total`` / ``max`` / ``min``)."""
        self._metrics[self.mode][name].append(float(value))

    def global_sums(self, *values: float | Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
        """``(len(values),)`` sums of each value over all ranks, in one collective (every rank must call it)."""
        local = torch.stack([torch.as_tensor(value).detach().to(self.accelerator.device, dtype) for value in values])
        return self.accelerator.reduce(local, reduction="sum")

    def tokens_per_rank(self, inputs: dict[str, Tensor]) -> Tensor:
        """The micro-batch's loss tokens per rank (all ranks' count over the ranks, at least 1), float32: TRL's first
        divisor of its summed PPO-clip loss, which then divides by the accumulation steps."""
        return (inputs["global_n_tokens"][0] / self.accelerator.num_processes).clamp(min=1.0).to(torch.float32)

    def loss_normalizer(self, inputs: dict[str, Tensor]) -> Tensor:
        """TRL's normaliser of a summed per-token loss: `tokens_per_rank` times the micro-batches of the optimizer
        step. DDP then averages the gradients over ranks, so every loss token of the step weighs the same."""
        return self.tokens_per_rank(inputs) * self.accumulation_steps

    def tree_forward(self, model: torch.nn.Module, inputs: dict[str, Tensor]) -> TreeForward:
        """TRL's forward of one collated micro-batch (``AsyncGRPOTrainer.compute_loss``'s): this rank's row without
        its inter-rank padding, as one ``(1, N)`` sequence through tree attention and the fused LM head."""
        mask_bool = inputs["attention_mask"].bool()
        selected = inputs["token_index"] >= 0
        tree_kwargs = {
            key: inputs[key][inputs[key] >= 0] for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")
        }
        tree_kwargs["tree_max_seqlen_q"], tree_kwargs["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
        token_index = inputs["token_index"][selected]
        start = time.time()
        router_kwargs = {"output_router_logits": True} if self.aux_loss_enabled else {}
        outputs = model(
            input_ids=inputs["input_ids"][mask_bool].unsqueeze(0),
            position_ids=inputs["position_ids"][mask_bool].unsqueeze(0),
            shift_labels=inputs["shift_labels"][mask_bool].unsqueeze(0),
            fused_lm_head=True,
            **router_kwargs,
            **tree_kwargs,
        )
        return TreeForward(
            logps=outputs.log_probs.flatten()[token_index],
            entropy=outputs.entropy.flatten()[token_index],
            old_logps=inputs["old_log_probs"][selected],
            advantages=inputs["advantages"][selected],
            segment_id=inputs["segment_id"][selected],
            aux_loss=outputs.aux_loss if self.aux_loss_enabled else None,
            seconds=time.time() - start,
            loss_weights=inputs[LOSS_WEIGHTS_KEY][selected] if LOSS_WEIGHTS_KEY in inputs else None,
            sample_versions=inputs[SAMPLE_VERSIONS_KEY][selected] if SAMPLE_VERSIONS_KEY in inputs else None,
        )

    def add_aux_loss(self, loss: Tensor, forward: TreeForward) -> Tensor:
        """``loss`` plus TRL's weighted MoE load-balancing loss (scaled for accumulation), logged as ``aux_loss``
        as TRL does; ``loss`` unchanged when TRL adds none."""
        if forward.aux_loss is None:
            return loss
        world_size = self.accelerator.num_processes
        self.log_metric("aux_loss", (self.global_sums(forward.aux_loss, dtype=torch.float32)[0] / world_size).item())
        return loss + self.router_aux_loss_coef * forward.aux_loss / self.accumulation_steps

    def record_micro_batch(self, inputs: dict[str, Tensor], forward: TreeForward) -> None:
        """Add this micro-batch to TRL's per-step accounting (flushed at each optimizer step as ``perf/*`` and
        ``batch/*_per_step``), as TRL's ``compute_loss`` does."""
        n_forward_tokens = float(inputs["global_n_forward_tokens"][0])
        mean_seq_len = float(inputs["mean_seq_len"][0])
        self._last_forward_time_s = forward.seconds
        self._step_forward_tokens += n_forward_tokens
        self._step_trained_tokens += float(inputs["global_n_tokens"][0])
        self._step_seq_len_weighted += mean_seq_len * n_forward_tokens
        self._step_samples += n_forward_tokens / mean_seq_len
        self._step_forward_s += forward.seconds
