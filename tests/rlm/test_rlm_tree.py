"""Rollout trees: 1/k subtree weights, pre-order numbering, samples and JSON."""

from __future__ import annotations

import json

import pytest

from trl_ext.rlm import LLMCall, ReplResult, RolloutNode, RolloutTree, Turn, canonical_rollout_order, subtree_weights
from trl_ext.rlm.tree import preorder
from trl_ext.testing import build_tiny_tokenizer


def test_subtree_weights_on_an_uneven_tree():
    #        0
    #      / | \
    #     1  2  3          k_0 = 3
    #    / \     \
    #   4   5     6        k_1 = 2, k_3 = 1
    #   |
    #   7                  k_4 = 1
    parents = [None, 0, 0, 0, 1, 1, 3, 4]
    expected = [1, 1 / 3, 1 / 3, 1 / 3, 1 / 6, 1 / 6, 1 / 3, 1 / 6]
    assert subtree_weights(parents) == pytest.approx(expected)


def test_subtree_weights_of_a_forest_in_any_order():
    # two roots (3 and 5), nodes listed children-first
    parents = [3, 3, 0, None, 3, None, 5, 5, 5, 5]
    weights = subtree_weights(parents)
    assert weights == pytest.approx([1 / 3, 1 / 3, 1 / 3, 1.0, 1 / 3, 1.0, 0.25, 0.25, 0.25, 0.25])
    assert subtree_weights([]) == []
    assert subtree_weights([None]) == [1.0]


def test_children_of_a_node_share_its_weight():
    parents = [None, 0, 0, 1, 1, 1, 2, 3, 3]
    weights = subtree_weights(parents)
    for node in range(len(parents)):
        children = [child for child, parent in enumerate(parents) if parent == node]
        if children:
            assert sum(weights[child] for child in children) == pytest.approx(weights[node])


@pytest.mark.parametrize(
    ("parents", "error", "message"),
    [
        ([None, 2], ValueError, r"parents\[1\] = 2 is not a node index in \[0, 2\)"),
        ([None, -1], ValueError, "is not a node index"),
        ([None, 1], ValueError, "cannot be its own parent"),
        ([None, 2, 3, 1], ValueError, r"cycle through nodes \[1, 2, 3\]"),
        ([1, 0], ValueError, "cycle"),
        ([None, True], TypeError, "must be a node index or None"),
        ([None, "0"], TypeError, "must be a node index or None"),
    ],
)
def test_subtree_weights_rejects_bad_input(parents, error, message):
    with pytest.raises(error, match=message):
        subtree_weights(parents)


def _turn(prompt: list[int], action: str, children: list[int] | None = None) -> Turn:
    return Turn(prompt, [5, 6, 2], [-0.5, -0.25, -0.125], action, children=children or [])


def test_preorder_renumbers_concurrent_spawns_deterministically():
    # created in the order root, A, B, B's child, A's child (B's child was created first)
    root = RolloutNode(0, None, 0, "root", turns=[_turn([1], "spawn", [1, 2])], children=[1, 2])
    a = RolloutNode(1, 0, 1, "A", turns=[_turn([2], "a", [4])], children=[4], spawned_at=(0, 0))
    b = RolloutNode(2, 0, 1, "B", turns=[_turn([3], "b", [3])], children=[3], spawned_at=(0, 0))
    b_child = RolloutNode(3, 2, 2, "B.1", spawned_at=(0, 0))
    a_child = RolloutNode(4, 1, 2, "A.1", spawned_at=(0, 0))
    tree = preorder([root, a, b, b_child, a_child])
    assert [node.task for node in tree.nodes] == ["root", "A", "A.1", "B", "B.1"]
    assert tree.parents() == [None, 0, 1, 0, 3]
    assert tree.nodes[0].children == [1, 3] and tree.nodes[0].turns[0].children == [1, 3]
    assert tree.nodes[1].turns[0].children == [2] and tree.nodes[3].children == [4]
    assert tree.weights() == pytest.approx([1, 0.5, 0.5, 0.5, 0.5])


