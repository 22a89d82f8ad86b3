"""`StepwiseRLMTrainer`: Recursive-Language-Model rollouts trained turn by turn (docs/stepwise_rlm.md).

Flow of one generation batch (each rank, its own B = prompts × G rows):

1. TRL calls our rollout function with the B prompts. `RLMEngine` runs B root RLM rollouts (and every child they
   spawn) with the policy; each root's *completion* for TRL is its final answer.
2. TRL scores the final answers with the reward functions (dataset columns included) and computes the group
   advantages with its own ``scale_rewards``. Roots without an answer get reward 0 from every function.
3. `process_scored_batch` replaces the B rows by one row per turn of every trained node (its `TrainingSample`,
   `StepwiseRLM.training_samples`, as padded rows: `trl_ext.samples.padded_rows`): prompt = the exact ids the
   generator saw, completion = the action. Every row inherits its root's advantage; under the "subtree"
   normalisation its tokens carry ``W(v)/n_v`` so that the loss is ``mean_g L_subtree(root_g)``. Old, reference and
   sampling log-probs are computed for the new rows (turn prompts are not prefixes of each other); TRL's passes over
   the B placeholder rows are skipped (``RLMBatchScope.replaces_rows``).
4. `ExtGRPOTrainer` pads the rows (none dropped, equal on all ranks) and computes the loss.
"""

from __future__ import annotations

import logging
import random
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from ..advantages import broadcast_advantages, stepwise_loss_weights
from ..losses import importance_sampling_ratio
from ..methods import METHODS
from ..rlm import EngineStats, RolloutTree, TurnSample, canonical_rollout_order
from ..rlm.generators import TransformersGenerator, VLLMColocateGenerator, VLLMServerGenerator
from ..rlm.method import StepwiseRLM, answered_rewards, rollout_metrics
from ..samples import TrainingSample, padded_rows
from .ext_grpo import ExtGRPOTrainer
from .requirements import changed_settings, check_trainer_inputs
from .stepwise_rlm_config import StepwiseRLMConfig
from .trl_seam import BatchScope

logger = logging.getLogger(__name__)


@dataclass
class RLMBatchScope(BatchScope):
    """One generation batch of `StepwiseRLMTrainer`: the rollout trees (in batch order) and the engine's counters.

    Every row TRL builds (one placeholder per root) is replaced by the turn rows, so TRL computes no log-probs for
    them."""

    trees: list[RolloutTree] = field(default_factory=list)
    stats: EngineStats | None = None
    replaces_rows: bool = True


