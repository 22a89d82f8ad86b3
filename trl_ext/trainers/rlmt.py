"""`RLMTTrainer`: GRPO where the policy plans in ``<think>`` and a reward model scores the response only (docs/rlmt.md).

A thin subclass of `ExtGRPOTrainer` (so the IPO loss and monitors compose with it). It does three things, all built
from the pieces in `trl_ext.rewards.rlmt` (the cut: `trl_ext.rewards.rlmt.method.RLMT`, the asynchronous trainer's
too):

1. **Format.** The dataset's prompts are rewritten into the RLMT format (`rlmt_format_dataset`): ``"instruct"``
   adds the planning instruction as a system message, ``"zero"`` builds the base-model prefix prompt. The user's
   original prompt is kept in the column ``rlmt_original_prompt``, which is what the reward model sees.
2. **Stop string.** ``"zero"`` generation stops at ``</response>``: vLLM gets it as a sampling ``stop`` string, and
   every completion (vLLM, ``transformers``, whose ``generate`` cannot take stop strings from TRL, or a
   ``rollout_func``'s) is cut after the token that completes it, so tokens sampled past the stop are neither scored
   nor trained.
3. **Scorer.** Unless ``reward_funcs`` are given, a `RewardModelScorer` is built from
   ``reward_model_name_or_path`` with its own device, dtype, batch size and chat template; strict mode gives malformed
   completions the lowest reward.

Why a subclass rather than a recipe: the stop-string cut must happen inside generation (before rewards, masks and
log-probs are computed), which a recipe on `ExtGRPOTrainer` cannot reach; the rest would be a recipe's three lines,
kept here so that the paper's defaults live in one config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..methods import METHODS
from ..rewards.rlmt.arguments import refuse_bare_reward_models
from ..rewards.rlmt.method import RLMT
from .ext_grpo import ExtGRPOTrainer
from .requirements import check_trainer_inputs
from .rlmt_config import RLMTConfig
from .trl_seam import BatchScope

logger = logging.getLogger(__name__)


@dataclass
class RLMTBatchScope(BatchScope):
    """One generation batch of `RLMTTrainer`: completions cut at a stop string, out of all generated."""

    stop_cut: int = 0
    stop_total: int = 0


class RLMTTrainer(ExtGRPOTrainer):
    """GRPO with thinking before the response and a reward model that scores the response only (docs/rlmt.md).

    Use it like `GRPOTrainer`. With ``reward_funcs=None`` the reward is a `RewardModelScorer` built from
    ``args.reward_model_name_or_path``; any TRL reward functions may be passed instead (e.g. a
    `RewardModelScorer` you configured, or a `ServedRewardModelScorer`). A bare reward *model* is refused: TRL would
    score the plan with the response.

    Metrics added: ``rlmt/stop_cut_ratio`` (completions cut at a stop string) and, from the scorers,
    ``<scorer name>/malformed_ratio`` and ``<scorer name>/response_score_mean``.
    """

    model_card = METHODS["rlmt"]

    batch_scope_class = RLMTBatchScope

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: RLMTConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        *pargs: Any,
        **kwargs: Any,
    ):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            args = RLMTConfig(f"{name.rstrip('/').split('/')[-1]}-RLMT")
        if not isinstance(args, RLMTConfig):
            raise TypeError(
                f"RLMTTrainer needs args=trl_ext.RLMTConfig(...) (the format and reward-model settings), got "
                f"{type(args).__name__}."
            )
        if reward_funcs is None:
            reward_funcs = args.reward_model_scorer("RLMTTrainer")
        refuse_bare_reward_models(reward_funcs, "RLMTTrainer", args.rlmt_format)
        if args.apply_rlmt_format:
            train_dataset = self._format(train_dataset, args)
            if isinstance(eval_dataset, dict):
                eval_dataset = {key: self._format(value, args) for key, value in eval_dataset.items()}
            else:
                eval_dataset = self._format(eval_dataset, args)
        # What the reward functions need (packages, columns, prompt format) fails now, not at the first batch.
        check_trainer_inputs("RLMTTrainer", reward_funcs, (train_dataset, eval_dataset), kwargs)
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, *pargs, **kwargs)
        self.method = RLMT(args.stop_strings)  # the stop-string cut, the asynchronous trainer's too

    @staticmethod
    def _format(dataset: Any, args: RLMTConfig) -> Any:
        if dataset is None:
            return dataset
        if not hasattr(dataset, "map") or "prompt" not in (getattr(dataset, "column_names", None) or []):
            logger.warning(
                "RLMTTrainer could not rewrite the prompts of a %s without a known 'prompt' column into the RLMT "
                "format; format them with trl_ext.rewards.rlmt_format_dataset and set apply_rlmt_format=False.",
                type(dataset).__name__,
            )
            return dataset
        return args.rlmt_dataset(dataset)

    def postprocess_samples(self, completion_ids: list, logprobs: list | None) -> tuple[list, list | None]:
        """Cut every completion at its first stop string (the sampler may run past it), with its log-probs."""
        completion_ids, logprobs = super().postprocess_samples(completion_ids, logprobs)
        if not self.method.stop_strings:
            return completion_ids, logprobs
        cut_ids, cut_logprobs, cut = self.method.cut(completion_ids, logprobs, self.tokenizer)
        # Counted here, logged once per generation batch (this method may run a different number of times per rank
        # in TRL's tool loop, so no collective call belongs here).
        scope = self.batch_scope
        scope.stop_cut += cut
        scope.stop_total += len(completion_ids)
        return cut_ids, cut_logprobs

    def process_scored_batch(self, batch: dict[str, Any], inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """Log ``rlmt/stop_cut_ratio``: the completions of this batch cut at a stop string (all ranks)."""
        batch = super().process_scored_batch(batch, inputs)
        if self.method.stop_strings:
            scope = self.batch_scope
            totals = self.global_sums(scope.stop_cut, scope.stop_total, dtype=torch.float32)
            self.log_metric("rlmt/stop_cut_ratio", (totals[0] / totals[1].clamp(min=1.0)).item())
        return batch
