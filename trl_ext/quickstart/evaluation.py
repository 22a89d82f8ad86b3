"""Held-out evaluation on the toy task: a disjoint evaluation set (`held_out_eval_set`) and the exact-match reward,
answer rate and strategy shares of a policy's RLM rollouts on it (`evaluate_policy` -> `EvalResult`).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .settings import QuickstartSettings, toy_scaffold_config


@dataclass
class EvalResult:
    """Held-out evaluation of one policy: RLM rollouts of every eval task, ``samples`` times each."""

    reward: float
    rollouts: int
    final_answer_rate: float
    turns_mean: float
    children_mean: float
    strategies: dict[str, float]
    trees_file: str | None = None


def held_out_eval_set(num_examples: int, seed: int, exclude: Sequence[str]) -> Any:
    """``num_examples`` toy tasks whose contexts are not in ``exclude`` (the SFT and RL data)."""
    from .toy_task import make_toy_dataset

    seen = set(exclude)
    candidates = make_toy_dataset(2 * num_examples + 16, seed=seed + 10_007)
    keep = [i for i, context in enumerate(candidates["context"]) if context not in seen][:num_examples]
    return candidates.select(keep)


def evaluate_policy(
    model: Any,
    tokenizer: Any,
    eval_set: Any,
    settings: QuickstartSettings,
    trees_file: Path | None = None,
    progress: bool = False,
    description: str = "eval",
    chunk_size: int = 64,
) -> EvalResult:
    """Held-out reward of ``model`` on the toy task: ``settings.eval_samples`` RLM rollouts per task, exact match.

    Sampling uses the RL temperature and is seeded (``settings.seed``) and order-independent, so the SFT-only and
    the RL policy are evaluated on the same draws of the random number generator.
    """
    import torch

    from trl_ext.rlm import CanonicalOrderGenerator, RLMEngine, RLMTask, TransformersGenerator

    from .toy_task import classify_strategy, exact_match_reward

    tasks = [
        RLMTask(prompt=row["prompt"], context=row["context"]) for row in eval_set for _ in range(settings.eval_samples)
    ]
    answers = [row["answer"] for row in eval_set for _ in range(settings.eval_samples)]
    generator = CanonicalOrderGenerator(
        TransformersGenerator(
            model, tokenizer, max_new_tokens=settings.max_completion_length, temperature=settings.temperature
        )
    )
    engine = RLMEngine(generator, tokenizer, toy_scaffold_config(settings))
    was_training = model.training
    model.eval()
    trees = []
    bar = _progress_bar(len(tasks), description, progress)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(settings.seed + 1)
            for start in range(0, len(tasks), chunk_size):
                chunk = tasks[start : start + chunk_size]
                trees.extend(engine.run(chunk))
                bar.update(len(chunk))
    finally:
        bar.close()
        model.train(was_training)
    rewards = exact_match_reward([tree.final_answer or "" for tree in trees], answers)
    rewards = [r if tree.final_answer is not None else 0.0 for r, tree in zip(rewards, trees)]
    strategies = Counter(classify_strategy(tree) for tree in trees)
    if trees_file is not None:
        trees_file.parent.mkdir(parents=True, exist_ok=True)
        with trees_file.open("w", encoding="utf-8") as handle:
            for tree, answer, reward in zip(trees, answers, rewards):
                record = {"answer": answer, "reward": reward, "tree": tree.to_dict(tokenizer)}
                handle.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    return EvalResult(
        reward=sum(rewards) / len(rewards),
        rollouts=len(trees),
        final_answer_rate=sum(tree.final_answer is not None for tree in trees) / len(trees),
        turns_mean=statistics.fmean(len(tree.root.turns) for tree in trees),
        children_mean=statistics.fmean(len(tree.nodes) - 1 for tree in trees),
        strategies={name: count / len(trees) for name, count in sorted(strategies.items())},
        trees_file=None if trees_file is None else str(trees_file),
    )


def _progress_bar(total: int, description: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, unit="rollout", disable=not enabled, leave=False)
