"""`char_span_f1` on hand-computed spans, the reward-function wrapper, and the offline `evaluate` module."""

from __future__ import annotations

import json

import pytest

from trl_ext.rewards import CharSpanF1Reward, char_span_f1, char_span_scores, metric_path
from trl_ext.rewards.span_f1 import parse_gold_spans, parse_predicted_spans

CONTEXT = "The cat sat on the mat. The dog sat on the log."
#          0123456789012345678901234567890123456789012345678
# "cat sat" = [4, 11); "The cat" = [0, 7); "the mat" = [15, 22); "dog sat" = [28, 35)


# ----------------------------------------------------------------------------------------------------------------
# Hand-computed values
# ----------------------------------------------------------------------------------------------------------------
def test_identical_offsets_and_quotes_score_one():
    assert CONTEXT[4:11] == "cat sat"
    assert char_span_f1([(4, 11)], [(4, 11)], CONTEXT) == 1.0
    assert char_span_f1(["cat sat"], [(4, 11)], CONTEXT) == 1.0
    assert char_span_f1([[4, 11]], ["cat sat"], CONTEXT) == 1.0  # JSON-style two-item lists


def test_partial_overlap_by_hand():
    # predicted "The cat" [0,7), gold "cat sat" [4,11): overlap "cat" = 3 chars; P = G = 7.
    scores = char_span_scores([(0, 7)], [(4, 11)], CONTEXT)
    assert (scores.overlap_chars, scores.predicted_chars, scores.gold_chars) == (3, 7, 7)
    assert scores.precision == pytest.approx(3 / 7)
    assert scores.recall == pytest.approx(3 / 7)
    assert scores.f1 == pytest.approx(2 * 3 / (7 + 7))


def test_asymmetric_precision_and_recall():
    # predicted [0, 23) (the whole first sentence, 23 chars) covers gold "cat sat" (7): P = 7/23, R = 1.
    scores = char_span_scores([(0, 23)], ["cat sat"], CONTEXT)
    assert scores.precision == pytest.approx(7 / 23)
    assert scores.recall == 1.0
    assert scores.f1 == pytest.approx(2 * 7 / (23 + 7))


def test_multiple_gold_spans_and_union_of_overlapping_predictions():
    gold = [(4, 11), (28, 35)]  # "cat sat", "dog sat": G = 14
    predicted = [(4, 9), (6, 11), (4, 11)]  # all inside "cat sat": union [4, 11) = 7 chars, counted once
    scores = char_span_scores(predicted, gold, CONTEXT)
    assert (scores.predicted_chars, scores.gold_chars, scores.overlap_chars) == (7, 14, 7)
    assert scores.precision == 1.0
    assert scores.recall == pytest.approx(0.5)
    assert scores.f1 == pytest.approx(2 * 7 / 21)


def test_quote_located_at_first_occurrence():
    # "sat on the " occurs twice; the first occurrence is [8, 19) which overlaps "cat sat" [4, 11) by 3 chars.
    assert CONTEXT.find("sat on the ") == 8
    scores = char_span_scores(["sat on the "], [(4, 11)], CONTEXT)
    assert scores.overlap_chars == 3
    assert scores.f1 == pytest.approx(2 * 3 / (11 + 7))


def test_unlocated_quotes_count_their_length_without_overlap():
    # "a purple cow" (12 chars) is not in the context: P = 7 + 12, O = 7, G = 7.
    scores = char_span_scores(["cat sat", "a purple cow"], [(4, 11)], CONTEXT)
    assert scores.unlocated_predicted == 1
    assert scores.predicted_chars == 19
    assert scores.precision == pytest.approx(7 / 19)
    assert scores.recall == 1.0
    # An unfindable gold quote lowers recall the same way.
    gold_missing = char_span_scores(["cat sat"], ["cat sat", "zebra"], CONTEXT)
    assert gold_missing.unlocated_gold == 1
    assert gold_missing.recall == pytest.approx(7 / 12)
    # Without a context, quotes never locate: even identical quotes do not overlap.
    assert char_span_f1(["cat sat"], ["cat sat"]) == 0.0


def test_empty_sides():
    assert char_span_f1([], [], CONTEXT) == 1.0
    assert char_span_f1([], [], CONTEXT, empty_score=0.0) == 0.0
    assert char_span_f1([], [(4, 11)], CONTEXT) == 0.0
    assert char_span_f1([(4, 11)], [], CONTEXT) == 0.0
    assert char_span_f1(["", (3, 3)], [], CONTEXT) == 1.0  # empty quote and empty range count for nothing


