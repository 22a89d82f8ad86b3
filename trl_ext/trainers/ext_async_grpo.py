"""`ExtAsyncGRPOTrainer`: TRL's experimental asynchronous GRPO trainer with trl-ext's loss registry and monitors.

TRL's `AsyncGRPOTrainer` generates in a spawned rollout worker against ``vllm serve`` while it trains, drops
samples more than ``max_staleness`` policy versions old, takes the sampler's per-token log-probs as p_old and packs
each micro-batch into one prefix tree. Its loss is PPO-clip normalised by the window's tokens (``loss_type="dapo"``,
left untouched). For a loss trl-ext computes (``"ipo"``, or one registered with a ``compute`` function), this
trainer runs TRL's forward as TRL does (`AsyncSeam.tree_forward`) and hands the flat loss tokens, as ``(1, M)``
tensors, to the loss's pure function with TRL's normaliser. The TRL internals this needs are reached in one place,
`trl_ext.trainers.async_seam`, which also makes the trainer run on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import PartialState
from torch import Tensor

from ..losses import LossSpec, get_loss
from ..methods import METHODS
from .async_faults import watch_server
from .async_seam import AsyncSeam, TreeForward, fold_loss_weights, loss_weight_collator
from .async_worker import ThreadedRolloutWorker
from .ext_async_grpo_config import ExtAsyncGRPOConfig
from .weight_sync import choose_weight_transfer

__all__ = ["ExtAsyncGRPOTrainer", "policy_stat_sums", "version_lags"]


def policy_stat_sums(logps: Tensor, old_logps: Tensor, entropy: Tensor) -> dict[str, Tensor]:
    """The sums behind TRL's async ``ratio``, ``kl`` and ``entropy`` metrics, over ``M`` loss tokens.

    Args:
        logps, old_logps, entropy: ``(M,)`` current log-probs, the sampler's log-probs, the policy's entropy.

    Returns:
        0-dim sums: ``ratio`` (ρ = p / p_old), ``kl`` (the k3 estimate ``(ρ − 1) − log ρ``), ``entropy``, and
        ``count`` (M); divide each by the count summed over ranks.
    """
    with torch.no_grad():
        log_ratio = logps.detach() - old_logps
        ratio = log_ratio.exp()
        return {
            "ratio": ratio.sum(),
            "kl": ((ratio - 1) - log_ratio).sum(),
            "entropy": entropy.detach().sum(),
            "count": torch.tensor(float(logps.numel()), device=logps.device),
        }


def version_lags(sample_versions: Tensor, model_version: int, max_lag: int) -> Tensor:
    """Each token's version lag: ``model_version - sample_versions``, clamped to ``[0, max_lag]``.

    Args:
        sample_versions: ``(M,)`` the policy version that sampled each token (float, as collated).
        model_version: the version of the policy being trained.
        max_lag: the largest lag reported (older tokens count as ``max_lag``).

    Returns:
        ``(M,)`` int64 lags.
    """
    return (model_version - sample_versions.round().long()).clamp(0, max_lag)


class ExtAsyncGRPOTrainer(AsyncSeam):
    """`trl.experimental.async_grpo.AsyncGRPOTrainer` plus the loss registry of `trl_ext.losses` and the monitors.

    Use it like TRL's trainer (``model`` is a path or Hub id; reward functions must be picklable module-level
    functions, since TRL's rollout worker runs in a spawned process, so a script needs an ``if __name__ ==
    "__main__"`` guard); pass an [`ExtAsyncGRPOConfig`]. With ``loss_type="ipo"`` (or another loss trl-ext computes)
    it logs the loss's metrics as ``<loss>/<metric>`` (``ipo/masked_ratio``, ``ipo/capped_ratio``,
    ``ipo/ratio_mean``: token-weighted means over all ranks) and TRL's ``ratio``, ``kl`` and ``entropy``; TRL's
    ``clip_ratio/*`` belong to its PPO-clip loss and are not logged then.
    """

    model_card = METHODS["grpo"]

    def __init__(self, model: str, reward_funcs: Any = None, args: Any = None, *pargs: Any, **kwargs: Any) -> None:
        if args is None:
            args = ExtAsyncGRPOConfig(f"{model.rstrip('/').split('/')[-1]}-AsyncGRPO")
        loss_type = getattr(args, "loss_type", "dapo")
        if get_loss(loss_type).compute is not None and not isinstance(args, ExtAsyncGRPOConfig):
            raise TypeError(
                f"loss_type={loss_type!r} needs trl-ext's settings: pass args=trl_ext.ExtAsyncGRPOConfig(...)."
            )
        if kwargs.get("weight_transfer") is None and PartialState().is_main_process:
            # A full-weight model off CUDA has no NCCL: its weights go through vLLM's reload from disk instead.
            kwargs["weight_transfer"] = choose_weight_transfer(model, args, peft_config=kwargs.get("peft_config"))
        super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        # Monitors passed as callbacks= would run after the trackers; move them ahead so alerts reach wandb & co.
        from ..callbacks.monitors import MonitorCallback, add_monitors

        if any(isinstance(cb, MonitorCallback) for cb in self.callback_handler.callbacks):
            add_monitors(self)
        watch_server(self)  # a vllm serve that went away ends training with an error naming it
        self._gate_staleness()

    def _gate_staleness(self) -> None:
        """A trl-ext rollout worker starts a run only while its samples cannot go stale (`StalenessGate`): with the
        samples a version takes when batches hold a fixed count (``token_budget=0``), else measured by the worker."""
        worker = self.rollout_worker
        if not isinstance(worker, ThreadedRolloutWorker):
            return  # TRL's own worker bounds its runs with max_inflight_tasks
        args = self.args
        worker.staleness.max_staleness = args.max_staleness
        if not args.token_budget:
            worker.staleness.samples_per_version = (
                args.per_device_train_batch_size
                * args.gradient_accumulation_steps
                * self.accelerator.num_processes
                * args.weight_sync_steps
            )

    @property
    def loss_spec(self) -> LossSpec:
        """The registry entry (`trl_ext.losses.LOSSES`) of this trainer's ``loss_type`` (``"dapo"`` for a plain
        `AsyncGRPOConfig`)."""
        return get_loss(getattr(self.args, "loss_type", "dapo"))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss for ``"dapo"``; otherwise the registered loss on TRL's forward of the micro-batch.

        The loss gets the ``M`` loss tokens of this rank's row as ``(1, M)`` tensors: log p (the gradient), p_old =
        the sampler's log-probs, the advantages, an all-True mask, the batch's per-token ``loss_weights`` when it
        carries them (`trl_ext.trainers.async_seam.weights`; else none), and TRL's normaliser (the micro-batch's loss
        tokens per rank times the accumulation steps), whatever the spec's ``normalization``. TRL's own loss takes
        no weights: they are folded into its advantages (exact for its PPO-clip loss).
        """
        spec = self.loss_spec
        if spec.compute is None:
            return super().compute_loss(model, fold_loss_weights(inputs), return_outputs, num_items_in_batch)
        forward = self.tree_forward(model, inputs)
        logps = forward.logps.unsqueeze(0)
        loss, metrics = spec.compute(
            logps,
            forward.old_logps.to(logps.dtype).unsqueeze(0),
            forward.advantages.to(logps.dtype).unsqueeze(0),
            torch.ones_like(logps, dtype=torch.bool),
            normalizer=self.loss_normalizer(inputs),
            weights=None if forward.loss_weights is None else forward.loss_weights.to(logps.dtype).unsqueeze(0),
            **spec.settings_from(self.args),
        )
        loss = self.add_aux_loss(loss, forward)
        self._log_loss_metrics(spec, forward, metrics)
        self._log_trust_region_by_lag(spec, forward, logps)
        self.record_micro_batch(inputs, forward)
        return loss

    def get_train_dataloader(self):
        """TRL's dataloader, its collator adding each loss token's policy version (``sample_versions``, for the
        metrics by lag) and the samples' ``loss_weights`` when they carry them (`trl_ext.trainers.async_seam.weights`)."""
        with loss_weight_collator():
            return super().get_train_dataloader()

    def _log_trust_region_by_lag(self, spec: LossSpec, forward: TreeForward, logps: Tensor) -> None:
        """The loss's trust-region metric per version lag, ``<metric>/lag_<k>`` (e.g. ``ipo/masked_ratio/lag_2``):
        the loss recomputed without gradient over the tokens of each lag ``k`` = this policy's version minus the
        version that sampled them, 0 to ``max_staleness + 1`` (a micro-batch fetched ahead of a sync is one older).
        Token-weighted over all ranks; a lag with no token in the micro-batch on any rank is not logged."""
        metric = spec.trust_region_metric
        if forward.sample_versions is None or metric is None or not metric.startswith(f"{spec.name}/"):
            return
        key = metric.removeprefix(f"{spec.name}/")
        max_lag = self.args.max_staleness + 1
        lags = version_lags(forward.sample_versions, self.model_version, max_lag)
        settings = spec.settings_from(self.args)
        weights = None if forward.loss_weights is None else forward.loss_weights.to(logps.dtype).unsqueeze(0)
        sums = []
        with torch.no_grad():
            for lag in range(max_lag + 1):
                mask = (lags == lag).unsqueeze(0)
                if not mask.any():
                    sums += [0.0, 0.0]
                    continue
                _, lag_metrics = spec.compute(
                    logps.detach(),
                    forward.old_logps.to(logps.dtype).unsqueeze(0),
                    forward.advantages.to(logps.dtype).unsqueeze(0),
                    mask,
                    normalizer=torch.tensor(1.0),
                    weights=weights,
                    **settings,
                )
                tokens = lag_metrics["num_tokens"]
                sums += [lag_metrics[key] * tokens, tokens]
        totals = self.global_sums(*sums)
        for lag in range(max_lag + 1):
            tokens = totals[2 * lag + 1]
            if tokens > 0:
                self.log_metric(f"{metric}/lag_{lag}", (totals[2 * lag] / tokens).item())

    def _log_loss_metrics(self, spec: LossSpec, forward: TreeForward, metrics: dict[str, Tensor]) -> None:
        """TRL's ``ratio``/``kl``/``entropy`` and the loss's ``<name>/<metric>``, token-weighted over all ranks, in
        one collective."""
        stats = policy_stat_sums(forward.logps, forward.old_logps, forward.entropy)
        num_tokens = metrics.pop("num_tokens")
        names = list(metrics)
        totals = self.global_sums(
            stats["ratio"], stats["kl"], stats["entropy"], stats["count"], num_tokens,
            *(metrics[name] * num_tokens for name in names),
        )  # fmt: skip
        count, loss_tokens = totals[3].clamp(min=1.0), totals[4].clamp(min=1.0)
        for index, name in enumerate(("ratio", "kl", "entropy")):
            self.log_metric(name, (totals[index] / count).item())
        for index, name in enumerate(names, start=5):
            self.log_metric(f"{spec.name}/{name}", (totals[index] / loss_tokens).item())
