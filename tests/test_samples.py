"""`trl_ext.samples`: the training-sample record and its padded rows, against hand-written tensors."""

from __future__ import annotations

import pytest
import torch

from trl_ext.samples import TrainingSample, padded_rows


def test_padded_rows_pad_prompts_left_and_completions_right():
    samples = [
        TrainingSample([5, 6, 7], [8], [-0.5], advantage=1.0),
        TrainingSample([9], [10, 11, 12], [-1.0, -2.0, -3.0], advantage=-1.0),
    ]
    rows = padded_rows(samples, pad_token_id=0)
    assert rows["prompt_ids"].tolist() == [[5, 6, 7], [0, 0, 9]]
    assert rows["prompt_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert rows["completion_ids"].tolist() == [[8, 0, 0], [10, 11, 12]]
    assert rows["completion_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert rows["sampling_per_token_logps"].tolist() == [[-0.5, 0.0, 0.0], [-1.0, -2.0, -3.0]]
    assert rows["sampling_per_token_logps"].dtype == torch.float32 and rows["prompt_ids"].dtype == torch.long


def test_token_weight_is_the_node_weight_over_its_tokens():
    sample = TrainingSample([1], [2, 3], [-1.0, -1.0], advantage=0.5, node_weight=0.25, node_tokens=4)
    assert sample.token_weight == 0.0625
    assert TrainingSample([1], [2], [-1.0], advantage=0.5).token_weight is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(prompt_ids=[]), "needs its prompt ids"),
        (dict(logprobs=[-1.0]), "2 completion tokens but 1 log-probs"),
        (dict(token_credit=[0.1]), "2 completion tokens but 1 credit values"),
        (dict(token_credit=[0.1, float("nan")]), "finite"),
        (dict(node_weight=1.0), "go together"),
        (dict(node_weight=1.0, node_tokens=0), "node_tokens must be > 0"),
    ],
)
def test_a_malformed_sample_names_the_problem(fields, message):
    values = dict(prompt_ids=[1], completion_ids=[2, 3], logprobs=[-1.0, -1.0], advantage=0.0) | fields
    with pytest.raises(ValueError, match=message):
        TrainingSample(**values)
    with pytest.raises(ValueError, match="at least one"):
        padded_rows([], pad_token_id=0)
