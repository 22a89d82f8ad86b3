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

`StepwiseRLMTrainer` (on TRL's ``GRPOTrainer``) calls it on each generation batch, the asynchronous
`RLMRolloutWorker` on each worker run; `StepwiseRLM.from_arguments` builds it from a `StepwiseArguments` config for
both, checking the sandbox the same way (the asynchronous trainer also warns when REPLs can reach its served policy,
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

from ..samples import TrainingSample
from ..text import last_user_text
from .engine import RLMEngine, RLMTask
from .generators import CanonicalOrderGenerator, Generator
from .metrics import rollout_metrics
from .sandbox import isolation_report, resolve_isolation
from .scaffold import RLMScaffoldConfig
from .stats import EngineStats
from .tree import RolloutTree, TurnSample
from .tree_files import TREES_FOLDER, save_trees, tree_file

logger = logging.getLogger(__name__)

__all__ = ["StepwiseRLM", "answered_rewards", "rollout_metrics"]


def answered_rewards(rewards: torch.Tensor, answered: torch.Tensor) -> torch.Tensor:
    """``rewards`` ``(N, ...)`` with every row of a root that never answered (``answered`` ``(N,)`` False) set to 0,
    in place (docs/rlm_scaffold.md: a root without an answer gets 0 whatever the reward functions make of "")."""
    rewards[~answered.to(device=rewards.device, dtype=torch.bool)] = 0.0
    return rewards


class StepwiseRLM:
    """The stepwise RLM method of one trainer (module docstring).

    Args:
        scaffold: the RLM scaffold and sandbox settings.
        tokenizer: the policy's tokenizer.
        context_column: the dataset column with each task's REPL context (absent: the prompt is the context).
        train_children, child_sampling: which nodes are trained (`trl_ext.advantages.trained_node_weights`).
        trees_dir: the folder the tree files go to (None: not written).
        chat_template_kwargs: for the engine's ``apply_chat_template`` (e.g. ``enable_thinking``).
    """

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
    ) -> None:
        self.scaffold, self.tokenizer = scaffold, tokenizer
        self.context_column = context_column
        self.train_children, self.child_sampling = train_children, child_sampling
        self.trees_dir = None if trees_dir is None else Path(trees_dir)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

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
