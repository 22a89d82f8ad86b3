"""`RLMRolloutWorker`: TRL's ``RolloutWorkerProtocol`` producing stepwise RLM samples (docs/stepwise_rlm.md).

A background thread of the trainer process runs the stepwise RLM method (`trl_ext.rlm.method.StepwiseRLM`, the one
the synchronous trainer drives too; its REPLs are sandboxed subprocesses already, so TRL's spawned child is not
needed): for each prompt of the dataset, in order and cycling, ``num_generations`` root rollouts
(their children included, ``rlm_query_batched`` batched by the engine) against the policy; rewards from the reward
functions on the roots' final answers (a root that never answered gets 0, as in `StepwiseRLMTrainer`); the group
advantage (`trl_ext.advantages.group_advantages`); then one `RolloutSample` per turn of every trained node
(`StepwiseRLM.training_samples`, `to_rollout_sample`: under ``rlm_loss_normalization="subtree"`` with the node's
per-token weight ``W(v)/n_v`` and the sample's share of its root, which the loss turns into
``mean_g L_subtree(root_g)``) into ``rollout_buffer``, which TRL's trainer drains.

Policy version. Every sample of a run is tagged with the version live when the run started: the version its trees'
first turns were sampled from. A tree spans versions (a sync can land between its turns); tagging it with its oldest
makes TRL's ``max_staleness`` bound the staleness of every one of its turns, and its rows are kept or dropped
together rather than a tree losing some turns.

Faults. A REPL error, timeout or crash is the engine's to contain: it ends up in the tree and in the ``repl/*`` rates.
A failing run (the generator, a reward function) is logged with its traceback, counted in
``rlm/worker_errors_total`` and retried with the next prompts; ``max_consecutive_errors`` failures in a row stop the
thread, and then `check_health` (called by the trainer while it waits for samples) raises with the cause.

Rollout trees. With the method's ``trees_dir``, every run's trees are appended, one JSON line each (`RolloutTree.to_dict`, as
`StepwiseRLMTrainer` writes them), to ``<trees_dir>/train-v<version>-run<run>.jsonl`` before they are scored: the
policy version the run started from and the run's number. The numbering continues after the highest run already in
the folder, so a resumed run (whose version counter restarts at the checkpoint's) writes new files and never adds
to, or overwrites, an earlier run's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...rlm import RolloutTree
from ...rlm.generators import Completion, Generator
from ...rlm.method import StepwiseRLM, answered_rewards, rollout_metrics
from ...rlm.tree_files import next_run
from ..async_worker import (
    ThreadedRolloutWorker,
    group_metrics,
    population_std,
    to_rollout_sample,
)

__all__ = ["RLMRolloutWorker"]


class _Heartbeat:
    """A `Generator` wrapper that ticks the worker's heartbeat around every call (a long run is not a hang)."""

    def __init__(self, inner: Generator, tick: Callable[[], None]):
        self.inner, self.tick = inner, tick

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        self.tick()
        try:
            return self.inner.generate(prompts)
        finally:
            self.tick()


class RLMRolloutWorker(ThreadedRolloutWorker):
    """Stepwise RLM rollouts for TRL's asynchronous trainer (``rollout_worker=``), in a thread of this process.

    Args:
        method: the `StepwiseRLM` (scaffold and sandbox, context column, trained nodes, tree folder).
        weighted: carry the "subtree" loss weights (``rlm_loss_normalization="subtree"``).
        seed: seeds the ``child_sampling="one"`` draws.
        worker_args: those of `ThreadedRolloutWorker`: ``dataset`` (rows with a ``prompt``, a string or chat
            messages whose last user message is the task), ``reward_funcs`` (given each root's final answer as the
            completion, plus ``rlm_has_answer``, called as every worker calls them: `call_rewards`), ``tokenizer``, ``generator``, ``num_generations`` (roots per
            prompt), ``groups_per_run`` (prompts whose trees one engine run samples together), ``scale_rewards``,
            ``reward_weights``, ...

    Attributes:
        rollout_buffer, metrics_queue: what TRL's trainer drains (``RolloutWorkerProtocol``).
        model_version: the version last published by the trainer.
        errors: failed runs so far; groups: groups scored so far; last_trees: the trees of the last run.
        runs: the number the next run's tree file gets (past the folder's files when the worker was built).
    """

    worker_name = "RLM"
    metric_prefix = "rlm"
    in_flight = "an engine run is still going"

    def __init__(self, *, method: StepwiseRLM, weighted: bool = True, seed: int = 0, **worker_args: Any) -> None:
        super().__init__(**worker_args)
        self.method = method
        self.weighted = weighted
        self.last_trees: list[RolloutTree] = []  # the trees of the last run (for inspection)
        self.runs = next_run(method.trees_dir)
        self._rng = random.Random(seed)

    # ------------------------------------------------------------------------------ one run
    def rollout(self, rows: Sequence[dict[str, Any]]) -> list[Any]:
        """Sample, score and turn into samples ``num_generations`` trees for each of ``rows`` (one engine run)."""
        version = self.model_version  # the version of the trees' first turns (module docstring)
        run, self.runs = self.runs, self.runs + 1
        roots = [row for row in rows for _ in range(self.num_generations)]
        tasks = self.method.tasks([row["prompt"] for row in roots], self.method.contexts(roots))
        trees, stats = self.method.rollouts(_Heartbeat(self.generator, self._tick), tasks)
        self.last_trees = trees
        self.method.save_trees(trees, "train", version, f"run{run:06d}")
        samples: list[Any] = []
        for index, row in enumerate(rows):
            group = trees[index * self.num_generations : (index + 1) * self.num_generations]
            samples += self._group_samples(row, group, version)
        self._push_metrics(rollout_metrics(trees, stats, len(samples)))  # a rate with nothing counted left out
        return samples

    def _group_samples(self, row: dict[str, Any], trees: list[RolloutTree], version: int) -> list[Any]:
        answers = [tree.final_answer for tree in trees]
        # Each root's final answer is its completion ("" when it has none), as the synchronous trainer scores it.
        texts = [answer or "" for answer in answers]
        ids = [list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
        per_func = self.call_rewards(row, texts, ids, rlm_has_answer=[answer is not None for answer in answers])
        answered = torch.tensor([answer is not None for answer in answers])
        rewards = answered_rewards(torch.tensor(self.summed_rewards(per_func), dtype=torch.float64), answered).tolist()
        advantages = self.group_advantages(rewards)
        reward_std = population_std(rewards)
        group_id, self.groups = self.groups, self.groups + 1
        samples = []
        for tree_index, (tree, advantage, reward) in enumerate(zip(trees, advantages, rewards, strict=True)):
            tree_samples = self.method.training_samples(
                tree,
                self.method.turn_samples(tree, self._rng),
                advantage=advantage,
                group_id=group_id,
                metrics=group_metrics(tree_index, reward, reward_std, self.reward_func_names, per_func),
            )
            samples += [to_rollout_sample(sample, version, weighted=self.weighted) for sample in tree_samples]
        return samples
