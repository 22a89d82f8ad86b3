"""`span_credit`, `cap_credit`, `per_token_advantages`, `judge_share`: the formulas of docs/judge_credit.md."""

from __future__ import annotations

import pytest
import torch

from trl_ext.judge import DEFAULT_LABEL_SCORES, Span, cap_credit, judge_share, per_token_advantages, span_credit
from trl_ext.judge.credit import rollout_credit


def span(start, end, label, confidence=1.0):
    return Span(start=start, end=end, label=label, confidence=confidence, quote="x")


def test_default_label_table_is_spec_section_2():
    assert DEFAULT_LABEL_SCORES == {
        "verified_correction": 1.0,
        "key_progress": 0.5,
        "original_error": -1.0,
        "dependent_error": -0.5,
        "wasteful_loop": -0.25,
    }


def test_span_credit_is_score_times_confidence_inside_spans_and_zero_elsewhere():
    credit = span_credit([span(1, 3, "key_progress", 0.8), span(5, 6, "wasteful_loop", 0.4)], 8, DEFAULT_LABEL_SCORES)
    expected = torch.tensor([0, 0.4, 0.4, 0, 0, -0.1, 0, 0])
    torch.testing.assert_close(credit, expected)
    assert credit.shape == (8,) and credit.dtype == torch.float32


def test_overlaps_are_summed_then_clipped_to_minus_one_one():
    spans = [
        span(0, 4, "key_progress", 1.0),  # +0.5
        span(2, 6, "verified_correction", 0.9),  # +0.9
        span(3, 5, "original_error", 0.2),  # -0.2
        span(6, 8, "original_error", 1.0),  # -1.0
        span(7, 8, "dependent_error", 1.0),  # -0.5
    ]
    credit = span_credit(spans, 8, DEFAULT_LABEL_SCORES)
    expected = torch.tensor([0.5, 0.5, 1.0, 1.0, 0.7, 0.9, -1.0, -1.0])  # 1.4 -> 1, 1.2 -> 1, -1.5 -> -1
    torch.testing.assert_close(credit, expected)


def test_span_credit_uses_a_custom_table_and_rejects_bad_spans():
    torch.testing.assert_close(
        span_credit([span(0, 2, "lucky", 0.5)], 3, {"lucky": -0.6}), torch.tensor([-0.3, -0.3, 0])
    )
    with pytest.raises(ValueError, match="not inside"):
        span_credit([span(2, 9, "key_progress")], 8, DEFAULT_LABEL_SCORES)
    with pytest.raises(ValueError, match="not in label_scores"):
        span_credit([span(0, 1, "lucky")], 8, DEFAULT_LABEL_SCORES)
    assert span_credit([], 0, DEFAULT_LABEL_SCORES).shape == (0,)


def test_cap_scales_rows_above_lambda_to_exactly_lambda_and_leaves_the_others():
    credit = torch.tensor([[1.0, -1.0, 0.0, 0.0], [0.1, 0.0, -0.1, 0.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]])
    capped = cap_credit(credit, mask, lam=0.25)
    # row 0: mean |c| = 0.5 > 0.25 -> scaled by 0.5; row 1: mean 0.05 unchanged; row 2: mean over 2 mask tokens = 1
    torch.testing.assert_close(capped[0], torch.tensor([0.5, -0.5, 0.0, 0.0]))
    torch.testing.assert_close(capped[1], credit[1])
    torch.testing.assert_close(capped[2], torch.tensor([0.25, 0.25, 0.0, 0.0]))


def test_cap_properties_on_random_credit():
    generator = torch.Generator().manual_seed(0)
    credit = (torch.rand(64, 40, generator=generator) * 2 - 1) * (torch.rand(64, 1, generator=generator) > 0.3)
    lengths = torch.randint(0, 41, (64,), generator=generator)
    mask = (torch.arange(40).unsqueeze(0) < lengths.unsqueeze(1)).long()
    for lam in (0.0, 0.05, 0.25, 1.0, float("inf")):
        capped = cap_credit(credit, mask, lam)
        mean_abs = (credit.abs() * mask).sum(1) / mask.sum(1).clamp(min=1)
        capped_mean = (capped.abs() * mask).sum(1) / mask.sum(1).clamp(min=1)
        assert (capped_mean <= lam + 1e-6).all()  # row mean |c| <= λ
        below = mean_abs <= lam
        torch.testing.assert_close(capped[below], (credit * mask)[below])  # unchanged below λ
        assert (capped[~mask.bool()] == 0).all()  # masked tokens are 0
        same_sign = (torch.sign(capped) == torch.sign(credit * mask)) | (capped == 0)
        assert same_sign.all()  # sign kept
        above = ~below
        if lam > 0:
            torch.testing.assert_close(capped_mean[above], torch.full_like(capped_mean[above], lam))


def test_cap_rejects_bad_shapes_and_negative_lambda():
    with pytest.raises(ValueError, match=r"must both be \(B, T\)"):
        cap_credit(torch.zeros(3), torch.ones(3), 0.25)
    with pytest.raises(ValueError, match="lam=-0.1 must be >= 0"):
        cap_credit(torch.zeros(2, 3), torch.ones(2, 3), -0.1)


def test_per_token_advantages_add_credit_to_the_outcome_advantage():
    advantages = torch.tensor([0.5, -0.25])
    credit = torch.tensor([[0.0, 0.1, -0.2], [0.3, 0.0, 0.0]])
    torch.testing.assert_close(
        per_token_advantages(advantages, credit), torch.tensor([[0.5, 0.6, 0.3], [0.05, -0.25, -0.25]])
    )
    with pytest.raises(ValueError, match="must be"):
        per_token_advantages(torch.zeros(3), credit)


def test_judge_share_is_mean_abs_credit_over_total_mass():
    advantages = torch.tensor([1.0, -1.0])
    credit = torch.tensor([[0.5, 0.5, 9.0], [0.0, 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # mean |c| = 1/4 = 0.25, mean |A| = 1 -> share 0.25 / 1.25
    assert judge_share(advantages, credit, mask) == pytest.approx(0.2)
    assert judge_share(torch.zeros(2), torch.zeros(2, 3), mask) == 0.0


def test_rollout_credit_caps_over_the_judged_trained_tokens_only():
    spans = [span(0, 2, "original_error", 1.0), span(1, 3, "key_progress", 0.5)]
    # c = [-1, -0.75, 0.25, 0]; the judge read 3 tokens: mean |c| = 2/3 > λ = 0.25, so c x 0.25 / (2/3).
    assert rollout_credit(spans, 4, 3, DEFAULT_LABEL_SCORES, 0.25).tolist() == [-0.375, -0.28125, 0.09375, 0.0]
    # The loss trains the first two only: no credit elsewhere, mean |c| = 1.75/2 over them, so x 0.25 / 0.875.
    capped = rollout_credit(spans, 4, 3, DEFAULT_LABEL_SCORES, 0.25, trained=torch.tensor([1, 1, 0, 0]))
    assert capped.tolist() == pytest.approx([-0.25 / 0.875, -0.75 * 0.25 / 0.875, 0.0, 0.0])
    assert rollout_credit([], 4, 3, DEFAULT_LABEL_SCORES, 0.25).tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="judged_tokens=5"):
        rollout_credit(spans, 4, 5, DEFAULT_LABEL_SCORES, 0.25)
