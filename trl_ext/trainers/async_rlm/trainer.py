"""`AsyncStepwiseRLMTrainer`: stepwise RLM training (docs/stepwise_rlm.md) on TRL's asynchronous trainer.

TRL's ``AsyncGRPOTrainer`` trains on whatever its ``rollout_worker`` pushes; here that is `RLMRolloutWorker`, which
runs the RLM engine in a thread against the policy served by ``vllm serve`` (`ServedPolicyGenerator`, the latest
published adapter) and pushes one sample per turn of every trained node. Under ``rlm_loss_normalization="subtree"``
each sample carries its node's ``W(v)/n_v``, the collator turns it into per-token ``loss_weights``
(`trl_ext.trainers.async_seam.weights`) and the loss of a micro-batch of whole trees is ``mean_g L_subtree(root_g)``,
as in `StepwiseRLMTrainer`: for ``"ipo"`` through the loss's ``weights=`` (its τ penalty included), for ``"dapo"``
(TRL's PPO-clip) folded into the advantages, which is exact for it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import AutoTokenizer

from ...methods import METHODS
from ...rlm.sandbox import isolation_report, resolve_isolation
from ..async_seam import LOSS_WEIGHTS_KEY, loss_weight_collator
from ..async_worker import callable_reward_funcs, groups_per_run, install_served_generator
from ..ext_async_grpo import ExtAsyncGRPOTrainer
from ..prompt_cap import prompt_cap
from .config import AsyncStepwiseRLMConfig
from .worker import RLMRolloutWorker

__all__ = ["AsyncStepwiseRLMTrainer"]


class AsyncStepwiseRLMTrainer(ExtAsyncGRPOTrainer):
    """Stepwise RLM training on TRL's asynchronous trainer: every turn of every node a sample, children weighted 1/k.

    Use like `ExtAsyncGRPOTrainer` with an [`AsyncStepwiseRLMConfig`]: ``model`` is a path or Hub id served by
    ``vllm serve`` at ``vllm_server_base_url`` (LoRA sync: start it with ``--enable-lora`` and
    ``--max-loras >= max_staleness + 2``). The dataset needs a ``prompt`` column and, optionally, the context
    column; reward functions get each root's final answer as the completion (a root that never answered gets 0),
    plus the dataset columns and ``rlm_has_answer``. The rollout worker runs in a thread of this process, so reward
    functions need not be picklable. Pass ``generator=`` (a `trl_ext.rlm.Generator`) to sample with something else
    than the server (tests use a scripted one), or ``rollout_worker=`` to replace the worker.

    Metrics, besides TRL's and the loss's: ``rlm/turns_mean``, ``rlm/children_mean``, ``rlm/final_answer_rate``,
    ``rlm/rows_per_root``, ``rlm/depth_max``, ``repl/error_rate``, ``repl/timeout_rate``, ``repl/crash_rate``,
    ``rlm/prompt_too_long_total``, ``rlm/refused_queries_total``, ``rlm/worker_errors_total`` (failed rollout runs),
    ``reward``, ``rewards/<function>``.
    """

    model_card = METHODS["stepwise-rlm"]

    def __init__(
        self,
        model: str,
        reward_funcs: Any = None,
        args: AsyncStepwiseRLMConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        *,
        generator: Any = None,
        rollout_worker: Any = None,
        **kwargs: Any,
    ) -> None:
        if args is None:
            args = AsyncStepwiseRLMConfig(f"{model.rstrip('/').split('/')[-1]}-AsyncStepwiseRLM")
        if not isinstance(args, AsyncStepwiseRLMConfig):
            raise TypeError("Pass args=trl_ext.trainers.AsyncStepwiseRLMConfig(...) (it holds the RLM settings).")
        for name in ("tools", "environment_factory"):
            if kwargs.get(name) is not None:
                raise ValueError(f"AsyncStepwiseRLMTrainer's tools are the RLM's REPL: do not pass {name}.")
        if train_dataset is None or "prompt" not in train_dataset.column_names:
            raise ValueError("AsyncStepwiseRLMTrainer needs a train_dataset with a 'prompt' column (the tasks).")
        funcs = callable_reward_funcs("AsyncStepwiseRLMTrainer", reward_funcs, rollout_worker)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model)
        scaffold = args.scaffold_config()
        resolve_isolation(scaffold.sandbox)  # isolation="strict" fails now; "auto" warns once if weaker
        self.sandbox_info = isolation_report(scaffold.sandbox)
        self._own_worker = rollout_worker is None
        if rollout_worker is None:
            rollout_worker = RLMRolloutWorker(
                dataset=train_dataset,
                reward_funcs=funcs,
                tokenizer=processing_class,
                generator=generator,  # None: the served policy, set below once TRL knows how it syncs
                scaffold=scaffold,
                num_generations=args.num_generations,
                groups_per_run=groups_per_run(args),
                context_column=args.context_column,
                scale_rewards=args.scale_rewards,
                weighted=args.rlm_loss_normalization == "subtree",
                train_children=args.train_children,
                child_sampling=args.child_sampling,
                queue_maxsize=args.queue_maxsize,
                seed=args.seed,
                chat_template_kwargs=args.chat_template_kwargs,
            )
        super().__init__(
            model,
            reward_funcs,
            args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            rollout_worker=rollout_worker,
            **kwargs,
        )
        install_served_generator(self, generator)  # the served policy, once TRL knows how it syncs
        if self._own_worker and scaffold.max_prompt_tokens is None and self.rollout_worker is not None:
            cap = prompt_cap(None, self.model, args)  # the model's positions minus max_completion_length
            if cap is not None:
                self.rollout_worker.scaffold = dataclasses.replace(scaffold, max_prompt_tokens=cap)

    def get_train_dataloader(self):
        """TRL's dataloader, its collator adding the samples' per-token ``loss_weights``
        (`trl_ext.trainers.async_seam.weights`)."""
        with loss_weight_collator():
            return super().get_train_dataloader()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """`ExtAsyncGRPOTrainer`'s loss; under "subtree" a batch must carry the samples' loss weights."""
        if self.args.rlm_loss_normalization == "subtree" and LOSS_WEIGHTS_KEY not in inputs:
            raise RuntimeError(
                "rlm_loss_normalization='subtree' but this micro-batch carries no loss_weights: its samples came "
                "without weights (a custom rollout_worker must build them with trl_ext.trainers.async_rlm."
                "tree_samples), or the dataloader was not built by this trainer's get_train_dataloader."
            )
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
