"""Held-out evaluation on the toy task: a disjoint evaluation set (`held_out_eval_set`) and the reward, answer rate,
strategy shares and children of a policy's RLM rollouts on it (`evaluate_policy` -> `EvalResult`).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .settings import QuickstartSettings, toy_scaffold_config


@dataclass
class EvalResult:
    """Held-out evaluation of one policy: RLM rollouts of every eval task, ``samples`` times each.

    ``reward``: mean `parts_reward` (0 for a root without an answer); ``strategies``: shares of the roots'
    strategies (`classify_root`); ``children_mean``: children per root; ``child_answer_rate``: the share of children
    that gave a final answer; ``child_correct_rate``: the share whose answer is the value of their part (the i-th
    child of a root is held to the i-th part, the order in which a delegating root passes them); ``child_strategies``:
    shares of the children's strategies (`classify_child`); ``child_token_share``: the children's share of all action
    tokens (how much of a stepwise batch the children are). The child figures are None when no child was started.
    """

    reward: float
    rollouts: int
    final_answer_rate: float
    turns_mean: float
    children_mean: float
    strategies: dict[str, float]
    child_answer_rate: float | None = None
    child_correct_rate: float | None = None
    child_strategies: dict[str, float] = field(default_factory=dict)
    child_token_share: float | None = None
    trees_file: str | None = None


def held_out_eval_set(
    num_examples: int, seed: int, exclude: Sequence[str], parts_counts: Sequence[int] | None = None
) -> Any:
    """``num_examples`` toy tasks whose contexts are not in ``exclude`` (the SFT and RL data); ``parts_counts`` as
    `make_toy_dataset`'s."""
    from .toy_task import make_toy_dataset

    seen = {tuple(context) for context in exclude}
    candidates = make_toy_dataset(2 * num_examples + 16, seed=seed + 10_007, parts_counts=parts_counts)
    keep = [i for i, context in enumerate(candidates["context"]) if tuple(context) not in seen][:num_examples]
    return candidates.select(keep)


def evaluate_policy(
    model: Any,
    tokenizer: Any,
    eval_set: Any,
    settings: QuickstartSettings,
    trees_file: Path | None = None,
    progress: bool = False,
    description: str = "eval",
    chunk_size: int = 32,
) -> EvalResult:
    """Held-out reward of ``model`` on the toy task: ``settings.eval_samples`` RLM rollouts per task, `parts_reward`.

    Sampling uses the RL temperature and is seeded (``settings.seed``) and order-independent, so the SFT-only and
    the RL policy are evaluated on the same draws of the random number generator. ``chunk_size`` rollouts run at
    once: every live root and child holds a REPL interpreter, so it bounds the interpreters alive (and the memory).
    """
    import torch

    from trl_ext.rlm import CanonicalOrderGenerator, RLMEngine, RLMTask, TransformersGenerator

    from .toy_task import classify_child, classify_root, expected_parts, parts_reward

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
    rewards = parts_reward([tree.final_answer or "" for tree in trees], answers)
    rewards = [r if tree.final_answer is not None else 0.0 for r, tree in zip(rewards, trees)]
    strategies = Counter(classify_root(tree) for tree in trees)
    children = []  # (child node, the value of the part it is held to)
    for tree, answer in zip(trees, answers):
        values = expected_parts(answer)
        for index, child in enumerate(tree.root.children):
            children.append((tree.nodes[child], values[index] if index < len(values) else None))
    child_strategies = Counter(classify_child(node) for node, _ in children)
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
        child_answer_rate=_share(node.final_answer is not None for node, _ in children),
        child_correct_rate=_share(
            node.final_answer is not None and node.final_answer.strip() == value for node, value in children
        ),
        child_strategies={name: count / len(children) for name, count in sorted(child_strategies.items())},
        child_token_share=_child_token_share(trees) if children else None,
        trees_file=None if trees_file is None else str(trees_file),
    )


def _child_token_share(trees: Sequence[Any]) -> float:
    tokens = [(node.depth > 0, len(turn.action_ids)) for tree in trees for node in tree.nodes for turn in node.turns]
    return sum(n for is_child, n in tokens if is_child) / max(1, sum(n for _, n in tokens))


def _share(flags: Any) -> float | None:
    flags = list(flags)
    return sum(flags) / len(flags) if flags else None


def _progress_bar(total: int, description: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, unit="rollout", disable=not enabled, leave=False)
