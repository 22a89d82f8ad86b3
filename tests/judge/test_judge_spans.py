"""Parsing and validating the judge's spans on a corpus of bad outputs (docs/judge_credit.md)."""

from __future__ import annotations

import json

import pytest

from trl_ext.judge import (
    DEFAULT_LABEL_SCORES,
    DROP_REASONS,
    SpanParseError,
    build_marked_trace,
    extract_span_list,
    validate_spans,
)
from trl_ext.testing import build_tiny_tokenizer

TRACE_TEXT = "What is 2 + 3? The answer is 6.\nWait, 2 + 3 = 5. The answer is 5.\n中文 ok"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def trace(tokenizer):
    return build_marked_trace(tokenizer, tokenizer(TRACE_TEXT, add_special_tokens=False)["input_ids"])


def token_range(trace, substring: str) -> tuple[int, int]:
    """Smallest token range whose text contains ``substring``."""
    start_char = trace.text.index(substring)
    end_char = start_char + len(substring)
    start = max(i for i, o in enumerate(trace.token_offsets) if o is not None and o <= start_char)
    end = min([i for i, o in enumerate(trace.token_offsets) if o is not None and o >= end_char] or [trace.num_tokens])
    return start, end


def good_span(trace, substring="The answer is 6", label="original_error", confidence=0.9):
    start, end = token_range(trace, substring)
    return {"start": start, "end": end, "label": label, "confidence": confidence, "quote": substring}


# ----------------------------------------------------------------------------------------------------------------
# Tolerant parsing
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "template",
    [
        "{json}",
        "```json\n{json}\n```",
        "```\n{json}\n```",
        "Here is my analysis [see below].\n{json}\nThat's all.",
        'I think {{"note": 1}} is irrelevant. Final: {json}',
        "<think>the [first] step is wrong</think>\n{json}",
        "As shown in [1] and [2, 3], and {{'a': 1}}: {json}",
    ],
)
def test_span_list_is_found_in_prose_fences_and_objects(trace, template):
    spans = [good_span(trace)]
    for payload in (json.dumps({"spans": spans}), json.dumps(spans)):
        assert extract_span_list(template.format(json=payload)) == spans


@pytest.mark.parametrize(
    "text",
    [
        "",
        "no json here",
        "{'spans': [1]}",
        '{"spans": 3}',
        '{"verdict": "good"}',
        "[unclosed",
        "see [1, 2]",
        42,
        pytest.param('{"spans": ' + "[" * 100_000 + "]" * 100_000 + "}", id="nested-past-the-parser-limit"),
    ],
)
def test_outputs_without_a_span_list_raise_a_parse_error(text):
    with pytest.raises(SpanParseError):
        extract_span_list(text)


def test_empty_span_list_is_a_valid_answer(trace):
    assert extract_span_list('{"spans": []}') == []
    result = validate_spans([], trace, DEFAULT_LABEL_SCORES)
    assert result.valid == [] and result.dropped == []


# ----------------------------------------------------------------------------------------------------------------
# Validation: every drop reason
# ----------------------------------------------------------------------------------------------------------------
def bad_items(trace):
    good = good_span(trace)
    n = trace.num_tokens
    return {
        "not_an_object": ["start 0 end 3", [0, 3, "original_error", 1.0, "What"]],
        "missing_field": [{k: v for k, v in good.items() if k != field} for field in good],
        "wrong_type": [
            {**good, "start": "0"},
            {**good, "end": 3.0},
            {**good, "start": True},
            {**good, "confidence": "high"},
            {**good, "confidence": None},
            {**good, "label": 1},
            {**good, "quote": ["The answer"]},
        ],
        "out_of_range": [{**good, "start": -1}, {**good, "end": n + 1}, {**good, "start": n + 3, "end": n + 5}],
        "empty_or_reversed": [{**good, "start": good["end"], "end": good["start"]}, {**good, "end": good["start"]}],
        "unknown_label": [{**good, "label": "great_step"}, {**good, "label": "ORIGINAL_ERROR"}],
        "bad_confidence": [
            {**good, "confidence": 1.5},
            {**good, "confidence": -0.1},
            {**good, "confidence": float("nan")},
        ],
        "quote_mismatch": [
            {**good, "quote": "The answer is 7"},
            {**good, "quote": ""},
            {**good, "quote": "   "},
            {**good_span(trace, "Wait, 2 + 3 = 5"), "quote": "The answer is 6"},  # quote from elsewhere in the trace
        ],
    }


def test_every_bad_item_is_dropped_with_its_reason(trace):
    corpus = bad_items(trace)
    assert set(corpus) == set(DROP_REASONS)
    for reason, items in corpus.items():
        result = validate_spans(items, trace, DEFAULT_LABEL_SCORES)
        assert result.valid == [], reason
        assert [d.reason for d in result.dropped] == [reason] * len(items), (reason, result.dropped)
        assert all(d.detail for d in result.dropped)


def test_mixed_output_keeps_the_good_spans_in_order_and_counts_the_rest(trace):
    corpus = bad_items(trace)
    first = good_span(trace, "The answer is 6", "original_error", 0.9)
    second = good_span(trace, "2 + 3 = 5", "verified_correction", 0.8)
    items = [first, corpus["unknown_label"][0], second, *corpus["quote_mismatch"][:2]]
    result = validate_spans(items, trace, DEFAULT_LABEL_SCORES)
    assert [(s.start, s.end, s.label, s.confidence) for s in result.valid] == [
        (first["start"], first["end"], "original_error", 0.9),
        (second["start"], second["end"], "verified_correction", 0.8),
    ]
    assert result.dropped_by_reason() == {"unknown_label": 1, "quote_mismatch": 2}


def test_quote_matching_normalises_whitespace_and_ignores_markers(trace):
    start, end = token_range(trace, "The answer is 5.\n中文")
    for quote in ("The  answer is 5.   中文", "The answer\tis 5. 中文", "The answer is 5.\n⟦31⟧中文"):
        item = {"start": start, "end": end, "label": "key_progress", "confidence": 1, "quote": quote}
        result = validate_spans([item], trace, DEFAULT_LABEL_SCORES)
        assert len(result.valid) == 1, (quote, result.dropped)
    # case is not normalised
    item = {"start": start, "end": end, "label": "key_progress", "confidence": 1, "quote": "the answer is 5."}
    assert validate_spans([item], trace, DEFAULT_LABEL_SCORES).dropped[0].reason == "quote_mismatch"


def test_quote_of_a_multibyte_character_matches_a_span_that_starts_mid_character(trace):
    start, end = token_range(trace, "中")
    inner = start + 1  # a token that holds the second byte of 中
    assert trace.token_offsets[inner] is None
    item = {"start": inner, "end": end, "label": "wasteful_loop", "confidence": 0.5, "quote": "中"}
    assert len(validate_spans([item], trace, DEFAULT_LABEL_SCORES).valid) == 1


def test_custom_label_table_is_respected(trace):
    span = good_span(trace, label="lucky_guess")
    assert validate_spans([span], trace, DEFAULT_LABEL_SCORES).dropped[0].reason == "unknown_label"
    assert len(validate_spans([span], trace, {"lucky_guess": -0.3}).valid) == 1


def test_integer_confidence_and_bounds_are_accepted(trace):
    items = [good_span(trace, confidence=0), good_span(trace, confidence=1)]
    assert [s.confidence for s in validate_spans(items, trace, DEFAULT_LABEL_SCORES).valid] == [0.0, 1.0]
