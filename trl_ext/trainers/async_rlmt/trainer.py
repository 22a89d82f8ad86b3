"""`AsyncRLMTTrainer`: RLMT (docs/rlmt.md) on TRL's asynchronous trainer (docs/async.md).

What RLMT needs from generation, and why this trainer brings its own rollout worker rather than TRL's
``AsyncRolloutWorker``:

- **The stop string.** The "zero" format ends at ``</response>``. TRL's worker builds its ``/v1/completions`` request
  inside a private method from fixed fields (``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``,
  ``repetition_penalty``): ``AsyncGRPOConfig`` has no ``generation_kwargs`` and no ``stop``, so it cannot stop there.
- **The "zero" prompt.** A base model's prefix prompt is plain text; TRL's worker renders every prompt as chat
  messages through the chat template (and parses the reply with the template's response schema).
- **The reward model.** TRL's worker is a spawned child with ``CUDA_VISIBLE_DEVICES=""``: an 8B reward model would
  score on its CPU. Here it runs where ``reward_model_device`` says.

So the rollouts are `RLMTRolloutWorker`'s (TRL's ``rollout_worker=`` extension point; a thread of this process, like
`AsyncStepwiseRLMTrainer`'s): prompts rendered per format, a group sampled from the published policy with the stop
strings as vLLM's ``stop`` (`ServedGroupGenerator`), every completion cut after the token completing its first stop
string (so nothing past it is scored or trained; the cut also covers a sampler without stop strings), the reward
functions called in-process (no pickling: a `RewardModelScorer` or `ServedRewardModelScorer` as is), and one TRL
`RolloutSample` per completion. Training is `ExtAsyncGRPOTrainer`'s (TRL's loss or the loss registry), untouched:
no TRL internal is needed beyond those `trl_ext.trainers.async_seam` names already.
"""

from __future__ import annotations

from accelerate import PartialState

from ...methods import METHODS
from ...rewards.rlmt.arguments import refuse_bare_reward_models
from ..ext_async_grpo import ExtAsyncGRPOTrainer
from ..requirements import check_trainer_inputs
from .config import AsyncRLMTConfig
from .worker import RLMTRolloutWorker

__all__ = ["AsyncRLMTTrainer"]


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
        return RLMTRolloutWorker(
            **worker_kwargs,
            stop_strings=args.stop_strings,
        )

    def served_generator_options(self):
        """A group's completions in one request, with the stop strings as vLLM's ``stop``."""
        stop = self.args.stop_strings
        return {"group_requests": True, "generation_kwargs": {"stop": list(stop)} if stop else {}}
