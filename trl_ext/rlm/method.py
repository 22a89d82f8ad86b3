"""Stepwise RLM training as one object both trainers drive (docs/stepwise_rlm.md): `StepwiseRLM` knows the scaffold,
its sandbox, which nodes are trained and where the trees are written, and nothing of the training loop.

A runtime hands it prompts and a sampler and gets back what it trains on and logs:

1. `StepwiseRLM.tasks`: one `RLMTask` per root (the last user message of the prompt; the dataset's context column,
   absent: the prompt is the context);
2. `StepwiseRLM.rollouts`: the trees, every root and the children it spawns, from one `RLMEngine` run (requests in
   a canonical order, so the same seed gives the same trees), with the engine's counters;
3. `answered_rewards`: a root that never answered gets reward 0, whatever the reward functions make of "";
4. `StepwiseRLM.training_samples`: what one tree trains on, one `trl_ext.samples.TrainingSample` per turn of every
   trained node (`RolloutTree.turn_samples`), with W(v), n_v and its share of the root;
5. `StepwiseRLM.save_trees` and `rollout_metrics`: the tree files (`trl_ext.rlm.tree_files`) and the RLM metrics.

`StepwiseRLMTrainer` (on TRL's ``GRPOTrainer``) calls these on each generation batch; on TRL's asynchronous trainer
the rollout worker calls `StepwiseRLM.rollout` on each run, which calls the same five (the roots' final answers
scored by the worker's reward functions). `StepwiseRLM.from_arguments` builds it from a `StepwiseArguments` config
for both, checking the sandbox the same way (the asynchronous trainer also warns when REPLs can reach its served policy,
`warn_run_exposure`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..jsonl import written_after
from ..rollouts import RolloutMethod, RolloutRuntime, group_metrics, population_std
from ..samples import TrainingSample
from ..text import last_user_text
from .engine import RLMEngine, RLMTask
from .generators import CanonicalOrderGenerator, Generator
from .metrics import rollout_metrics
from .sandbox import isolation_report, resolve_isolation
from .scaffold import RLMScaffoldConfig
from .stats import EngineStats
from .tree import RolloutTree, TurnSample
from .tree_files import TREES_FOLDER, TreeFile, next_run, save_trees, tree_file

logger = logging.getLogger(__name__)

__all__ = ["StepwiseRLM", "answered_rewards", "rollout_metrics"]


def answered_rewards(rewards: torch.Tensor, answered: torch.Tensor) -> torch.Tensor:
    """``rewards`` ``(N, ...)`` with every row of a root that never answered (``answered`` ``(N,)`` False) set to 0,
    in place (docs/rlm_scaffold.md: a root without an answer gets 0 whatever the reward functions make of "")."""
    rewards[~answered.to(device=rewards.device, dtype=torch.bool)] = 0.0
    return rewards


class StepwiseRLM(RolloutMethod):
    """The stepwise RLM method of one trainer (module docstring).

    Args:
        scaffold: the RLM scaffold and sandbox settings.
        tokenizer: the policy's tokenizer.
        context_column: the dataset column with each task's REPL context (absent: the prompt is the context).
        train_children, child_sampling: which nodes are trained (`trl_ext.advantages.trained_node_weights`).
        trees_dir: the folder the tree files go to (None: not written).
        chat_template_kwargs: for the engine's ``apply_chat_template`` (e.g. ``enable_thinking``).
        weighted: the "subtree" normalisation (``rlm_loss_normalization="subtree"``): samples carry ``W(v)/n_v``.
        seed: seeds the asynchronous runs' ``child_sampling="one"`` draws.

    Attributes:
        last_trees: the trees of the last asynchronous run (for inspection).
    """

    name = "RLM"
    metric_prefix = "rlm"
    in_flight = "an engine run is still going"

    def __init__(
        self,
        scaffold: RLMScaffoldConfig,
        tokenizer: Any,
        *,
        context_column: str = "context",
        train_children: bool = True,
        child_sampling: str = "all",
        trees_dir: str | os.PathLike[str] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        weighted: bool = True,
        seed: int = 0,
    ) -> None:
        self.scaffold, self.tokenizer = scaffold, tokenizer
        self.context_column = context_column
        self.train_children, self.child_sampling = train_children, child_sampling
        self.trees_dir = None if trees_dir is None else Path(trees_dir)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.weighted = weighted
        self.last_trees: list[RolloutTree] = []
        self._rng = random.Random(seed)
        self._runs: int | None = None  # the next asynchronous run's number (past the folder's files, on first use)

    @classmethod
    def from_arguments(cls, args: Any, tokenizer: Any) -> tuple[StepwiseRLM, Any]:
        """The method of a `StepwiseArguments` config (trees under ``<output_dir>/rlm_trees`` with
        ``save_rollout_trees``) and its sandbox's isolation report. The sandbox is checked now:
        ``isolation="strict"`` fails here, ``"auto"`` warns once if weaker."""
        scaffold = args.scaffold_config()
        resolve_isolation(scaffold.sandbox)
        method = cls(
            scaffold,
            tokenizer,
            context_column=args.context_column,
            train_children=args.train_children,
            child_sampling=args.child_sampling,
            trees_dir=os.path.join(args.output_dir, TREES_FOLDER) if args.save_rollout_trees else None,
            chat_template_kwargs=getattr(args, "chat_template_kwargs", None),
            weighted=args.rlm_loss_normalization == "subtree",
            seed=args.seed,
        )
        return method, isolation_report(scaffold.sandbox)

    def cap_prompts(self, cap: int | None) -> None:
        """Cap every turn's prompt at ``cap`` tokens where the scaffold sets no ``max_prompt_tokens`` (the model's
        positions minus ``max_completion_length``, known once the model is loaded)."""
        if self.scaffold.max_prompt_tokens is None and cap is not None:
            self.scaffold = dataclasses.replace(self.scaffold, max_prompt_tokens=cap)

    def tasks(self, prompts: Sequence[Any], contexts: Sequence[Any]) -> list[RLMTask]:
        """One root task per prompt (text or chat messages: its last user message) and its context (None: the prompt
        is the context)."""
        return [
            RLMTask(prompt=last_user_text(prompt), context=context)
            for prompt, context in zip(prompts, contexts, strict=True)
        ]

    def contexts(self, rows: Sequence[dict[str, Any]]) -> list[Any]:
        """Each row's context (the ``context_column``; None where absent)."""
        return [row.get(self.context_column) for row in rows]

    def rollouts(self, generator: Generator, tasks: Sequence[RLMTask]) -> tuple[list[RolloutTree], EngineStats]:
        """One tree per task from one engine run, with the engine's counters. The sampler's requests arrive in the
        order REPL cells finish; `CanonicalOrderGenerator` sorts them, so the trees are a function of the seed."""
        engine = RLMEngine(
            CanonicalOrderGenerator(generator),
            self.tokenizer,
            self.scaffold,
            chat_template_kwargs=self.chat_template_kwargs,
        )
        return engine.run(list(tasks)), engine.stats

    def turn_samples(self, tree: RolloutTree, rng: random.Random | None = None) -> list[TurnSample]:
        """What ``tree`` trains on: every turn with an action of every trained node (``rng``: the
        ``child_sampling="one"`` draws)."""
        return tree.turn_samples(train_children=self.train_children, child_sampling=self.child_sampling, rng=rng)

    @staticmethod
    def training_samples(
        tree: RolloutTree,
        turns: Sequence[TurnSample],
        *,
        advantage: float = 0.0,
        group_id: int = 0,
        metrics: Mapping[str, Any] | None = None,
    ) -> list[TrainingSample]:
        """One `TrainingSample` per trained turn of ``tree`` (``turns``: `turn_samples`), in their order: prompt = the
        exact ids the sampler saw, completion = the action with its log-probs, the root's ``advantage``, the node's
        ``W(v)`` and ``n_v`` and the sample's share of the root (``W(v)/n_v · |action| / Σ_u W(u)``), ``metrics``
        copied into each; the task and the root's answer as prompt and completion."""
        tree_mass = sum({turn.node: turn.weight for turn in turns}.values())  # Σ_u W(u) over the trained nodes
        samples = []
        for turn in turns:
            token_weight = turn.weight / turn.node_tokens
            samples.append(
                TrainingSample(
                    prompt_ids=list(turn.prompt_ids),
                    completion_ids=list(turn.action_ids),
                    logprobs=list(turn.logprobs),
                    advantage=advantage,
                    group_id=group_id,
                    node_weight=turn.weight,
                    node_tokens=turn.node_tokens,
                    root_share=token_weight * len(turn.action_ids) / tree_mass,
                    metrics=dict(metrics or {}),
                    prompt=tree.root.task,
                    completion=tree.final_answer or "",
                )
            )
        return samples

    def save_trees(self, trees: Sequence[RolloutTree], mode: str, version: int, writer: str) -> list[str]:
        """Append ``trees`` to their file (`trl_ext.rlm.tree_files`: ``mode``, the policy ``version``, the ``writer``);
        one ``path#line`` reference (0-based line) per tree, or ``"not saved: <reason>"`` per tree when the file
        cannot be written (a warning; training goes on). Nothing is written without a ``trees_dir``."""
        if self.trees_dir is None:
            return []
        path = tree_file(self.trees_dir, mode, version, writer)
        try:
            start = save_trees(path, trees, self.tokenizer)
        except OSError as error:
            logger.warning("Rollout trees not saved to %s (training goes on): %s", path, error)
            reason = os.strerror(error.errno) if error.errno else type(error).__name__
            return [f"not saved: {reason}"] * len(trees)
        return [f"{path}#{start + index}" for index in range(len(trees))]

    def discard_records_after(self, step: int, writer: str) -> None:
        """Delete ``writer``'s tree files of the steps after ``step`` (a resumed run writes them again)."""
        folder = self.trees_dir
        removed = 0
        for path in sorted(folder.glob(f"*-{writer}.jsonl")) if folder is not None and folder.is_dir() else ():
            parsed = TreeFile.parse(path.name)
            if parsed is not None and written_after(parsed.mode, parsed.version, step):
                path.unlink()
                removed += 1
        if removed:
            logger.info(
                "Removed %d rollout-tree file(s) of steps after %d from %s (redone now).", removed, step, folder
            )

    # ------------------------------------------------------------------------------ one asynchronous run
    def rollout(self, rows: Sequence[dict[str, Any]], runtime: RolloutRuntime, version: int) -> list[TrainingSample]:
        """``num_generations`` trees per row from one engine run (children included, ``rlm_query_batched`` batched),
        written to ``train-v<version>-run<run>.jsonl`` before they are scored (the run numbers continue past the
        folder's files, so a resumed run never adds to an earlier run's file); each root's final answer scored as its
        completion (`answered_rewards`), the group advantage, and one sample per trained turn
        (`training_samples`)."""
        if self._runs is None:
            self._runs = next_run(self.trees_dir)
        run, self._runs = self._runs, self._runs + 1
        size = runtime.num_generations
        roots = [row for row in rows for _ in range(size)]
        trees, stats = self.rollouts(
            runtime.policy, self.tasks([row["prompt"] for row in roots], self.contexts(roots))
        )
        self.last_trees = trees
        self.save_trees(trees, "train", version, f"run{run:06d}")
        samples: list[TrainingSample] = []
        for index, row in enumerate(rows):
            samples += self._group_samples(row, trees[index * size : (index + 1) * size], runtime)
        runtime.push_metrics(rollout_metrics(trees, stats, len(samples)))
        return samples

    def _group_samples(
        self, row: dict[str, Any], trees: list[RolloutTree], runtime: RolloutRuntime
    ) -> list[TrainingSample]:
        """One group's samples: the roots' final answers (``""`` when none) scored as completions, as the
        synchronous trainer scores them (with ``rlm_has_answer``)."""
        answers = [tree.final_answer for tree in trees]
        texts = [answer or "" for answer in answers]
        ids = [list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
        answered = [answer is not None for answer in answers]
        per_func = runtime.call_rewards(row, texts, ids, rlm_has_answer=answered)
        summed = torch.tensor(runtime.summed_rewards(per_func), dtype=torch.float64)
        rewards = answered_rewards(summed, torch.tensor(answered)).tolist()
        advantages = self.group_advantages(rewards, runtime)
        reward_std = population_std(rewards)
        group_id = runtime.next_group_id()
        samples = []
        for index, (tree, advantage, reward) in enumerate(zip(trees, advantages, rewards, strict=True)):
            samples += self.training_samples(
                tree,
                self.turn_samples(tree, self._rng),
                advantage=advantage,
                group_id=group_id,
                metrics=group_metrics(index, reward, reward_std, runtime.reward_func_names, per_func),
            )
        return samples