def _example_tree() -> RolloutTree:
    root = RolloutNode(
        0, None, 0, "Sum it.", "a str of 3 characters", children=[1], final_answer="7", end_reason="final_answer"
    )
    root.turns = [
        Turn(
            [1, 10, 11],
            [20, 21, 2],
            [-1.0, -0.5, -0.25],
            "```repl\nx = rlm_query('half')\n```",
            code="x = rlm_query('half')",
            repl_result=ReplResult(stdout=""),
            observation="REPL output:\n(no output)",
            children=[1],
            llm_calls=[LLMCall("p", [1, 3], [4, 2], [-0.1, -0.2], "c", 0)],
        ),
        Turn([1, 12], [22, 2], [-0.3, -0.1], "FINAL(7)"),
    ]
    child = RolloutNode(
        1,
        0,
        1,
        "half",
        turns=[Turn([1, 13], [23, 2], [-0.7, -0.01], "FINAL(3)")],
        final_answer="3",
        end_reason="final_answer",
        spawned_at=(0, 0),
    )
    return RolloutTree([root, child])


def test_turn_samples_carry_exact_ids_and_weights():
    tree = _example_tree()
    samples = tree.turn_samples()
    assert [(s.node, s.turn, s.depth, s.weight) for s in samples] == [(0, 0, 0, 1.0), (0, 1, 0, 1.0), (1, 0, 1, 1.0)]
    assert samples[0].prompt_ids == [1, 10, 11] and samples[0].action_ids == [20, 21, 2]
    assert samples[2].logprobs == [-0.7, -0.01]
    assert tree.final_answer == "7"


def test_json_round_trip_and_decoded_text():
    tree = _example_tree()
    assert RolloutTree.from_json(tree.to_json()) == tree
    tokenizer = build_tiny_tokenizer()
    data = json.loads(tree.to_json(tokenizer=tokenizer))
    first = data["nodes"][0]["turns"][0]
    assert first["prompt_text"] == tokenizer.decode([1, 10, 11], skip_special_tokens=False)
    assert list(first)[:6] == ["turn", "prompt_text", "action", "code", "repl_result", "observation"]
    assert first["llm_calls"][0]["completion"] == "c" and data["final_answer"] == "7"
    assert RolloutTree.from_dict(data) == tree  # decoded text is for reading only


def test_tree_validation():
    with pytest.raises(ValueError, match="at least its root"):
        RolloutTree([])
    with pytest.raises(ValueError, match="ids must equal their positions"):
        RolloutTree([RolloutNode(3, None, 0, "t")])
    with pytest.raises(ValueError, match="only root"):
        RolloutTree([RolloutNode(0, None, 0, "t"), RolloutNode(1, None, 0, "u")])


def test_canonical_rollout_order_sorts_within_each_example_only():
    from types import SimpleNamespace

    def tree(*actions, logprob=-0.5):
        turns = [SimpleNamespace(action_ids=a, logprobs=[logprob] * len(a)) for a in actions]
        return SimpleNamespace(nodes=[SimpleNamespace(turns=turns)])

    trees = [tree([5], [1]), tree([2]), tree([9]), tree([1, 1])]
    inputs = [{"prompt": "p", "context": "a"}, {"prompt": "p", "context": "b"}] * 2  # examples a, b, a, b
    order = canonical_rollout_order(trees, inputs, "context")
    assert order == [0, 3, 2, 1]  # a: [5],[1] < [9]; b: [1, 1] < [2]
    assert [inputs[i]["context"] for i in order] == [row["context"] for row in inputs]
    assert canonical_rollout_order(trees, inputs[:2], "context") == [0, 1, 2, 3]  # misaligned: left alone

    # Twins: the same tokens, log-probs that differ in the last bits (another row of the batched generation). Either
    # arrival order gives the same batch.
    twins = [tree([7], logprob=-0.25000003), tree([7], logprob=-0.25)]
    same = [{"prompt": "p", "context": "a"}] * 2
    assert [twins[i] for i in canonical_rollout_order(twins, same, "context")] == [twins[0], twins[1]]
    swapped = twins[::-1]
    assert [swapped[i] for i in canonical_rollout_order(swapped, same, "context")] == [twins[0], twins[1]]
