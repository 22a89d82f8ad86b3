"""`ExtAsyncGRPOTrainer`: TRL's experimental asynchronous GRPO trainer with trl-ext's loss registry and monitors.

TRL's `AsyncGRPOTrainer` generates in a spawned rollout worker against ``vllm serve`` while it trains, drops
samples more than ``max_staleness`` policy versions old, takes the sampler's per-token log-probs as p_old and packs
each micro-batch into one prefix tree. Its loss is PPO-clip normalised by the window's tokens (``loss_type="dapo"``):
trl-ext computes it op for op as TRL does (`trl_ext.losses.ppo_clip_loss`: the same loss, gradients and metrics,
tested), so that it can also log the clip rate by version lag. For a loss trl-ext computes (``"ipo"``, or one
registered with a ``compute`` function), this trainer runs TRL's forward as TRL does (`AsyncSeam.tree_forward`) and
hands the flat loss tokens, as ``(1, M)`` tensors, to the loss's pure function with TRL's normaliser. Given a
``generator=`` (`LocalPolicy`, no server) it samples plain GRPO groups with trl-ext's `RolloutWorker`. The loss
never trains a token more than ``max_staleness`` versions old (`AsyncSeam.drop_stale_tokens`, `OnDemandLoader`).
The TRL internals this needs are reached in one place, `trl_ext.trainers.async_seam`, which also makes the trainer
run on the CPU.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, ClassVar

import torch
from accelerate import PartialState
from torch import Tensor
from transformers import AutoTokenizer
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.trainer.utils import nanmax, nanmin

from ..callback_order import put_before_loggers_where_asked
from ..fields import unknown_keywords_message
from ..losses import LossSpec, get_loss, policy_stat_sums, ppo_clip_loss, version_lags
from ..methods import METHODS
from ..rollouts import GRPOGroups
from ..serving.local_policy import LocalPolicy, pair_local_policy
from ..serving.server_probe import FAIL_FAST_PREFIXES, probe_server
from ..serving.server_watch import ServerWatch
from ..serving.weight_sync import choose_weight_transfer
from .async_seam import LOSS_WEIGHTS_KEY, AsyncSeam, TreeForward, fold_loss_weights, loss_weight_collator
from .async_worker import RolloutWorker, callable_reward_funcs, groups_per_run, install_served_generator
from .ext_async_grpo_config import ExtAsyncGRPOConfig
from .learning_signal import LearningSignalWatch

logger = logging.getLogger(__name__)

# The keywords a trainer takes besides model, reward_funcs, args, train_dataset and processing_class: TRL's, and
# trl-ext's generator / rollout_worker (a misspelt one is named with the closest, `unknown_keywords_message`).
TRAINER_KEYWORDS = frozenset(inspect.signature(AsyncGRPOTrainer.__init__).parameters) - {"self"} | {"generator"}
PROBE_TIMEOUT_S = 5.0  # one /health probe at construction (`ExtAsyncGRPOTrainer._fail_fast_without_server`)

__all__ = ["ExtAsyncGRPOTrainer", "watch_server"]


def watch_server(trainer: Any) -> ServerWatch | None:
    """Wrap ``trainer.rollout_worker.check_health`` in a `ServerWatch` of ``args.vllm_server_base_url`` with
    ``args.vllm_server_timeout``; call it once, after TRL's ``__init__`` and before ``train()`` (the dataloader
    takes the check when it is built). Returns the watch, or None on a rank without a worker or without a server URL,
    or when the weights go to a sampler that uses no server (a ``weight_transfer`` with ``uses_server = False``:
    `trl_ext.trainers.LocalPolicy`).
    """
    worker = getattr(trainer, "rollout_worker", None)
    url = getattr(trainer.args, "vllm_server_base_url", None)
    if worker is None or not url or not getattr(getattr(trainer, "weight_transfer", None), "uses_server", True):
        return None
    if isinstance(worker.check_health, ServerWatch):
        return worker.check_health
    watch = ServerWatch(worker.check_health, url, float(trainer.args.vllm_server_timeout))
    worker.check_health = watch
    return watch


def _log_ppo_clip_metrics(trainer: Any, forward: TreeForward, flags: dict[str, Tensor]) -> None:
    """TRL's metrics of its PPO-clip loss, computed as ``AsyncGRPOTrainer.compute_loss`` does: ``ratio``, ``kl``,
    ``entropy`` and ``clip_ratio/{low,high,region}_mean`` (float32 sums over all ranks, in one collective, over the
    loss tokens), ``clip_ratio/low_min`` and ``clip_ratio/high_max`` (the extremes over completions of each one's
    clipped fraction, all ranks). ``flags``: `trl_ext.losses.ppo_clip_flags` of the ``M`` loss tokens."""
    stats = policy_stat_sums(forward.logps, forward.old_logps, forward.entropy)
    clipped = [flags[name].float().sum() for name in ("low", "high", "region")]
    totals = trainer.global_sums(
        stats["ratio"], stats["kl"], stats["entropy"], *clipped, stats["count"], dtype=torch.float32
    )
    names = ("ratio", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
    for index, name in enumerate(names):
        trainer.log_metric(name, (totals[index] / totals[6]).item())
    segment_id = forward.segment_id
    num_completions = int(segment_id.max()) + 1

    def per_completion(values: Tensor) -> Tensor:  # NaN for a completion without loss tokens (ignored below)
        return torch.zeros(num_completions, device=values.device).index_add_(0, segment_id, values)

    tokens = per_completion(torch.ones_like(forward.logps, dtype=torch.float32))
    low_min = nanmin(per_completion(flags["low"].float()) / tokens)
    high_max = nanmax(per_completion(flags["high"].float()) / tokens)
    trainer.log_metric("clip_ratio/low_min", nanmin(trainer.accelerator.gather(low_min)).item())
    trainer.log_metric("clip_ratio/high_max", nanmax(trainer.accelerator.gather(high_max)).item())


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

    # What a method trainer sets (AsyncStepwiseRLMTrainer, AsyncJudgeCreditTrainer, AsyncRLMTTrainer); the plain
    # trainer's values. ``config_error``: the TypeError when args is not a `config_class` ("{got}": the type passed);
    # None takes TRL's AsyncGRPOConfig too, unless the loss is one trl-ext computes.
    config_class: ClassVar[type] = ExtAsyncGRPOConfig
    config_error: ClassVar[str | None] = None
    # args=None: config_class("<model's last path part>-<suffix>"); None: args is required.
    default_output_suffix: ClassVar[str | None] = "AsyncGRPO"
    method_worker: ClassVar[bool] = False  # a method trainer: its own worker always (`own_worker`)
    # The ValueError for tools= / environment_factory= ("{name}": which); None: they go to TRL.
    tools_error: ClassVar[str | None] = None
    dataset_error: ClassVar[str] = (
        "ExtAsyncGRPOTrainer with a generator= needs a train_dataset with a 'prompt' column (a string or chat "
        "messages per row)."
    )

    def __init__(
        self,
        model: str,
        reward_funcs: Any = None,
        args: Any = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        *,
        generator: Any = None,
        **kwargs: Any,
    ) -> None:
        """Construction, in order: ``args`` checked (`config_class`, or the default config); the keywords checked
        (TRL's, and ``generator``); a `LocalPolicy` paired with its weight transfer; when this trainer's own worker
        samples (`own_worker`), the dataset's ``prompt`` column and `method_inputs`; `set_up_method`; the server
        probed where the run needs one; the weight transfer chosen; the own worker built (`build_rollout_worker`);
        TRL's ``__init__``; the served policy given to the own worker; the monitors put ahead of the trackers, the
        server watched, the staleness gate and the learning-signal watch; `finish_set_up`."""
        args = self._checked_args(model, args)
        unknown = kwargs.keys() - TRAINER_KEYWORDS
        if unknown:  # TRL's __init__ would name the keyword only
            raise TypeError(unknown_keywords_message(type(self).__name__, sorted(unknown), TRAINER_KEYWORDS))
        if self.tools_error is not None:
            for name in ("tools", "environment_factory"):
                if kwargs.get(name) is not None:
                    raise ValueError(self.tools_error.format(name=name))
        generator, kwargs["weight_transfer"] = pair_local_policy(generator, kwargs.get("weight_transfer"))
        if isinstance(generator, LocalPolicy) and args.token_budget is None:
            args.token_budget = generator.max_model_len or 0  # TRL would ask a vLLM server for its max_model_len
        own_inputs = self.own_worker(generator, kwargs.get("rollout_worker"))
        self._own_worker = own_inputs and kwargs.get("rollout_worker") is None
        if own_inputs:
            if train_dataset is None or "prompt" not in (getattr(train_dataset, "column_names", None) or []):
                raise ValueError(self.dataset_error)
            train_dataset, reward_funcs = self.method_inputs(
                args, train_dataset, reward_funcs, kwargs.get("rollout_worker"), kwargs
            )
        if own_inputs and processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model)
        self.set_up_method(args, processing_class)
        self._fail_fast_without_server(args, generator, kwargs)
        if kwargs.get("weight_transfer") is None and PartialState().is_main_process:
            # A full-weight model off CUDA has no NCCL: its weights go through vLLM's reload from disk instead.
            kwargs["weight_transfer"] = choose_weight_transfer(model, args, peft_config=kwargs.get("peft_config"))
        if self._own_worker:
            worker_args = dict(
                dataset=train_dataset,
                reward_funcs=reward_funcs,
                tokenizer=processing_class,
                generator=generator,  # None: the served policy, given below once TRL knows how it syncs
                num_generations=args.num_generations,
                groups_per_run=groups_per_run(args),
                scale_rewards=getattr(args, "scale_rewards", "group"),
                reward_weights=getattr(args, "reward_weights", None),
                queue_maxsize=args.queue_maxsize,
                chat_template_kwargs=args.chat_template_kwargs,
                step=lambda: self.state.global_step,
            )
            kwargs["rollout_worker"] = self.build_rollout_worker(args, worker_args)
        super().__init__(model, reward_funcs, args, train_dataset, processing_class, **kwargs)
        install_served_generator(self, generator, **self.served_generator_options())
        if isinstance(generator, LocalPolicy):
            generator.check_model(self.accelerator.unwrap_model(self.model).config)
        put_before_loggers_where_asked(self)  # monitors passed as callbacks= ahead of the trackers: alerts reach them
        watch_server(self)  # a vllm serve that went away ends training with an error naming it
        self._gate_staleness()
        self.learning_signal = LearningSignalWatch()  # warns when every advantage has been 0 for several steps
        self.add_callback(self.learning_signal)
        self.finish_set_up()

    def _checked_args(self, model: str, args: Any) -> Any:
        """``args``, or the default `config_class` config; a TypeError when it is not one this trainer takes."""
        if args is None and self.default_output_suffix is not None:
            args = self.config_class(f"{model.rstrip('/').split('/')[-1]}-{self.default_output_suffix}")
        if self.config_error is not None:
            if not isinstance(args, self.config_class):
                raise TypeError(self.config_error.format(got=type(args).__name__))
            return args
        loss_type = getattr(args, "loss_type", "dapo")
        if get_loss(loss_type).compute is not None and not isinstance(args, ExtAsyncGRPOConfig):
            raise TypeError(
                f"loss_type={loss_type!r} needs trl-ext's settings: pass args=trl_ext.ExtAsyncGRPOConfig(...)."
            )
        return args

    # ------------------------------------------------------------------------------------------ what a method writes
    def own_worker(self, generator: Any, rollout_worker: Any) -> bool:
        """Whether the run's samples come from this trainer's own worker (`build_rollout_worker`) rather than TRL's
        spawned one: when a ``generator=`` is given and no ``rollout_worker=``; for a method trainer
        (`method_worker`), always (its dataset and reward functions are checked, `method_inputs`, even when a worker
        is passed)."""
        return self.method_worker or (generator is not None and rollout_worker is None)

    def build_rollout_worker(self, args: Any, worker_args: dict[str, Any]) -> Any:
        """The own rollout worker (TRL's ``RolloutWorkerProtocol``), or None where this process runs no rollouts (TRL
        runs them on the main process only). ``worker_args``: what every `RolloutWorker` takes but its method, from the
        trainer's arguments and ``args``. Here: plain GRPO groups (`GRPOGroups`, TRL's worker's advantages)."""
        if not PartialState().is_main_process:
            return None
        return RolloutWorker(method=GRPOGroups(), **worker_args)

    def method_inputs(
        self, args: Any, train_dataset: Any, reward_funcs: Any, rollout_worker: Any, trainer_kwargs: dict[str, Any]
    ) -> tuple[Any, list[Any]]:
        """The dataset the own worker samples from and the reward functions as a list: by default the dataset as
        given and ``reward_funcs``, which must be callables when the worker is this trainer's own."""
        return train_dataset, callable_reward_funcs(type(self).__name__, reward_funcs, rollout_worker)

    def set_up_method(self, args: Any, processing_class: Any) -> None:
        """What a method sets up before its worker is built (and also when a worker is passed); ``processing_class``:
        the tokenizer (given, or loaded from the model)."""

    def served_generator_options(self) -> dict[str, Any]:
        """Keyword arguments of `install_served_generator` (``group_requests``, ``generation_kwargs``)."""
        return {}

    def finish_set_up(self) -> None:
        """What a method does once TRL's trainer is built (the model loaded, the served policy given)."""

    def train_collation(self) -> contextlib.AbstractContextManager:
        """The context TRL's dataloader is built in, to give its collator the samples' per-sample values: by default
        each loss token's policy version and the samples' ``loss_weights`` (`trl_ext.trainers.async_seam.weights`)."""
        return loss_weight_collator()

    def _watch_learning_signal(self, inputs: dict[str, Tensor]) -> None:
        """Tell `learning_signal` whether any loss token of the micro-batch (all ranks) has a non-zero advantage
        (times its loss weight, when the batch carries weights). One collective: every rank calls it."""
        selected = inputs["token_index"] >= 0
        signal = inputs["advantages"][selected]
        if LOSS_WEIGHTS_KEY in inputs:
            signal = signal * inputs[LOSS_WEIGHTS_KEY][selected].to(signal.dtype)
        self.learning_signal.saw(float(self.global_sums((signal != 0).sum())[0]) > 0)

    def _fail_fast_without_server(self, args: Any, generator: Any, kwargs: dict[str, Any]) -> None:
        """When the run needs ``vllm serve`` (TRL's worker or a method's own worker samples from it, or TRL's sync
        sends it the weights), ask its ``/health`` once (`probe_server`): nothing listening on this machine, or a host
        that does not resolve, fails now with the fix; a server still starting, or another machine's, is waited for
        as TRL does (``vllm_server_timeout``). A ``rollout_worker=`` or ``weight_transfer=`` passed in owns its own
        connections (TRL's rule: an injected backend is not probed), unless it says ``uses_server = True``."""
        worker = kwargs.get("rollout_worker")
        samples_from_server = generator is None and (worker is None or getattr(self, "_own_worker", False))
        transfer = kwargs.get("weight_transfer")
        syncs_to_server = transfer is None or getattr(transfer, "uses_server", False)
        if not (samples_from_server or syncs_to_server) or not PartialState().is_main_process:
            return
        url = args.vllm_server_base_url
        reason = probe_server(url, timeout_s=PROBE_TIMEOUT_S)
        if reason is not None and reason.startswith(FAIL_FAST_PREFIXES):
            raise ConnectionError(
                f"The vLLM server at vllm_server_base_url={url!r} cannot be reached: {reason}. Start it first (e.g. "
                "`vllm serve <model>`, docs/async.md) or fix the URL; to train without a server, pass "
                "generator=LocalPolicy(model_path, tokenizer)."
            )
        if reason is not None:
            logger.warning(
                "The vLLM server at %s is not ready (%s); waiting up to vllm_server_timeout=%g s.",
                url,
                reason,
                args.vllm_server_timeout,
            )

    def _gate_staleness(self) -> None:
        """A trl-ext rollout worker starts a run only while its samples cannot go stale (`StalenessGate`): with the
        samples a version takes when batches hold a fixed count (``token_budget=0``), else measured by the worker."""
        worker = self.rollout_worker
        if not isinstance(worker, RolloutWorker):
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

        ``"dapo"`` is TRL's PPO-clip computed here op for op as TRL does (`trl_ext.losses.ppo_clip_loss` on
        `AsyncSeam.tree_forward`: the same loss, gradients and metrics) so that its clip rate is also logged per
        version lag, ``clip_ratio/region_mean/lag_<k>``.

        The loss gets the ``M`` loss tokens of this rank's row as ``(1, M)`` tensors: log p (the gradient), p_old =
        the sampler's log-probs, the advantages, an all-True mask, the batch's per-token ``loss_weights`` when it
        carries them (`trl_ext.trainers.async_seam.weights`; else none), and TRL's normaliser (the micro-batch's loss
        tokens per rank times the accumulation steps), whatever the spec's ``normalization``. TRL's own loss takes
        no weights: they are folded into its advantages (exact for its PPO-clip loss). Tokens older than
        ``max_staleness`` versions are trained by neither (`AsyncSeam.drop_stale_tokens`).
        """
        inputs = self.drop_stale_tokens(inputs)
        self._watch_learning_signal(inputs)
        spec = self.loss_spec
        if spec.compute is None:  # TRL's PPO-clip, op for op as TRL computes it (`ppo_clip_loss`), plus its lags
            inputs = fold_loss_weights(inputs)
            forward = self.tree_forward(model, inputs)
            loss, flags = ppo_clip_loss(
                forward.logps,
                forward.old_logps,
                forward.advantages,
                epsilon_low=self.epsilon_low,
                epsilon_high=self.epsilon_high,
                normalizer=self.tokens_per_rank(inputs),
            )
            loss = self.add_aux_loss(loss / self.accumulation_steps, forward)  # TRL divides in this order
            _log_ppo_clip_metrics(self, forward, flags)
            self._log_trust_region_by_lag(spec, forward, forward.logps, flags=flags["region"])
            self.record_micro_batch(inputs, forward)
            return loss
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
        """TRL's dataloader, built in `train_collation`: its collator adds each loss token's policy version
        (``sample_versions``, for the metrics by lag) and the method's per-sample values."""
        with self.train_collation():
            return super().get_train_dataloader()

    def _log_trust_region_by_lag(
        self, spec: LossSpec, forward: TreeForward, logps: Tensor, flags: Tensor | None = None
    ) -> None:
        """The loss's trust-region metric per version lag, ``<metric>/lag_<k>`` (e.g. ``ipo/masked_ratio/lag_2``,
        ``clip_ratio/region_mean/lag_2``) over the tokens of each lag ``k`` = this policy's version minus the version
        that sampled them, 0 to ``max_staleness`` (older tokens reach no loss: `AsyncSeam.drop_stale_tokens`): with
        ``flags`` (``(M,)`` bool, the tokens the trust region acts on, e.g. PPO-clip's ``region`` flags), their
        fraction among the lag's tokens; without, the loss recomputed without gradient over the lag's tokens.
        Token-weighted over all ranks; a lag with no token in the micro-batch on any rank is not logged."""
        metric = spec.trust_region_metric
        if forward.sample_versions is None or metric is None:
            return
        max_lag = self.args.max_staleness + 1  # the last bucket holds the dropped tokens: never logged
        lags = version_lags(forward.sample_versions, self.model_version, max_lag)
        if flags is not None:
            flagged = torch.bincount(lags, weights=flags.detach().to(torch.float64), minlength=max_lag + 1)
            tokens = torch.bincount(lags, minlength=max_lag + 1).to(torch.float64)
            totals = self.global_sums(*torch.stack([flagged, tokens], dim=1).flatten())
            for lag in range(max_lag):
                if totals[2 * lag + 1] > 0:
                    self.log_metric(f"{metric}/lag_{lag}", (totals[2 * lag] / totals[2 * lag + 1]).item())
            return
        if not metric.startswith(f"{spec.name}/"):
            return
        key = metric.removeprefix(f"{spec.name}/")
        settings = spec.settings_from(self.args)
        weights = None if forward.loss_weights is None else forward.loss_weights.to(logps.dtype).unsqueeze(0)
        sums = []
        with torch.no_grad():
            for lag in range(max_lag):
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
        for lag in range(max_lag):
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
