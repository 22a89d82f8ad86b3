"""`AsyncStepwiseRLMTrainer`: stepwise RLM training (docs/stepwise_rlm.md) on TRL's asynchronous trainer, an adapter:
its rollout worker runs `trl_ext.rlm.method.StepwiseRLM.rollout` (the method the synchronous trainer drives), one
sample per turn of every trained node. Under ``rlm_loss_normalization="subtree"`` each sample carries its node's
``W(v)/n_v``, the collator turns it into per-token ``loss_weights`` (`trl_ext.trainers.async_seam.weights`) and the
loss of a micro-batch of whole trees is ``mean_g L_subtree(root_g)``, as in `StepwiseRLMTrainer`: for ``"ipo"``
through the loss's ``weights=`` (its τ penalty included), for ``"dapo"`` (TRL's PPO-clip) folded into the
advantages, which is exact for it."""

from __future__ import annotations

from ..methods import METHODS
from ..rlm.method import StepwiseRLM
from ..rlm.sandbox import warn_run_exposure
from .async_rlm_config import AsyncStepwiseRLMConfig
from .async_seam import LOSS_WEIGHTS_KEY
from .async_worker import RolloutWorker
from .ext_async_grpo import ExtAsyncGRPOTrainer
from .prompt_cap import prompt_cap

__all__ = ["AsyncStepwiseRLMConfig", "AsyncStepwiseRLMTrainer"]


class AsyncStepwiseRLMTrainer(ExtAsyncGRPOTrainer):
    """Stepwise RLM training on TRL's asynchronous trainer: every turn of every node a sample, children weighted 1/k.

    Use like `ExtAsyncGRPOTrainer` with an [`AsyncStepwiseRLMConfig`]: ``model`` is a path or Hub id served by
    ``vllm serve`` at ``vllm_server_base_url`` (LoRA sync: start it with ``--enable-lora`` and
    ``--max-loras >= max_staleness + 2``). The dataset needs a ``prompt`` column and, optionally, the context
    column; reward functions get each root's final answer as the completion (a root that never answered gets 0),
    plus the dataset columns and ``rlm_has_answer``; their rewards are summed with ``reward_weights``. The rollout
    worker runs in a thread of this process, so reward functions need not be picklable. Pass ``generator=`` (a
    `trl_ext.rlm.Generator`) to sample with something else than the server (tests use a scripted one), or
    ``rollout_worker=`` to replace the worker. With ``save_rollout_trees`` every run's trees are written as JSON
    lines under ``<output_dir>/rlm_trees/`` (`StepwiseRLM.rollout`).

    Metrics, besides TRL's and the loss's: the RLM metrics of `trl_ext.rlm.metrics.rollout_metrics`, the same names
    and values as the synchronous trainer's (docs/stepwise_rlm.md), ``rlm/worker_errors_total`` (failed rollout
    runs), ``reward``, ``rewards/<function>``.
    """

    model_card = METHODS["stepwise-rlm"]
    method_worker = True
    config_class = AsyncStepwiseRLMConfig
    config_error = "Pass args=trl_ext.trainers.AsyncStepwiseRLMConfig(...) (it holds the RLM settings)."
    default_output_suffix = "AsyncStepwiseRLM"
    tools_error = "AsyncStepwiseRLMTrainer's tools are the RLM's REPL: do not pass {name}."
    dataset_error = "AsyncStepwiseRLMTrainer needs a train_dataset with a 'prompt' column (the tasks)."

    def set_up_method(self, args, processing_class):
        """The stepwise RLM method (`StepwiseRLM.from_arguments`: the sandbox checked now), and a warning when the
        sandbox cannot keep REPLs from this run (its output_dir, the served policy's endpoints)."""
        self.method, self.sandbox_info = StepwiseRLM.from_arguments(args, processing_class)
        warn_run_exposure(self.method.scaffold.sandbox, args.output_dir, type(self).__name__)

    def build_rollout_worker(self, args, worker_kwargs):
        return RolloutWorker(method=self.method, **worker_kwargs)

    def finish_set_up(self):
        """``max_prompt_tokens=None`` caps the turns' prompts at the model's positions minus
        ``max_completion_length`` (known now that the model is loaded)."""
        self.method.cap_prompts(prompt_cap(None, self.model, self.args))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """`ExtAsyncGRPOTrainer`'s loss; under "subtree" a batch must carry the samples' loss weights."""
        if self.args.rlm_loss_normalization == "subtree" and LOSS_WEIGHTS_KEY not in inputs:
            raise RuntimeError(
                "rlm_loss_normalization='subtree' but this micro-batch carries no loss_weights: its samples came "
                "without weights (a custom rollout_worker must build them with StepwiseRLM.training_samples and "
                "to_rollout_sample(..., weighted=True)), or the dataloader was not built by this trainer's "
                "get_train_dataloader."
            )
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
