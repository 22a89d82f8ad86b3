"""Pure functions for advantages and per-token loss weights of stepwise RLM training (docs/stepwise_rlm.md).

A root rollout is a tree of nodes (the root and the child RLMs it spawned); every turn of every trained node
becomes one training row. Every row inherits its root's group advantage ``A_g``, and under the "subtree"
normalisation each action token of node v carries the weight ``W(v) / n_v``, where ``W(v) = Π_{ancestors a}
1/k_a`` (k_a: children of a) and n_v the action tokens of v. Summed over rows and divided by the number of roots,
that is exactly ``J = mean_g L_subtree(root_g)`` with ``L_subtree(v) = L_node(v) + (1/k_v) Σ_c L_subtree(c)``.

The group advantage of one prompt's ``G`` rewards (`group_advantages`, `scored_advantages`) is computed here once
for the asynchronous rollout workers, as `GRPOTrainer` (and so every synchronous trainer) computes it, and in TRL's
asynchronous worker's variant (`async_group_advantages`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

# The 1/k weights are plain Python: `trl_ext.rlm` (and the REPL's processes) import them without torch.
if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "async_group_advantages",
    "broadcast_advantages",
    "group_advantages",
    "scored_advantages",
    "stepwise_loss_weights",
    "subtree_weights",
    "trained_node_weights",
]

SCALE_REWARDS = ("group", "none")  # the scalings of one group's rewards (GRPOTrainer's "batch" needs the batch)


def subtree_weights(parents: Sequence[int | None]) -> list[float]:
    """The 1/k weight of every node of a forest (docs/stepwise_rlm.md).

    ``W(v) = Π_{ancestors a of v} 1/k_a`` where ``k_a`` is the number of children of ``a``; roots weigh 1. So the
    children of a node share its weight's worth of loss equally, and a parent that spawns many children is not
    dominated by them.

    Args:
        parents: ``parents[i]`` is the index of node ``i``'s parent, or None for a root. Any order.

    Returns:
        ``weights[i]`` for every node, in the order of `parents`.

    Raises:
        TypeError: an entry is neither None nor an int.
        ValueError: an entry is not a node index, or the parent links form a cycle.

    Example: ``subtree_weights([None, 0, 0, 1, 1, 1])`` is ``[1, 1/2, 1/2, 1/6, 1/6, 1/6]``.
    """
    size = len(parents)
    for index, parent in enumerate(parents):
        if parent is None:
            continue
        if isinstance(parent, bool) or not isinstance(parent, int):
            raise TypeError(f"parents[{index}] must be a node index or None, got {parent!r}")
        if not 0 <= parent < size:
            raise ValueError(f"parents[{index}] = {parent} is not a node index in [0, {size})")
        if parent == index:
            raise ValueError(f"parents[{index}] = {index}: a node cannot be its own parent")
    num_children = [0] * size
    for parent in parents:
        if parent is not None:
            num_children[parent] += 1

    weights: list[float | None] = [None] * size
    for start in range(size):
        path = []  # nodes whose weight waits on their parent's, from `start` upwards
        on_path = set()
        node: int | None = start
        while node is not None and weights[node] is None:
            if node in on_path:
                cycle = path[path.index(node) :]
                raise ValueError(f"parents form a cycle through nodes {cycle}; every chain must end at a root (None)")
            path.append(node)
            on_path.add(node)
            node = parents[node]
        weight = 1.0 if node is None else weights[node]
        for child in reversed(path):
            parent = parents[child]
            weight = 1.0 if parent is None else weight / num_children[parent]
            weights[child] = weight
    return [float(weight) for weight in weights]  # type: ignore[arg-type]


def _children(parents: Sequence[int | None]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent is not None:
            if not 0 <= parent < len(parents) or parent == node:
                raise ValueError(f"parents[{node}] = {parent} is not another node's index in [0, {len(parents)}).")
            children[parent].append(node)
    return children


def trained_node_weights(
    parents: Sequence[int | None],
    *,
    train_children: bool = True,
    child_sampling: str = "all",
    rng: random.Random | None = None,
) -> list[float | None]:
    """Which nodes of a rollout tree are trained, and with what weight W(v).

    Args:
        parents: ``parents[i]`` is node i's parent index, None for the root; nodes in pre-order (parent first).
        train_children: False trains the root's turns only.
        child_sampling: ``"all"``: every node, ``W(v) = Π 1/k_a`` over its ancestors (docs/stepwise_rlm.md).
            ``"one"``: one uniformly drawn child per trained parent, recursively, each with weight 1 — an unbiased
            one-sample estimate of ``(1/k) Σ_c L_subtree(c)`` (cheaper, noisier).
        rng: the draw of ``"one"`` (seed it for reproducible runs).

    Returns:
        ``weights[i]``: W(node i), or None when node i is not trained.
    """
    if child_sampling not in ("all", "one"):
        raise ValueError(f"child_sampling must be 'all' or 'one', got {child_sampling!r}.")
    if not parents or parents[0] is not None or any(p is None for p in parents[1:]):
        raise ValueError("parents must list one tree in pre-order: the root first (None), then its descendants.")
    children = _children(parents)
    weights: list[float | None] = [None] * len(parents)
    weights[0] = 1.0
    if not train_children:
        return weights
    if child_sampling == "all":
        return subtree_weights(parents)
    rng = rng or random.Random(0)
    stack = [0]
    while stack:
        node = stack.pop()
        kids = children[node]
        if not kids:
            continue
        chosen = kids[rng.randrange(len(kids))]
        weights[chosen] = weights[node]
        stack.append(chosen)
    return weights


def broadcast_advantages(root_advantages: Tensor, row_root: Tensor) -> Tensor:
    """Give every row its root's advantage.

    Args:
        root_advantages: ``(R,)`` group advantage of each root rollout.
        row_root: ``(N,)`` long, the index in ``root_advantages`` of each row's root.

    Returns:
        ``(N,)`` advantages, ``root_advantages[row_root]``.
    """
    if row_root.dim() != 1 or root_advantages.dim() != 1:
        raise ValueError(
            f"root_advantages must be (R,) and row_root (N,); got {tuple(root_advantages.shape)} and "
            f"{tuple(row_root.shape)}."
        )
    if row_root.numel() and (row_root.min() < 0 or row_root.max() >= root_advantages.numel()):
        raise ValueError(f"row_root indexes roots in [0, {root_advantages.numel()}); got {row_root.tolist()}.")
    return root_advantages[row_root]


def stepwise_loss_weights(
    row_node_weight: Tensor,
    row_node_tokens: Tensor,
    completion_mask: Tensor,
    *,
    num_roots: int | Tensor,
    num_tokens: int | Tensor,
) -> Tensor:
    """Per-token loss weights of the "subtree" normalisation, for a trainer that divides by ``num_tokens``.

    A token-sum loss normalised by the batch's loss-token count (TRL's ``dapo``, ``cispo``, ``vespo``, and
    ``ipo``) computes ``Σ_t w_t ℓ_t / num_tokens``. With ``w_t = W(v)/n_v · num_tokens/num_roots`` that is
    ``Σ_v W(v) · mean_{t ∈ v} ℓ_t / num_roots = mean_g L_subtree(root_g)``.

    Args:
        row_node_weight: ``(N,)`` W(v) of the node each row (turn) belongs to.
        row_node_tokens: ``(N,)`` n_v, the action tokens of that node over all its trained turns.
        completion_mask: ``(N, T)`` the rows' action tokens.
        num_roots: roots in the whole generation batch (all ranks).
        num_tokens: loss tokens in the whole generation batch (all ranks), the loss's normaliser.

    Returns:
        ``(N, T)`` weights, zero outside ``completion_mask``.
    """
    if row_node_weight.shape != row_node_tokens.shape or row_node_weight.shape != completion_mask.shape[:1]:
        raise ValueError(
            f"row_node_weight {tuple(row_node_weight.shape)} and row_node_tokens {tuple(row_node_tokens.shape)} "
            f"must be (N,) with N = completion_mask's rows {completion_mask.shape[0]}."
        )
    if (row_node_tokens <= 0).any():
        raise ValueError("every trained node needs at least one action token (row_node_tokens > 0).")
    import torch

    scale = torch.as_tensor(num_tokens, dtype=torch.float32) / torch.as_tensor(num_roots, dtype=torch.float32)
    per_row = row_node_weight.float() / row_node_tokens.float() * scale.to(row_node_weight.device)
    return per_row.unsqueeze(1) * completion_mask.float()


def group_advantages(
    rewards: Sequence[float], scale_rewards: str = "group", *, ddof: int = 1, eps: float = 1e-4
) -> list[float]:
    """The group advantage of one prompt's ``G`` rewards, as `GRPOTrainer` computes it by default.

    Args:
        rewards: ``(G,)`` finite rewards.
        scale_rewards: ``"group"``: ``(r − mean) / (std + eps)``; ``"none"``: ``r − mean`` (Dr. GRPO).
        ddof: the std's delta degrees of freedom: 1 (unbiased, 0 for one reward: `GRPOTrainer`'s) or 0 (population:
            TRL's asynchronous worker's, `async_group_advantages`).
        eps: added to the std (`GRPOTrainer`: 1e-4).

    Returns:
        ``(G,)`` advantages.
    """
    import numpy as np  # here: the 1/k weights above are imported where numpy need not be

    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: set 'group' or 'none'.")
    values = np.asarray(rewards, dtype=np.float64)
    if values.ndim != 1 or values.size == 0 or not np.isfinite(values).all():
        raise ValueError(f"rewards must be a non-empty sequence of finite numbers, got {list(rewards)}.")
    centred = values - values.mean()
    if scale_rewards == "group":
        std = values.std(ddof=ddof) if values.size > ddof else 0.0
        centred = centred / (std + eps)
    return [float(value) for value in centred]


def async_group_advantages(rewards: Sequence[float]) -> list[float]:
    """The group advantages of TRL's asynchronous rollout worker: ``(r − mean) / (std + 1e-8)``, population std
    (`group_advantages` with ``ddof=0, eps=1e-8``).

    Args:
        rewards: ``(G,)`` one prompt's rewards (finite).

    Returns:
        ``(G,)`` advantages.
    """
    return group_advantages(rewards, "group", ddof=0, eps=1e-8)


def scored_advantages(rewards: Sequence[float], scale_rewards: str = "group") -> list[float]:
    """The group advantage of ``G`` rewards, NaN marking a completion no reward function could score.

    Args:
        rewards: ``(G,)`` summed rewards, NaN where every reward function returned None.
        scale_rewards: ``"group"`` or ``"none"`` (`group_advantages`).

    Returns:
        ``(G,)`` advantages: those of the scored completions computed among themselves, 0 for the unscored ones
        (they teach nothing, as in TRL's asynchronous worker).
    """
    scored = [index for index, reward in enumerate(rewards) if not math.isnan(reward)]
    advantages = [0.0] * len(rewards)
    if scored:
        for index, value in zip(scored, group_advantages([rewards[i] for i in scored], scale_rewards), strict=True):
            advantages[index] = value
    return advantages