class StepwiseRLMTrainer(ExtGRPOTrainer):
    """Stepwise RLM training: every turn of every node a training row, children weighted 1/k (docs/stepwise_rlm.md).

    Use like `GRPOTrainer`; the dataset needs a ``prompt`` column (the task) and, optionally, the context column
    (``context`` by default; without it the prompt is the context). Reward functions receive each root's final
    answer as the completion, plus the dataset columns. Pass ``generator=`` to sample with your own
    `trl_ext.rlm.Generator`; by default the trainer's model is used through transformers, or TRL's vLLM
    (colocate or server) when ``use_vllm=True``.

    Metrics: the RLM metrics of `trl_ext.rlm.metrics.rollout_metrics`, the asynchronous trainer's too (turns,
    children, answers, REPL failures, ``*_total`` counters; docs/stepwise_rlm.md), and ``rlm/padding_rows``.

    Prompt length: ``max_prompt_tokens`` caps every turn's prompt (`None`: the model's positions minus
    ``max_completion_length``); ``max_prompt_length`` (TRL's prompt cap) does not apply, the engine builds the
    prompts.
    """

    model_card = METHODS["stepwise-rlm"]
    batch_scope_class = RLMBatchScope
    padding_metrics = ("batch/padding_rows", "rlm/padding_rows")

    def __init__(self, model, reward_funcs=None, args: StepwiseRLMConfig | None = None, *pargs, **kwargs):
        if kwargs.get("rollout_func") is not None:
            raise ValueError("StepwiseRLMTrainer generates with the RLM engine: do not pass rollout_func.")
        if args is not None and not isinstance(args, StepwiseRLMConfig):
            raise TypeError("Pass args=trl_ext.trainers.StepwiseRLMConfig(...) (it holds the RLM scaffold settings).")
        if args is None:
            args = StepwiseRLMConfig("StepwiseRLM")
        self._rlm_generator = kwargs.pop("generator", None)
        # A context_column other than the default must exist (a typo would silently make the prompt the context);
        # the default "context" is optional. The rollout function adds "rlm_has_answer" for the reward functions.
        check_trainer_inputs(
            "StepwiseRLMTrainer",
            reward_funcs,
            pargs,
            kwargs,
            column_settings=changed_settings(args, ("context_column",)),
            extra_columns=("rlm_has_answer",),
        )
        with warnings.catch_warnings():  # the rollout function is ours, not the user's experimental one
            warnings.filterwarnings("ignore", message="You are using 'rollout_func'")
            super().__init__(model, reward_funcs, args, *pargs, rollout_func=_rlm_rollout, **kwargs)
        # The method (`StepwiseRLM.from_arguments`: the sandbox checked now); no turn prompt may outgrow the model's
        # positions.
        self.method, self.sandbox_info = StepwiseRLM.from_arguments(args, self.processing_class)
        self.method.cap_prompts(self.max_prompt_length)
        self.last_rollout_trees: list[RolloutTree] = []  # the trees of the last generation batch (for inspection)

    # ------------------------------------------------------------------------------------------------ rollouts
    def make_generator(self):
        """The policy's sampler for the engine: the ``generator=`` passed in, else transformers or TRL's vLLM."""
        if self._rlm_generator is not None:
            return self._rlm_generator
        if not self.use_vllm:
            return TransformersGenerator.from_trainer(self)
        if self.vllm_mode == "colocate":
            return VLLMColocateGenerator.from_trainer(self)
        return VLLMServerGenerator.from_trainer(self)

    def run_rollouts(self, prompts: list[Any]) -> dict[str, list]:
        """Run one RLM tree per prompt; return TRL's rollout dict with each root's final answer as completion."""
        scope = self.batch_scope  # TRL passes the rollout function the prompts only; the context column is here
        contexts = self.method.contexts(scope.inputs)
        if len(contexts) != len(prompts):
            contexts = [None] * len(prompts)
        was_training = self.model.training
        self.model.eval()
        try:
            trees, stats = self.method.rollouts(self.make_generator(), self.method.tasks(prompts, contexts))
        finally:
            self.model.train(was_training)
        # Interchangeable rollouts of one example in a canonical order, so the same seed gives the same batch.
        trees = [trees[i] for i in canonical_rollout_order(trees, scope.inputs, self.args.context_column)]
        scope.trees, scope.stats = trees, stats
        self.last_rollout_trees = trees
        eos = self.processing_class.eos_token_id
        answers = [tree.final_answer for tree in trees]
        completion_ids = [
            list(self.processing_class(answer, add_special_tokens=False)["input_ids"]) + [eos]
            if answer is not None
            else [eos]
            for answer in answers
        ]
        if self.method.trees_dir is not None:  # this step's file: the policy version is the global step
            writer = f"rank{self.accelerator.process_index}"
            self.log_completion_column(
                "rlm_tree", self.method.save_trees(trees, self.mode, self.state.global_step, writer)
            )
        return {
            "prompt_ids": [tree.root.turns[0].prompt_ids if tree.root.turns else [eos] for tree in trees],
            "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(ids) for ids in completion_ids],  # placeholder rows, replaced by turns
            "rlm_has_answer": [answer is not None for answer in answers],
        }

    def compute_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super().compute_rewards(inputs, prompts, completions, completion_ids_list)
        has_answer = torch.tensor([bool(row.get("rlm_has_answer", True)) for row in inputs], device=rewards.device)
        # in place: the tensor the base trainer keeps for the hook
        return answered_rewards(rewards, self.accelerator.gather(has_answer))

    # ------------------------------------------------------------------------------------------------ rows
    def process_scored_batch(self, batch: dict[str, Any], inputs: list[dict[str, Any]]) -> dict[str, Any]:
        scope = self.batch_scope
        trees = scope.trees
        if len(trees) != len(batch["prompt_ids"]):
            raise RuntimeError(
                f"{len(trees)} rollout trees for {len(batch['prompt_ids'])} rows: rollouts out of sync."
            )
        device = batch["completion_ids"].device
        turns, samples = self._training_samples(trees)
        self.log_rollout_metrics(rollout_metrics(trees, scope.stats, len(samples)))

        rows = {
            key: value.to(device) for key, value in padded_rows(samples, self.processing_class.pad_token_id).items()
        }
        sampling_logps = rows.pop("sampling_per_token_logps")
        row_root = torch.tensor([sample.group_id for sample in samples], device=device)  # the group: the root's index
        new: dict[str, Any] = {
            **rows,
            "advantages": broadcast_advantages(batch["advantages"], row_root),
            "rewards": broadcast_advantages(batch["rewards"], row_root),
            "rlm_root": row_root,
            # Shared-prefix packing: the trees of one prompt (TRL's consecutive num_generations rows) share its system
            # prompt, task and context, and each tree's turns their histories: one group, one micro-batch.
            "prefix_group": torch.div(row_root, self.num_generations, rounding_mode="floor"),
            "rlm_node": torch.tensor([turn.node for turn in turns], device=device),
            "rlm_depth": torch.tensor([turn.depth for turn in turns], device=device),
        }
        if self.method.weighted:
            num_tokens = self.accelerator.gather(new["completion_mask"].sum()).sum()
            num_roots = self.accelerator.gather(torch.tensor(len(trees), device=device)).sum()
            new["loss_weights"] = stepwise_loss_weights(
                torch.tensor([sample.node_weight for sample in samples], device=device),
                torch.tensor([sample.node_tokens for sample in samples], device=device),
                new["completion_mask"],
                num_roots=num_roots,
                num_tokens=num_tokens,
            )
        self._add_logps(new, batch, sampling_logps)
        return new

    def child_sampling_rng(self) -> random.Random:
        """The generator of this batch's ``child_sampling="one"`` draws: a function of the seed, the rank, the mode,
        the global step and how many batches this step drew before, so a resumed run draws what the uninterrupted
        run would have, without a generator state to checkpoint (`batch_random_key`)."""
        return random.Random(self.batch_random_key("child-sampling"))

    def _training_samples(self, trees: list[RolloutTree]) -> tuple[list[TurnSample], list[TrainingSample]]:
        """Every trained turn of the batch's trees (`StepwiseRLM.turn_samples`: its node and depth) and its
        `TrainingSample` (`StepwiseRLM.training_samples`), the root's index as its group."""
        turns, samples = [], []
        rng = self.child_sampling_rng()
        for root_index, tree in enumerate(trees):
            tree_turns = self.method.turn_samples(tree, rng)
            turns += tree_turns
            samples += self.method.training_samples(tree, tree_turns, group_id=root_index)
        if not samples:
            raise RuntimeError("No rollout produced a single action token: check the generator.")
        return turns, samples

    @torch.no_grad()
    def _add_logps(self, new: dict[str, Any], old_batch: dict[str, Any], sampling_logps: torch.Tensor) -> None:
        """Old, reference and sampling log-probs of the new rows, where TRL had them for the old rows."""
        input_ids = torch.cat([new["prompt_ids"], new["completion_ids"]], dim=1)
        attention_mask = torch.cat([new["prompt_mask"], new["completion_mask"]], dim=1)
        length = new["completion_ids"].size(1)
        batch_size = self.args.per_device_train_batch_size if self.model.training else None

        def logps(model) -> torch.Tensor:
            with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                return self.per_token_logps_and_entropies(model, input_ids, attention_mask, length, batch_size)[0]

        if old_batch.get("old_per_token_logps") is not None:
            new["old_per_token_logps"] = logps(self.model)
        if old_batch.get("ref_per_token_logps") is not None:
            if self.ref_model is not None:
                new["ref_per_token_logps"] = logps(self.ref_model)
            else:
                model = self.accelerator.unwrap_model(self.model)
                with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
                    new["ref_per_token_logps"] = logps(self.model)
        if old_batch.get("sampling_per_token_logps") is not None:
            new["sampling_per_token_logps"] = sampling_logps
        if old_batch.get("importance_sampling_ratio") is not None:
            new["importance_sampling_ratio"] = importance_sampling_ratio(
                new["old_per_token_logps"],
                sampling_logps,
                new["completion_mask"],
                mode=self.vllm_importance_sampling_mode,
                clip_min=self.vllm_importance_sampling_clip_min,
                clip_max=self.vllm_importance_sampling_clip_max,
            )


def _rlm_rollout(prompts: list[Any], trainer: StepwiseRLMTrainer) -> dict[str, list]:
    """TRL ``rollout_func``: delegates to the trainer's RLM engine."""
    return trainer.run_rollouts(prompts)
