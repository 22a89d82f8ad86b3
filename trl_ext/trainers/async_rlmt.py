"""`AsyncRLMTTrainer`: RLMT (docs/rlmt.md) on TRL's asynchronous trainer, an adapter: its rollout worker samples the
RLMT method's groups (`trl_ext.rewards.rlmt.method.RLMT`: RLMT prompts, every completion cut after its first stop
string, the cut of `RLMTTrainer` too), with the stop strings as vLLM's ``stop`` and the reward functions called in
this process. Why a worker of trl-ext's rather than TRL's: docs/async.md ("Judge credit and RLMT asynchronously")."""

from __future__ import annotations

from accelerate import PartialState

from ..methods import METHODS
from ..rewards.rlmt.arguments import refuse_bare_reward_models
from ..rewards.rlmt.method import RLMT
from .async_rlmt_config import AsyncRLMTConfig
from .async_worker import RolloutWorker
from .ext_async_grpo import ExtAsyncGRPOTrainer
from .requirements import check_trainer_inputs

__all__ = ["AsyncRLMTConfig", "AsyncRLMTTrainer"]


class AsyncRLMTTrainer(ExtAsyncGRPOTrainer):
    """RLMT on TRL's asynchronous trainer: the policy plans in ``<think>``, a reward model scores the response only.

    Use like `ExtAsyncGRPOTrainer` with an [`AsyncRLMTConfig`]: ``model`` is a path or Hub id served by ``vllm serve``
    at ``vllm_server_base_url`` (LoRA sync: start it with ``--enable-lora`` and ``--max-loras >= max_staleness +
    2``). The dataset needs a ``prompt`` column; with ``apply_rlmt_format`` it is rewritten into the RLMT format
    (`rlmt_format_dataset`, the user's prompt kept in ``rlmt_original_prompt``). With ``reward_funcs=None`` the
    reward is a `RewardModelScorer` built from ``reward_model_name_or_path``; any TRL reward functions (sync or async)
    may be passed instead, and need not be picklable (the rollout worker is a thread of this process). A bare reward
    *model* is refused: it would score the plan with the response. Pass ``generator=`` (a `trl_ext.rlm.Generator`) to
    sample with something else than the server (tests use a scripted one), or ``rollout_worker=`` to replace the
    worker.

    Metrics, besides TRL's and the loss's: ``reward``, ``reward_std``, ``rewards/<function>``,
    ``rlmt/stop_cut_ratio`` (completions cut at a stop string; with stop strings), ``completions/mean_length``, the
    scorers' ``<scorer name>/malformed_ratio`` and ``<scorer name>/response_score_mean``, and
    ``rlmt/worker_errors_total`` (failed rollout runs).
    """

    model_card = METHODS["rlmt"]

    method_worker = True
    config_class = AsyncRLMTConfig
    config_error = (
        "AsyncRLMTTrainer needs args=trl_ext.trainers.AsyncRLMTConfig(...) (the format and reward-model settings), "
        "got {got}."
    )
    default_output_suffix = "AsyncRLMT"
    tools_error = "AsyncRLMTTrainer samples single-turn completions: do not pass {name}."
    dataset_error = "AsyncRLMTTrainer needs a train_dataset (a datasets.Dataset) with a 'prompt' column."

    def method_inputs(self, args, train_dataset, reward_funcs, rollout_worker, trainer_kwargs):
        """A bare reward model refused; the dataset rewritten into the RLMT format (``apply_rlmt_format``); with
        ``reward_funcs=None``, the `RewardModelScorer` of ``reward_model_name_or_path``."""
        refuse_bare_reward_models(reward_funcs, "AsyncRLMTTrainer", args.rlmt_format)
        if args.apply_rlmt_format:
            train_dataset = args.rlmt_dataset(train_dataset)
        # Rollouts run on the main process only (TRL's rule), so the reward model is loaded there only; a missing
        # reward fails on every process.
        if reward_funcs is None and rollout_worker is None:
            if args.reward_model_name_or_path is None or PartialState().is_main_process:
                reward_funcs = args.reward_model_scorer("AsyncRLMTTrainer")
        if reward_funcs is None:
            funcs = []
        else:
            funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        check_trainer_inputs("AsyncRLMTTrainer", funcs, (train_dataset,), trainer_kwargs)
        return train_dataset, funcs

    def build_rollout_worker(self, args, worker_kwargs):
        if not PartialState().is_main_process:
            return None  # TRL runs the rollouts on the main process; the reward model is loaded there only
        return RolloutWorker(method=self.method, **worker_kwargs)

    def set_up_method(self, args, processing_class):
        """The RLMT method: its prompts and stop-string cut (`RLMT`, the synchronous trainer's too)."""
        self.method = RLMT(args.stop_strings)

    def served_generator_options(self):
        """A group's completions in one request, with the stop strings as vLLM's ``stop``."""
        stop = self.args.stop_strings
        return {"group_requests": True, "generation_kwargs": {"stop": list(stop)} if stop else {}}
