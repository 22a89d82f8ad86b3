"""Rollout trees: 1/k subtree weights, pre-order numbering, samples and JSON."""

from __future__ import annotations

import json
import random

import pytest

from trl_ext.rlm import LLMCall, ReplResult, RolloutNode, RolloutTree, Turn, canonical_rollout_order, subtree_weights
from trl_ext.rlm.tree import expand_prompts, preorder
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


def _growing_node(tokenizer, turns: int, observation_words: int, seed: int = 0) -> RolloutNode:
    """A node whose prompts are rendered as the engine renders them: the system prompt, every earlier (action,
    observation) pair, then a closing user message rebuilt every turn. Each observation holds ``observation_words``
    words that the tiny tokenizer keeps whole ("Ġassistant" is one token), so that the JSON of the ids weighs less
    than their text and a size bound measures how often the text is repeated, not the digits of the ids."""
    rng = random.Random(seed)
    history: list[dict[str, str]] = []
    node = RolloutNode(0, None, 0, "Read it.", "a str of 9 characters", end_reason="max_turns")
    for index in range(turns):
        closing = {"role": "user", "content": f"Task: Read it.\n\nTurn {index + 1} of {turns}."}
        messages = [{"role": "system", "content": "You write Python."}, *history, closing]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        action = f"```repl\nprint(context[{index}])\n```"
        observation = "REPL output:\n" + "".join(
            rng.choice([" assistant", " response", " answer"]) for _ in range(observation_words)
        )
        action_ids = list(tokenizer(action, add_special_tokens=False)["input_ids"]) + [2]
        node.turns.append(
            Turn(
                list(tokenizer(text, add_special_tokens=False)["input_ids"]),
                action_ids,
                [-0.5] * len(action_ids),
                action,
                observation=observation if index < turns - 1 else None,
            )
        )
        history += [{"role": "assistant", "content": action}, {"role": "user", "content": observation}]
    return node


def test_later_turns_store_only_their_new_prompt_and_round_trip():
    tokenizer = build_tiny_tokenizer()
    root = _growing_node(tokenizer, turns=4, observation_words=30)
    root.children, root.turns[1].children = [1], [1]
    child = _growing_node(tokenizer, turns=3, observation_words=10, seed=1)
    child.id, child.parent, child.depth, child.spawned_at = 1, 0, 1, (1, 0)
    tree = RolloutTree([root, child])
    data = json.loads(tree.to_json(tokenizer=tokenizer))
    for node, stored in zip(tree.nodes, data["nodes"]):
        first, *later = stored["turns"]
        assert "prompt_ids_shared" not in first and "prompt_text_shared" not in first
        assert first["prompt_ids"] == node.turns[0].prompt_ids
        for index, turn in enumerate(later, start=1):
            previous, whole = node.turns[index - 1], node.turns[index]
            shared = turn["prompt_ids_shared"]
            assert 0 < shared < len(previous.prompt_ids) and turn["prompt_ids"] == whole.prompt_ids[shared:]
            assert whole.prompt_ids[:shared] == previous.prompt_ids[:shared]
            assert turn["prompt_text"].startswith("assistant\n```repl")  # the previous action, and what follows
            assert list(turn)[:4] == ["turn", "prompt_text_shared", "prompt_text", "action"]
    assert RolloutTree.from_dict(data) == tree
    assert RolloutTree.from_json(tree.to_json()) == tree  # without a tokenizer: ids only
    whole = expand_prompts(data)
    for node, stored in zip(tree.nodes, whole["nodes"]):
        for turn, turn_data in zip(node.turns, stored["turns"]):
            assert turn_data["prompt_ids"] == turn.prompt_ids
            assert turn_data["prompt_text"] == tokenizer.decode(turn.prompt_ids, skip_special_tokens=False)
            assert "prompt_ids_shared" not in turn_data and "prompt_text_shared" not in turn_data
    assert whole["final_answer"] == data["final_answer"] and data["nodes"][0]["turns"][1]["prompt_ids_shared"]


