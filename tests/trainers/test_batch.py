"""The pure batch and prompt-cap logic of the trainer (`trl_ext.samples`, `trl_ext.trainers.prompt_cap`)
against hand-computed values (no model, no training)."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch

from trl_ext.samples import ZEROED_ON_PADDING, check_scored_batch, loss_mask, pad_batch, padding_rows
from trl_ext.trainers.prompt_cap import cap_prompt_ids, prompt_cap


def scored_batch() -> dict:
    """3 rows, P = 2 prompt tokens, T = 4 completion tokens; every kind of value a scored batch may hold."""
    return {
        "prompt_ids": torch.tensor([[0, 11], [12, 13], [14, 15]]),
        "prompt_mask": torch.tensor([[0, 1], [1, 1], [1, 1]]),
        "completion_ids": torch.tensor([[21, 22, 23, 2], [24, 25, 2, 0], [26, 2, 0, 0]]),
        "completion_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]),
        "advantages": torch.tensor([1.0, -0.5, -0.5]),
        "loss_weights": torch.tensor([[1.0, 2.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.0], [1.0, 1.0, 0.0, 0.0]]),
        "rewards": torch.tensor([2.0, float("nan"), 0.5]),
        "old_per_token_logps": torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-5.0, -6.0, -7.0, 0.0], [-8.0, -9.0, 0, 0]]),
        "tool_mask": torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]]),
        "prefix_group": torch.tensor([0, 0, 1]),
        "num_items_in_batch": torch.tensor(9),
        "ref_per_token_logps": None,
        "names": ["a", "b", "c"],
    }


def first_row(batch: dict) -> dict:
    """The batch cut to its first row (0-dim tensors and None kept)."""
    return {
        key: value if value is None or (isinstance(value, torch.Tensor) and value.dim() == 0) else value[:1]
        for key, value in batch.items()
    }


# ----------------------------------------------------------------------------------------------------------------
# check_scored_batch
# ----------------------------------------------------------------------------------------------------------------
def test_check_scored_batch_returns_the_row_count():
    assert check_scored_batch(scored_batch()) == 3
    # per-token advantages (N, T), zero weights (>= 0 is allowed) and no loss_weights at all
    per_token = {**scored_batch(), "advantages": torch.zeros(3, 4), "loss_weights": torch.zeros(3, 4)}
    assert check_scored_batch(per_token) == 3
    assert check_scored_batch({**scored_batch(), "loss_weights": None}) == 3
    assert check_scored_batch(first_row(scored_batch())) == 1


@pytest.mark.parametrize("missing", ["prompt_ids", "completion_ids", "advantages"])
def test_check_scored_batch_requires_the_values_trl_reads(missing):
    batch = {key: value for key, value in scored_batch().items() if key != missing}
    with pytest.raises(ValueError, match=rf"must keep \['{missing}'\]"):
        check_scored_batch(batch)


@pytest.mark.parametrize(
    "leading",
    [
        {"num_items_in_batch": torch.tensor(9)},  # 0-dim: TRL would take len() of it
        {"skipped": None, "num_items_in_batch": torch.tensor(9)},  # TRL skips None and reads the next value
        {"names": ["a", "b", "c"]},  # a list has no .shape for TRL's split
    ],
)
def test_check_scored_batch_refuses_a_first_value_that_is_not_a_row_tensor(leading):
    name = next(key for key, value in leading.items() if value is not None)
    with pytest.raises(ValueError, match=rf"first batch value that is not None \('{name}'\) is not a row-indexed"):
        check_scored_batch({**leading, **scored_batch()})
    # the same values further down are fine
    assert check_scored_batch({**scored_batch(), **leading}) == 3


@pytest.mark.parametrize(
    ("key", "value", "rows"),
    [
        ("rewards", torch.tensor([1.0, 2.0]), 2),
        ("completion_mask", torch.ones(4, 4), 4),
        ("names", ["a", "b", "c", "d"], 4),
        ("names", [], 0),
    ],
)
def test_check_scored_batch_refuses_a_value_with_another_row_count(key, value, rows):
    with pytest.raises(ValueError, match=rf"batch\['{key}'\] has {rows} rows but 'prompt_ids' has 3"):
        check_scored_batch({**scored_batch(), key: value})


@pytest.mark.parametrize("shape", [(3, 1), (3, 5), (3, 4, 1)])
def test_check_scored_batch_refuses_advantages_neither_per_row_nor_per_token(shape):
    expected = r"advantages must be \(N,\) or \(N, T\) = \(3, 4\).*got " + re.escape(str(shape))
    with pytest.raises(ValueError, match=expected):
        check_scored_batch({**scored_batch(), "advantages": torch.zeros(shape)})


@pytest.mark.parametrize("shape", [(3,), (3, 1), (3, 5)])
def test_check_scored_batch_refuses_loss_weights_not_shaped_like_completion_ids(shape):
    with pytest.raises(ValueError, match=r"loss_weights must be \(N, T\) = \(3, 4\)"):
        check_scored_batch({**scored_batch(), "loss_weights": torch.ones(shape)})


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), float("-inf")])
def test_check_scored_batch_refuses_negative_or_non_finite_weights(bad):
    weights = torch.ones(3, 4)
    weights[1, 2] = bad
    with pytest.raises(ValueError, match="loss_weights must be finite and >= 0"):
        check_scored_batch({**scored_batch(), "loss_weights": weights})


# ----------------------------------------------------------------------------------------------------------------
# padding_rows
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("num_rows", "max_rows", "num_micro_batches", "expected"),
    [
        (8, 8, 4, 0),  # already a multiple, the most rows of any rank
        (8, 8, 1, 0),
        (6, 6, 4, 2),  # rounded up to 8
        (9, 9, 4, 3),  # rounded up to 12
        (11, 11, 2, 1),  # 11 rows, 2 micro-batches: 12
        (5, 8, 4, 3),  # another rank holds 8 (a multiple): up to 8
        (5, 7, 4, 3),  # another rank holds 7: everyone up to 8
        (3, 9, 4, 9),  # another rank holds 9: everyone up to 12
        (3, 5, 1, 2),  # evaluation (one micro-batch): equal counts only
        (1, 1, 4, 3),
    ],
)
def test_padding_rows_by_hand(num_rows, max_rows, num_micro_batches, expected):
    assert padding_rows(num_rows, max_rows, num_micro_batches) == expected


def test_padding_rows_refuses_an_empty_rank_that_must_be_padded():
    with pytest.raises(ValueError, match="returned 0 rows on this rank"):
        padding_rows(0, 3, 2)
    assert padding_rows(0, 0, 2) == 0  # no rank has a row: nothing to copy and nothing to add


# ----------------------------------------------------------------------------------------------------------------
# pad_batch
# ----------------------------------------------------------------------------------------------------------------
def test_pad_batch_appends_cyclic_copies_with_their_loss_zeroed():
    assert ZEROED_ON_PADDING == ("completion_mask", "advantages", "loss_weights", "rewards")
    batch = scored_batch()
    padded = pad_batch(batch, 3, 5)  # copies of rows 0, 1, 2, 0, 1
    source = [0, 1, 2, 0, 1]
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "old_per_token_logps", "tool_mask", "prefix_group"):
        assert padded[key].shape[0] == 8
        assert torch.equal(padded[key][:3], batch[key]), key
        assert torch.equal(padded[key][3:], batch[key][source]), key
    assert padded["prompt_ids"][3:].tolist() == [[0, 11], [12, 13], [14, 15], [0, 11], [12, 13]]
    assert padded["prefix_group"].tolist() == [0, 0, 1, 0, 0, 1, 0, 0]  # a copy stays in its source's group
    assert padded["completion_mask"][3:].tolist() == [[0, 0, 0, 0]] * 5
    assert padded["advantages"].tolist() == [1.0, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert padded["loss_weights"][3:].tolist() == [[0.0] * 4] * 5
    assert torch.equal(padded["loss_weights"][:3], batch["loss_weights"])
    # rewards: the real rows as they were (NaN included), zero on the copies (even of the NaN row)
    assert padded["rewards"][3:].tolist() == [0.0] * 5
    assert padded["rewards"][0].item() == 2.0 and torch.isnan(padded["rewards"][1]) and padded["rewards"][2] == 0.5
    assert padded["names"] == ["a", "b", "c", "a", "b", "c", "a", "b"]
    assert padded["num_items_in_batch"] is batch["num_items_in_batch"]  # 0-dim: shared, not per row
    assert "ref_per_token_logps" in padded and padded["ref_per_token_logps"] is None
    assert list(padded) == list(batch)  # same keys, same order (TRL reads the row count from the first)
    # the input batch is left as it was
    assert batch["completion_mask"].sum().item() == 9 and batch["names"] == ["a", "b", "c"]


def test_pad_batch_zeroes_per_token_advantages_and_adds_nothing_for_zero_padding():
    batch = {**scored_batch(), "advantages": torch.arange(12, dtype=torch.float32).reshape(3, 4) + 1}
    padded = pad_batch(batch, 3, 2)
    assert padded["advantages"].tolist() == [
        [1.0, 2.0, 3.0, 4.0],
        [5.0, 6.0, 7.0, 8.0],
        [9.0, 10.0, 11.0, 12.0],
        [0.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0],
    ]
    assert check_scored_batch(padded) == 5
    same = pad_batch(batch, 3, 0)
    assert all(torch.equal(same[key], batch[key]) for key in ("prompt_ids", "advantages", "completion_mask"))
    assert same["names"] == ["a", "b", "c"]


def test_pad_batch_copies_a_single_row_into_every_padding_row():
    batch = first_row(scored_batch())
    padded = pad_batch(batch, 1, 3)
    assert padded["completion_ids"].tolist() == [[21, 22, 23, 2]] * 4
    assert padded["completion_mask"].tolist() == [[1, 1, 1, 1]] + [[0, 0, 0, 0]] * 3
    assert padded["names"] == ["a"] * 4


# ----------------------------------------------------------------------------------------------------------------
# loss_mask
# ----------------------------------------------------------------------------------------------------------------
def test_loss_mask_multiplies_the_tool_mask_in_when_there_is_one():
    batch = scored_batch()
    assert loss_mask(batch).tolist() == [[1, 0, 1, 1], [1, 1, 1, 0], [0, 1, 0, 0]]
    assert loss_mask(batch).sum().item() == 7
    without = {key: value for key, value in batch.items() if key != "tool_mask"}
    assert loss_mask(without) is without["completion_mask"]
    assert loss_mask({**batch, "tool_mask": None}) is batch["completion_mask"]
    # padding rows count no token, whatever their (copied) tool mask
    assert loss_mask(pad_batch(batch, 3, 5))[3:].sum().item() == 0


# ----------------------------------------------------------------------------------------------------------------
# prompt_cap
# ----------------------------------------------------------------------------------------------------------------
def model_with(**config) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(**config))


def test_prompt_cap_keeps_an_explicit_cap(caplog):
    args = SimpleNamespace(max_completion_length=8)
    with caplog.at_level(logging.WARNING, logger="trl_ext.trainers.prompt_cap"):
        assert prompt_cap(56, model_with(max_position_embeddings=64), args) == 56  # 56 + 8 = 64: fits exactly
        assert prompt_cap(10, SimpleNamespace(), args) == 10  # no config: kept as is
        assert prompt_cap(10, model_with(), args) == 10
    assert caplog.records == []
    with caplog.at_level(logging.WARNING, logger="trl_ext.trainers.prompt_cap"):
        assert prompt_cap(57, model_with(max_position_embeddings=64), args) == 57  # one over: kept, warned
    assert [r.getMessage() for r in caplog.records] == [
        "max_prompt_length=57 + max_completion_length=8 is more than the model's 64 positions."
    ]


@pytest.mark.parametrize(
    ("positions", "completion", "expected"),
    [
        (64, 8, 56),
        (2048, 256, 1792),
        (9, 8, 1),  # one position left
        (64, None, 64),  # no completion length: all the positions
        (64, 0, 64),
    ],
)
def test_prompt_cap_defaults_to_positions_minus_completion(positions, completion, expected):
    args = SimpleNamespace(max_completion_length=completion)
    assert prompt_cap(None, model_with(max_position_embeddings=positions), args) == expected


def test_prompt_cap_is_none_when_the_model_does_not_say():
    args = SimpleNamespace(max_completion_length=8)
    assert prompt_cap(None, SimpleNamespace(), args) is None  # no config
    assert prompt_cap(None, model_with(), args) is None  # no max_position_embeddings
    assert prompt_cap(None, model_with(max_position_embeddings=None), args) is None
    assert prompt_cap(None, model_with(max_position_embeddings=64), SimpleNamespace()) == 64  # args without it


@pytest.mark.parametrize(("positions", "completion"), [(8, 8), (4, 8)])
def test_prompt_cap_refuses_a_completion_that_leaves_no_room(positions, completion):
    args = SimpleNamespace(max_completion_length=completion)
    message = f"max_completion_length={completion} leaves no room for a prompt in the model's {positions} positions"
    with pytest.raises(ValueError, match=message):
        prompt_cap(None, model_with(max_position_embeddings=positions), args)


def test_prompt_cap_reads_the_text_config_of_a_vision_language_model(caplog):
    args = SimpleNamespace(max_completion_length=8)
    text = SimpleNamespace(max_position_embeddings=128)
    assert prompt_cap(None, model_with(text_config=text), args) == 120
    # the text model's positions win over a top-level value (e.g. the vision tower's)
    assert prompt_cap(None, model_with(text_config=text, max_position_embeddings=32), args) == 120
    assert prompt_cap(None, model_with(text_config=None, max_position_embeddings=32), args) == 24
    with caplog.at_level(logging.WARNING, logger="trl_ext.trainers.prompt_cap"):
        assert prompt_cap(121, model_with(text_config=text), args) == 121
    assert "more than the model's 128 positions" in caplog.text


# ----------------------------------------------------------------------------------------------------------------
# cap_prompt_ids
# ----------------------------------------------------------------------------------------------------------------
def test_cap_prompt_ids_cuts_from_the_left_and_names_the_long_prompts():
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11, 12, 13, 14]]
    capped, long = cap_prompt_ids(prompts, 3)
    assert capped == [[3, 4, 5], [6, 7], [8, 9, 10], [12, 13, 14]]  # the end (the question) is kept
    assert long == [0, 3]  # exactly the cap (row 2) is not long
    assert prompts == [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11, 12, 13, 14]]  # the input is not changed
    assert cap_prompt_ids(prompts, 1) == ([[5], [7], [10], [14]], [0, 1, 2, 3])
    assert cap_prompt_ids(prompts, 5) == (prompts, [])
    assert cap_prompt_ids([], 3) == ([], [])


@pytest.mark.parametrize("cap", [0, -3])
def test_cap_prompt_ids_refuses_a_cap_below_one(cap):
    with pytest.raises(ValueError, match=f"prompt cap of {cap} tokens would leave no prompt"):
        cap_prompt_ids([[1, 2, 3]], cap)
