"""Rollout trees: what one root RLM rollout produced, turn by turn, with the 1/k subtree weights (docs/stepwise_rlm.md).

A root rollout and every child it spawned through ``rlm_query``/``rlm_query_batched`` are the nodes of one
`RolloutTree`, listed in pre-order (a parent before its children, children in spawn order), so
``tree.nodes[0]`` is the root and ``tree.parents()[i] < i`` for every child ``i``.

What a trainer needs from a tree::

    tree.final_answer                      # the root's answer (None: no answer -> reward 0)
    for sample in tree.turn_samples():     # one training sample per turn of every node
        sample.prompt_ids                  # the exact token ids the generator was given for this turn
        sample.action_ids, sample.logprobs # the sampled action and its sampling log-probs (same length)
        sample.weight                      # W(node) = prod over ancestors a of 1/k_a (roots 1), docs/stepwise_rlm.md

``llm_query`` completions are recorded too (`Turn.llm_calls`, with ids and log-probs) but are not nodes and not
in `turn_samples`: they are single completions, and whether to train on them is the trainer's choice.

Tree files (``RolloutTree.to_dict``, one JSON line per tree) store each turn's new prompt text once. A turn's prompt
repeats the previous turn's (all but its closing user message, rebuilt every turn) and adds the previous action and
its REPL observation, so writing every prompt whole would grow the file with the square of the turns (a 6-turn
rollout printing 120,000 characters wrote 1.39 MB, 0.63 MB so). Turn ``i > 0`` of a node therefore stores only
what follows the longest common prefix of its prompt and turn ``i - 1``'s::

    "prompt_ids_shared": n     # its first n ids are the previous turn's first n ids ...
    "prompt_ids": [...]        # ... and these are the rest
    "prompt_text_shared": m    # the same in characters for the decoded text (with a tokenizer)
    "prompt_text": "..."       # the rest of the text: the previous action, the observation, the new user message

A node's first turn, and a turn that shares nothing with the previous one (a prompt rebuilt differently), carry no
``*_shared`` key and store the whole prompt. `RolloutTree.from_dict` rebuilds the exact ids; `expand_prompts`
gives back a tree dict whose turns carry their whole ``prompt_ids`` and ``prompt_text``, to read the prompts as
the generator saw them. `LLMCall` prompts are independent prompts and are always stored whole.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..advantages import trained_node_weights
from .repl_protocol import ReplResult

EndReason = Literal["final_answer", "max_turns", "prompt_too_long", "error"]
END_REASONS: tuple[str, ...] = ("final_answer", "max_turns", "prompt_too_long", "error")
_SHARED_PROMPTS = (("prompt_ids", "prompt_ids_shared"), ("prompt_text", "prompt_text_shared"))


@dataclass
class LLMCall:
    """One plain completion requested by a turn's code (``llm_query*``, or a degraded ``rlm_query*``).

    Attributes:
        prompt: the user message sent: the code's prompt through the ``llm_query_prompt`` template, with the
            child context inlined for a degraded ``rlm_query`` (``degraded_rlm_query_prompt``).
        prompt_ids: the token ids given to the generator (that message, chat-templated).
        completion_ids / logprobs: the sampled completion and its sampling log-probs, same length.
        completion: the decoded completion returned to the code.
        request: index of the query call within its turn; calls with the same index were one batched call.
    """

    prompt: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    completion: str
    request: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "request": self.request,
            "prompt": self.prompt,
            "completion": self.completion,
            "prompt_ids": self.prompt_ids,
            "completion_ids": self.completion_ids,
            "logprobs": self.logprobs,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LLMCall:
        return cls(
            **{
                key: data[key]
                for key in ("prompt", "prompt_ids", "completion_ids", "logprobs", "completion", "request")
            }
        )


@dataclass
class Turn:
    """One turn of a node: the prompt it was given, the action it sampled, and what running the action did.

    Attributes:
        prompt_ids: the exact token ids fed to the generator (prompt rebuilt every turn, docs/rlm_scaffold.md).
        action_ids: the sampled completion, eos included when sampled.
        logprobs: sampling log-probs of `action_ids` (after temperature/top-p processing), same length.
        action: the decoded action (special tokens skipped).
        code: the last ```repl block of the action, or None.
        repl_result: what running `code` produced (None when there was no code).
        observation: the user message that follows this action in later prompts (None on a node's last turn).
        llm_calls: plain completions the code requested, in request order.
        children: ids of the child nodes the code spawned, in spawn order.
    """

    prompt_ids: list[int]
    action_ids: list[int]
    logprobs: list[float]
    action: str
    code: str | None = None
    repl_result: ReplResult | None = None
    observation: str | None = None
    llm_calls: list[LLMCall] = field(default_factory=list)
    children: list[int] = field(default_factory=list)

    def to_dict(self, index: int, tokenizer: Any = None) -> dict[str, Any]:
        """The turn with its whole prompt (``prompt_ids``, and ``prompt_text`` decoded when a tokenizer is given);
        `RolloutNode.to_dict` then keeps only what each turn adds to the previous one's prompt."""
        data: dict[str, Any] = {"turn": index}
        if tokenizer is not None:
            data["prompt_text"] = tokenizer.decode(self.prompt_ids, skip_special_tokens=False)
        data.update(
            action=self.action,
            code=self.code,
            repl_result=self.repl_result.to_dict() if self.repl_result is not None else None,
            observation=self.observation,
            children=self.children,
            llm_calls=[call.to_dict() for call in self.llm_calls],
            prompt_ids=self.prompt_ids,
            action_ids=self.action_ids,
            logprobs=self.logprobs,
        )
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Turn:
        """Read a turn whose ``prompt_ids`` are whole (`Turn.to_dict`, or a node's turn through `expand_prompts`)."""
        result = data.get("repl_result")
        return cls(
            prompt_ids=list(data["prompt_ids"]),
            action_ids=list(data["action_ids"]),
            logprobs=list(data["logprobs"]),
            action=data["action"],
            code=data.get("code"),
            repl_result=ReplResult.from_dict(result) if result is not None else None,
            observation=data.get("observation"),
            llm_calls=[LLMCall.from_dict(call) for call in data.get("llm_calls", [])],
            children=list(data.get("children", [])),
        )


@dataclass
class RolloutNode:
    """One RLM rollout (the root, or a child started by ``rlm_query``): its turns and how it ended.

    Attributes:
        id: index in `RolloutTree.nodes`.
        parent: the parent's id (None for the root).
        depth: 0 for the root, parent's depth + 1 for a child.
        task: the task the node was given (the root's prompt, or the prompt passed to ``rlm_query``).
        context_description: what its ``context`` variable held (e.g. "a str of 1,234 characters").
        turns: its turns, in order.
        children: ids of its children, in spawn order.
        final_answer: its answer, or None.
        end_reason: "final_answer", "max_turns" (no answer in time), "prompt_too_long" (the rebuilt prompt
            exceeded ``max_prompt_tokens``) or "error" (e.g. its REPL could not start; see `error`).
        error: what went wrong when `end_reason` is "error".
        spawned_at: ``(parent turn index, query request index)`` of the call that started it.
    """

    id: int
    parent: int | None
    depth: int
    task: str
    context_description: str = ""
    turns: list[Turn] = field(default_factory=list)
    children: list[int] = field(default_factory=list)
    final_answer: str | None = None
    end_reason: EndReason | None = None
    error: str | None = None
    spawned_at: tuple[int, int] | None = None

    def to_dict(self, tokenizer: Any = None) -> dict[str, Any]:
        """A JSON-ready dict; each turn after the first stores only the end of its prompt that differs from the
        previous turn's (``prompt_ids_shared`` / ``prompt_text_shared``, see the module docstring)."""
        return {
            "id": self.id,
            "parent": self.parent,
            "depth": self.depth,
            "task": self.task,
            "context_description": self.context_description,
            "end_reason": self.end_reason,
            "final_answer": self.final_answer,
            "error": self.error,
            "children": self.children,
            "spawned_at": list(self.spawned_at) if self.spawned_at is not None else None,
            "turns": _share_prompts([turn.to_dict(index, tokenizer) for index, turn in enumerate(self.turns)]),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RolloutNode:
        """Read `to_dict`'s output (turns whose prompts share a prefix are rebuilt whole, `expand_prompts`)."""
        spawned_at = data.get("spawned_at")
        return cls(
            id=data["id"],
            parent=data["parent"],
            depth=data["depth"],
            task=data["task"],
            context_description=data.get("context_description", ""),
            turns=[Turn.from_dict(turn) for turn in _expand_turn_prompts(data["turns"])],
            children=list(data["children"]),
            final_answer=data.get("final_answer"),
            end_reason=data.get("end_reason"),
            error=data.get("error"),
            spawned_at=tuple(spawned_at) if spawned_at is not None else None,  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class TurnSample:
    """One training sample of a tree: a turn of one of its nodes, with the node's 1/k weight ``W(v)`` and its action
    tokens over all its trained turns ``n_v`` (the "subtree" loss gives each of its tokens ``W(v) / n_v``)."""

    node: int
    turn: int
    depth: int
    prompt_ids: list[int]
    action_ids: list[int]
    logprobs: list[float]
    weight: float
    node_tokens: int = 0


@dataclass
class RolloutTree:
    """A root rollout and all its descendants, in pre-order (``nodes[0]`` is the root)."""

    nodes: list[RolloutNode]

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("A RolloutTree needs at least its root node")
        for index, node in enumerate(self.nodes):
            if node.id != index:
                raise ValueError(f"nodes[{index}] has id {node.id}; node ids must equal their positions")
        if self.nodes[0].parent is not None or any(node.parent is None for node in self.nodes[1:]):
            raise ValueError("nodes[0] must be the only root (parent None)")

    @property
    def root(self) -> RolloutNode:
        return self.nodes[0]

    @property
    def final_answer(self) -> str | None:
        """The root's final answer (None when it ended without one)."""
        return self.root.final_answer

    def parents(self) -> list[int | None]:
        """``parents()[i]``: parent id of node ``i`` (None for the root); the input of `subtree_weights`."""
        return [node.parent for node in self.nodes]

    def weights(
        self, *, train_children: bool = True, child_sampling: str = "all", rng: random.Random | None = None
    ) -> list[float | None]:
        """W(v) of every node, None for a node that is not trained (`trl_ext.advantages.trained_node_weights`).

        With the defaults every node is trained with its 1/k weight (`subtree_weights` of `parents`).
        """
        return trained_node_weights(
            self.parents(), train_children=train_children, child_sampling=child_sampling, rng=rng
        )

    def turn_samples(
        self, *, train_children: bool = True, child_sampling: str = "all", rng: random.Random | None = None
    ) -> list[TurnSample]:
        """Every turn with at least one action token of every trained node as a training sample, nodes in pre-order,
        turns in order: the one definition of what the synchronous and the asynchronous trainer train on.

        The arguments choose the trained nodes and their weights as in `weights` (the trainer passes its
        ``train_children`` and ``child_sampling`` settings).
        """
        weights = self.weights(train_children=train_children, child_sampling=child_sampling, rng=rng)
        trained = [
            (node, index, turn)
            for node in self.nodes
            if weights[node.id] is not None
            for index, turn in enumerate(node.turns)
            if turn.action_ids
        ]
        node_tokens: dict[int, int] = {}
        for node, _, turn in trained:
            node_tokens[node.id] = node_tokens.get(node.id, 0) + len(turn.action_ids)
        return [
            TurnSample(
                node=node.id,
                turn=index,
                depth=node.depth,
                prompt_ids=turn.prompt_ids,
                action_ids=turn.action_ids,
                logprobs=turn.logprobs,
                weight=weights[node.id],
                node_tokens=node_tokens[node.id],
            )
            for node, index, turn in trained
        ]

    def iter_turns(self) -> Iterator[tuple[RolloutNode, int, Turn]]:
        for node in self.nodes:
            for index, turn in enumerate(node.turns):
                yield node, index, turn

    def to_dict(self, tokenizer: Any = None) -> dict[str, Any]:
        """A JSON-ready dict (one line of a tree file); with a tokenizer, every turn also carries its decoded
        ``prompt_text``. A turn after the first stores only what its prompt adds to the previous turn's (the module
        docstring); `from_dict` rebuilds the whole prompts, `expand_prompts` the whole ids and texts of the dict."""
        return {"final_answer": self.final_answer, "nodes": [node.to_dict(tokenizer) for node in self.nodes]}

    def to_json(self, tokenizer: Any = None, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(tokenizer), indent=indent, ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RolloutTree:
        return cls([RolloutNode.from_dict(node) for node in data["nodes"]])

    @classmethod
    def from_json(cls, text: str) -> RolloutTree:
        return cls.from_dict(json.loads(text))


def expand_prompts(data: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a tree dict (`RolloutTree.to_dict`, or a line of a tree file) whose every turn carries its whole
    ``prompt_ids`` and, where the dict has them, its whole ``prompt_text``, without ``*_shared`` keys.

    Raises:
        ValueError: a turn claims a longer shared prefix than the previous turn's prompt (a damaged file).
    """
    return {
        **data,
        "nodes": [{**node, "turns": _expand_turn_prompts(node["turns"])} for node in data["nodes"]],
    }


def _share_prompts(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turn dicts with whole prompts -> the stored form: turn i > 0 keeps, for ``prompt_ids`` and ``prompt_text``,
    the length of its common prefix with turn i - 1 (``*_shared``, placed just before the field, left out when 0)
    and the rest."""
    stored = [turns[0]] if turns else []
    for previous, turn in zip(turns, turns[1:]):
        shared = {
            key: _common_prefix(previous[key], turn[key])
            for key, _ in _SHARED_PROMPTS
            if key in previous and key in turn
        }
        data: dict[str, Any] = {}
        for key, value in turn.items():
            if shared.get(key):
                data[f"{key}_shared"] = shared[key]
                value = value[shared[key] :]
            data[key] = value
        stored.append(data)
    return stored


def _expand_turn_prompts(turns: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The inverse of `_share_prompts`: every turn with its whole ``prompt_ids`` (and ``prompt_text``)."""
    whole: list[dict[str, Any]] = []
    for index, turn in enumerate(turns):
        data = dict(turn)
        for key, shared_key in _SHARED_PROMPTS:
            shared = data.pop(shared_key, 0)
            if not shared:
                continue
            previous = whole[index - 1].get(key) if index else None
            if previous is None or not 0 < shared <= len(previous) or key not in data:
                raise ValueError(
                    f"turn {index} shares {shared} of the previous turn's {key}, which has "
                    f"{'none' if previous is None else len(previous)}: not a tree written by RolloutTree.to_dict"
                )
            data[key] = previous[:shared] + data[key]
        whole.append(data)
    return whole


def _common_prefix(first: Sequence[Any], second: Sequence[Any]) -> int:
    """Length of the longest common prefix of two lists or strings."""
    length = 0
    for a, b in zip(first, second):
        if a != b:
            break
        length += 1
    return length


def preorder(nodes: Sequence[RolloutNode]) -> RolloutTree:
    """Renumber nodes created in any order (e.g. by concurrent spawns) into a pre-order `RolloutTree`.

    Children keep their spawn order, so the ids do not depend on which REPL happened to finish first.
    """
    by_id = {node.id: node for node in nodes}
    roots = [node for node in nodes if node.parent is None]
    if len(roots) != 1:
        raise ValueError(f"expected exactly one root, got {len(roots)}")
    order: list[RolloutNode] = []
    stack = [roots[0]]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(by_id[child] for child in reversed(node.children))
    if len(order) != len(nodes):
        raise ValueError("some nodes are not reachable from the root through `children`")
    new_id = {node.id: index for index, node in enumerate(order)}
    for node in order:
        node.id = new_id[node.id]
        node.parent = new_id[node.parent] if node.parent is not None else None
        node.children = [new_id[child] for child in node.children]
        for turn in node.turns:
            turn.children = [new_id[child] for child in turn.children]
    return RolloutTree(order)


def canonical_rollout_order(
    trees: Sequence[RolloutTree], inputs: Sequence[Mapping[str, Any]], context_column: str
) -> list[int]:
    """A permutation that sorts the rollouts of each example (same prompt and context) by their sampled tokens and
    leaves every rollout in a slot of its own example.

    Which of two interchangeable rollouts of one example (identical prompts so far) receives which completion depends
    on the order the REPL cells finished in. Reordering them changes TRL's shuffled micro-batches and the order of
    float sums, so the trainers apply this permutation before building rewards and rows: the same seed then gives the
    same batch. Permuting the samples of one example is harmless: they share every dataset column. Returns the
    identity when ``inputs`` and ``trees`` differ in length.
    """
    if len(inputs) != len(trees):
        return list(range(len(trees)))
    slots: dict[str, list[int]] = {}
    for index, row in enumerate(inputs):
        key = json.dumps([row.get("prompt"), row.get(context_column)], sort_keys=True, default=str)
        slots.setdefault(key, []).append(index)
    order = list(range(len(trees)))
    for indices in slots.values():
        ranked = sorted(indices, key=lambda i: _rollout_sort_key(trees[i]))
        for slot, source in zip(indices, ranked):
            order[slot] = source
    return order


def _rollout_sort_key(tree: RolloutTree) -> tuple[list[Any], list[Any]]:
    """Sampled tokens first, then their log-probs: two rollouts with the same tokens can differ in the last bits of
    their log-probs (batched generation rounds each row of a batch a little differently), and those reach the loss."""
    tokens = [[list(turn.action_ids) for turn in node.turns] for node in tree.nodes]
    logprobs = [[list(turn.logprobs or []) for turn in node.turns] for node in tree.nodes]
    return tokens, logprobs