def test_a_tree_file_grows_with_the_text_not_with_the_square_of_the_turns():
    tokenizer = build_tiny_tokenizer()
    node = _growing_node(tokenizer, turns=6, observation_words=2_300)  # ~20,000 characters of observation a turn
    tree = RolloutTree([node])
    last_prompt = tokenizer.decode(node.turns[-1].prompt_ids, skip_special_tokens=False)
    text = len(last_prompt) + sum(len(turn.action) for turn in node.turns)
    assert text > 100_000
    line = json.dumps(tree.to_dict(tokenizer), ensure_ascii=False)  # as `append_jsonl` writes it
    assert len(line) < 3 * text
    # Whole prompts on every turn (the format before): each observation is written once per later turn.
    assert len(json.dumps(expand_prompts(tree.to_dict(tokenizer)), ensure_ascii=False)) > 5 * text
    assert RolloutTree.from_json(line) == tree


def test_prompts_that_do_not_extend_the_previous_one_round_trip():
    tokenizer = build_tiny_tokenizer()
    merged = list(tokenizer("answer answer", add_special_tokens=False)["input_ids"])
    by_byte = tokenizer.convert_tokens_to_ids(list("answer") + ["Ġ"] + list("answer"))
    assert merged != by_byte and tokenizer.decode(merged) == tokenizer.decode(by_byte) == "answer answer"
    prompts = [
        [1, 10, 11, 12, 13],
        [1, 10, 11, 12, 13, 14, 15],  # an extension: shares 5
        [1, 10, 20],  # a truncated, rebuilt prompt: shares 2, shorter than the previous one
        [30, 10, 20],  # nothing in common: stored whole
        [30, 10, 20],  # the same prompt again: shares all, stores no id
        [],  # an empty prompt
        [1, 40],
        merged,  # shares nothing with [1, 40]
        by_byte,  # the same text, other ids: shares the text, not the ids
    ]
    node = RolloutNode(0, None, 0, "t", turns=[_turn(prompt, f"a{index}") for index, prompt in enumerate(prompts)])
    tree = RolloutTree([node])
    for tokenizer_or_none in (tokenizer, None):
        data = json.loads(tree.to_json(tokenizer=tokenizer_or_none))
        turns = data["nodes"][0]["turns"]
        assert [turn.get("prompt_ids_shared") for turn in turns] == [None, 5, 2, None, 3, None, None, None, None]
        assert turns[1]["prompt_ids"] == [14, 15] and turns[2]["prompt_ids"] == [20] and turns[4]["prompt_ids"] == []
        assert turns[3]["prompt_ids"] == [30, 10, 20] and turns[5]["prompt_ids"] == []
        assert RolloutTree.from_dict(data) == tree
        whole = expand_prompts(data)["nodes"][0]["turns"]
        assert [turn["prompt_ids"] for turn in whole] == prompts
        if tokenizer_or_none is not None:
            assert turns[8]["prompt_text_shared"] == len("answer answer") and turns[8]["prompt_text"] == ""
            expected = [tokenizer.decode(prompt, skip_special_tokens=False) for prompt in prompts]
            assert [turn["prompt_text"] for turn in whole] == expected


@pytest.mark.parametrize(
    ("turn", "message"),
    [
        ({"prompt_ids_shared": 4, "prompt_ids": [9]}, "shares 4 of the previous turn's prompt_ids, which has 3"),
        ({"prompt_ids_shared": -1, "prompt_ids": [9]}, "shares -1"),
        ({"prompt_ids": [9], "prompt_text_shared": 2, "prompt_text": "x"}, "prompt_text, which has none"),
    ],
)
def test_a_damaged_shared_prefix_is_refused(turn, message):
    data = json.loads(RolloutTree([RolloutNode(0, None, 0, "t", turns=[_turn([1, 2, 3], "a")])]).to_json())
    data["nodes"][0]["turns"].append({**data["nodes"][0]["turns"][0], "prompt_ids": [], **turn})
    with pytest.raises(ValueError, match=message):
        RolloutTree.from_dict(data)


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