def test_disjoint_spans_score_zero():
    assert char_span_f1([(0, 3)], [(4, 11)], CONTEXT) == 0.0


@pytest.mark.parametrize(
    ("predicted", "error", "message"),
    [
        ("cat sat", TypeError, "wrap the single quote in a list"),
        ([(5, 2)], ValueError, "0 <= start <= end"),
        ([(-1, 2)], ValueError, "0 <= start <= end"),
        ([(0, 999)], ValueError, "ends past the context"),
        ([(0.5, 2)], TypeError, "integer character offsets"),
        ([(True, 2)], TypeError, "integer character offsets"),
        ([(1, 2, 3)], TypeError, "Unknown predicted span"),
        ([3.5], TypeError, "Unknown predicted span"),
    ],
)
def test_bad_spans_raise_with_the_fix(predicted, error, message):
    with pytest.raises(error, match=message):
        char_span_f1(predicted, [(4, 11)], CONTEXT)


def test_dict_spans_and_parsers():
    assert char_span_f1([{"start": 4, "end": 11}], [(4, 11)], CONTEXT) == 1.0
    assert parse_predicted_spans('["cat sat", [28, 35]]') == ["cat sat", [28, 35]]
    assert parse_predicted_spans('{"evidence": ["cat sat"]}') == ["cat sat"]
    assert parse_predicted_spans("  the mat  ") == ["the mat"]  # plain text is one quote
    assert parse_predicted_spans("[not json") == ["[not json"]
    assert parse_predicted_spans("   ") == []
    assert parse_gold_spans("[[4, 11]]") == [[4, 11]]
    assert parse_gold_spans([4, 11]) == [(4, 11)]  # one pair, not two offsets
    assert parse_gold_spans("cat sat") == ["cat sat"]
    assert parse_gold_spans(None) == []


# ----------------------------------------------------------------------------------------------------------------
# The reward function
# ----------------------------------------------------------------------------------------------------------------
def test_reward_reads_final_answers_and_columns_in_both_formats():
    reward = CharSpanF1Reward(gold_column="evidence", context_column="context")
    assert reward.__name__ == "char_span_f1"
    completions = [
        'I looked.\nFINAL(["cat sat"])',  # a RLM final line
        [{"role": "assistant", "content": "[[0, 7]]"}],  # conversational, JSON offsets
        "a purple cow",  # not in the context
    ]
    rewards = reward(
        prompts=["q"] * 3,
        completions=completions,
        completion_ids=None,
        evidence=[[[4, 11]], json.dumps([[4, 11]]), ["cat sat"]],
        context=[CONTEXT] * 3,
        trainer_state=None,
        log_metric=lambda name, value: None,
    )
    assert rewards == pytest.approx([1.0, 2 * 3 / 14, 0.0])


def test_reward_names_a_missing_column():
    reward = CharSpanF1Reward(gold_column="gold_spans")
    with pytest.raises(KeyError, match="gold_spans"):
        reward(prompts=["q"], completions=["x"], context=[CONTEXT])


# ----------------------------------------------------------------------------------------------------------------
# The evaluate module, loaded from the installed package (offline)
# ----------------------------------------------------------------------------------------------------------------
def test_evaluate_module_loads_offline_and_matches_the_function(tmp_path):
    import evaluate

    metric = evaluate.load(metric_path("char_span_f1"), cache_dir=str(tmp_path))
    result = metric.compute(
        predictions=['["cat sat"]', "The cat"],
        references=["[[4, 11]]", json.dumps(["cat sat"])],
        contexts=[CONTEXT, CONTEXT],
    )
    expected = (1.0 + char_span_f1(["The cat"], ["cat sat"], CONTEXT)) / 2
    assert result["f1"] == pytest.approx(expected)
    lists = metric.compute(predictions=[["cat sat", "the mat"]], references=[["cat sat"]], contexts=[CONTEXT])
    assert lists["precision"] == pytest.approx(0.5)
    assert lists["recall"] == 1.0


def test_metric_path_rejects_unknown_names():
    with pytest.raises(ValueError, match="char_span_f1"):
        metric_path("bleu")
