"""`benchmarks/uneven_trees.py`'s mechanics: the uneven toy data really yields rollout trees whose children counts
differ widely, and the "subtree" loss weights the trainer gets from them (`RolloutTree.turn_samples`,
`stepwise_loss_weights`) are what the 1/k_g formula says, while a plain token mean lets the big trees and the children
dominate.

In the study (benchmarks/RESULTS.md, "uneven_trees") "subtree" came out ahead on every seed measured, but by less
than two standard errors of each seed's evaluation, and only a 25-minute run shows it; so this test asserts no
direction of the result. It checks what makes the comparison meaningful, on trees the scripted teacher plays through
the real scaffold and REPLs."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from trl_ext.advantages import stepwise_loss_weights
from trl_ext.quickstart import QuickstartSettings
from trl_ext.quickstart.toy_task import TOY_OUTPUT_CHARS, ToyTeacher, classify_root, make_toy_dataset, parts_reward
from trl_ext.rlm import RLMTask

from .test_quickstart import teacher_engine

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import uneven_trees  # noqa: E402


def _teacher_trees(teacher: ToyTeacher, dataset, max_children: int = QuickstartSettings.max_children) -> list:
    """The teacher plays every node of every task through `RLMEngine` and real REPLs, in the toy scaffold of the
    quickstart's settings with ``max_children``."""
    engine = teacher_engine(teacher, QuickstartSettings(max_children=max_children))
    return engine.run([RLMTask(row["prompt"], row["context"]) for row in dataset])


def _subtree_loss(tree, node_loss: dict[int, float], node: int = 0) -> float:
    """L_subtree(v) = L_node(v) + (1/k_v) Σ_c L_subtree(c), straight from the definition."""
    children = tree.nodes[node].children
    below = sum(_subtree_loss(tree, node_loss, c) for c in children) / len(children) if children else 0.0
    return node_loss[node] + below


@pytest.mark.slow
def test_uneven_data_gives_uneven_trees_and_the_1_over_k_weights_even_them_out():
    dataset = make_toy_dataset(16, seed=0, parts_counts=uneven_trees.PARTS_COUNTS)
    parts = [len(context) for context in dataset["context"]]
    assert set(parts) == set(uneven_trees.PARTS_COUNTS)
    # a root can print a one-part context whole (cut at TOY_OUTPUT_CHARS), never a longer one
    assert all((len(str(context)) <= TOY_OUTPUT_CHARS) == (len(context) == 1) for context in dataset["context"])
    delegating = ToyTeacher(delegate_fraction=1.0, compute_fraction=1.0, shortcut_fraction=0.0, seed=0)

    # the quickstart's scaffold refuses a delegation to more than 4 children: the study must raise the limit
    refused = _teacher_trees(delegating, dataset)
    assert [len(t.root.children) for t in refused] == [n if n <= 4 else 0 for n in parts]
    trees = _teacher_trees(delegating, dataset, max_children=uneven_trees.MAX_CHILDREN)
    assert [len(t.root.children) for t in trees] == parts  # 1, 2, 5 or 6 children
    assert parts_reward([t.final_answer for t in trees], dataset["answer"]) == [1.0] * len(parts)
    assert [uneven_trees.tree_parts(t) for t in trees] == parts

    readers = _teacher_trees(ToyTeacher(delegate_fraction=0.0, seed=0), dataset)
    assert all(classify_root(t) == "read" and len(t.nodes) == 1 for t in readers)
    assert parts_reward([t.final_answer for t in readers], dataset["answer"]) == [1 / n for n in parts]

    # a batch as the trainer sees it: every turn of every node a row, with its node's W(v) and n_v
    batch = trees + readers
    rows = [(g, sample) for g, tree in enumerate(batch) for sample in tree.turn_samples()]
    width = max(len(s.action_ids) for _, s in rows)
    mask = torch.tensor([[1.0] * len(s.action_ids) + [0.0] * (width - len(s.action_ids)) for _, s in rows])
    num_tokens = mask.sum()
    weights = stepwise_loss_weights(
        torch.tensor([s.weight for _, s in rows]),
        torch.tensor([s.node_tokens for _, s in rows]),
        mask,
        num_roots=len(batch),
        num_tokens=num_tokens,
    )
    root_of = torch.tensor([g for g, _ in rows])
    subtree_mass = torch.zeros(len(batch)).index_add_(0, root_of, weights.sum(1)) * len(batch) / num_tokens
    token_mass = torch.zeros(len(batch)).index_add_(0, root_of, mask.sum(1))
    # "subtree": every root weighs 1 and its children together 1, whatever their number
    expected = [2.0] * len(trees) + [1.0] * len(readers)
    assert subtree_mass.tolist() == pytest.approx(expected)
    for tree in trees:
        k = len(tree.root.children)
        assert tree.weights() == pytest.approx([1.0] + [1.0 / k] * k)
    # "token": a tree weighs its action tokens, so a six-child tree outweighs a reading root many times over
    six = [g for g, n in enumerate(parts) if n == 6]
    one = [g for g, n in enumerate(parts) if n == 1]
    reader_tokens = token_mass[len(trees) :]
    assert min(token_mass[g] for g in six) > 4 * max(reader_tokens)
    assert min(token_mass[g] for g in six) > 2.5 * max(token_mass[g] for g in one)

    # the weighted token sum, divided as the loss divides it, is mean_g L_subtree(root_g) for any per-token losses
    rng = random.Random(0)
    losses = torch.tensor([[rng.uniform(-1, 1) for _ in range(width)] for _ in rows]) * mask
    node_loss: dict[tuple[int, int], float] = {}
    for (g, sample), row_loss, n in zip(rows, losses, mask.sum(1)):
        node_loss[g, sample.node] = node_loss.get((g, sample.node), 0.0) + float(row_loss.sum()) / sample.node_tokens
        assert n <= sample.node_tokens
    by_definition = sum(
        _subtree_loss(tree, {v: node_loss[g, v] for v in range(len(tree.nodes))}) for g, tree in enumerate(batch)
    ) / len(batch)
    assert float((weights * losses).sum() / num_tokens) == pytest.approx(by_definition, rel=1e-5)

    # what the study reports: the children's share of the tokens far above their share of the 1/k_g weight
    shares = uneven_trees.weight_shares(batch)
    assert shares["children_weight_share"] == pytest.approx(len(trees) / (len(batch) + len(trees)))
    assert shares["children_token_share"] > shares["children_weight_share"] + 0.2
    many = sum(n >= uneven_trees.MANY_PARTS for n in parts)
    assert shares["many_weight_share"] == pytest.approx(3 * many / (len(batch) + len(trees)))
    assert shares["many_token_share"] > shares["many_weight_share"]
