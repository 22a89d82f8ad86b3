"""`trl_ext.advantages` against hand-computed values (docs/stepwise_rlm.md)."""

import random

import pytest
import torch

from trl_ext.advantages import (
    async_group_advantages,
    broadcast_advantages,
    group_advantages,
    scored_advantages,
    stepwise_loss_weights,
    trained_node_weights,
)

# root 0 -> children 1, 4, 5 (k=3); node 1 -> children 2, 3 (k=2)
PARENTS = [None, 0, 1, 1, 0, 0]


def test_trained_node_weights_all_is_one_over_k_products():
    assert trained_node_weights(PARENTS) == pytest.approx([1, 1 / 3, 1 / 6, 1 / 6, 1 / 3, 1 / 3])


def test_trained_node_weights_root_only():
    assert trained_node_weights(PARENTS, train_children=False) == [1.0, None, None, None, None, None]


def test_trained_node_weights_one_child_per_parent_is_unbiased():
    counts = {}
    rng = random.Random(0)
    for _ in range(3000):
        weights = trained_node_weights(PARENTS, child_sampling="one", rng=rng)
        trained = tuple(i for i, w in enumerate(weights) if w is not None)
        assert weights[0] == 1.0 and all(weights[i] == 1.0 for i in trained)
        assert sum(1 for i in trained if PARENTS[i] == 0) == 1  # exactly one child of the root
        if 1 in trained:
            assert sum(1 for i in trained if PARENTS[i] == 1) == 1
        counts[trained] = counts.get(trained, 0) + 1
    # each trained node's inclusion probability equals its 1/k weight: E[one-sample] = all-children objective
    inclusion = [sum(c for t, c in counts.items() if i in t) / 3000 for i in range(6)]
    assert inclusion == pytest.approx([1, 1 / 3, 1 / 6, 1 / 6, 1 / 3, 1 / 3], abs=0.03)


def test_trained_node_weights_validation():
    with pytest.raises(ValueError, match="child_sampling"):
        trained_node_weights(PARENTS, child_sampling="some")
    with pytest.raises(ValueError, match="pre-order"):
        trained_node_weights([0, None])
    with pytest.raises(ValueError, match="not another node"):
        trained_node_weights([None, 7])


def test_broadcast_advantages():
    out = broadcast_advantages(torch.tensor([0.5, -0.5]), torch.tensor([0, 0, 1, 0]))
    assert out.tolist() == [0.5, 0.5, -0.5, 0.5]
    with pytest.raises(ValueError, match="row_root indexes roots"):
        broadcast_advantages(torch.tensor([0.5]), torch.tensor([1]))


def test_stepwise_loss_weights_hand_computed():
    # rows: two turns of the root (3 + 1 tokens, node has 4), one turn of a 1/3-weight child (2 tokens)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    weights = stepwise_loss_weights(
        torch.tensor([1.0, 1.0, 1 / 3]), torch.tensor([4, 4, 2]), mask, num_roots=2, num_tokens=6
    )
    scale = 6 / 2
    expected = torch.tensor([[scale / 4] * 3, [scale / 4, 0, 0], [scale / 6, scale / 6, 0]])
    torch.testing.assert_close(weights, expected)
    # Σ_t w_t ℓ_t / num_tokens with ℓ = 1 everywhere is Σ_v W(v) / num_roots
    assert (weights.sum() / 6).item() == pytest.approx((1 + 1 / 3) / 2)
    with pytest.raises(ValueError, match="at least one action token"):
        stepwise_loss_weights(torch.tensor([1.0]), torch.tensor([0]), mask[:1], num_roots=1, num_tokens=3)


def test_group_advantages_are_trls():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)  # GRPOTrainer, scale_rewards="group"
    assert group_advantages(rewards.tolist()) == pytest.approx(expected.tolist())
    assert group_advantages([1.0, 3.0], "none") == [-1.0, 1.0]
    assert group_advantages([2.0]) == [0.0]
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages([1.0], "batch")


def test_async_group_advantages_are_trls():
    assert async_group_advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-6)
    assert async_group_advantages([0.5, 0.5]) == [0.0, 0.0]
    with pytest.raises(ValueError, match="finite"):
        async_group_advantages([float("nan"), 1.0])


# ----------------------------------------------------------------------------------------------------------------
# The bound at the loss
# ----------------------------------------------------------------------------------------------------------------


def test_scored_advantages_leave_unscored_completions_at_zero():
    rewards = [1.0, float("nan"), 0.0, 2.0]
    advantages = scored_advantages(rewards)
    assert advantages[1] == 0.0
    assert [advantages[i] for i in (0, 2, 3)] == pytest.approx(group_advantages([1.0, 0.0, 2.0]))
    assert scored_advantages([float("nan")] * 3) == [0.0, 0.0, 0.0]
    assert scored_advantages([1.0, 3.0], "none") == [-1.0, 1.0]
