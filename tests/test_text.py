"""`trl_ext.text`: one reading of messages, prompts and completions, and the JSON found in a model's reply."""

from __future__ import annotations

import pytest

from trl_ext.text import completion_text, json_candidates, last_user_text, message_text, prompt_messages

PARTS = [
    {"type": "text", "text": "Count the words"},
    {"type": "image_url", "image_url": {"url": "data:,"}},
    {"text": "in this caption."},
    "Be brief.",
]


# ----------------------------------------------------------------------------------------------------------------
# Messages, prompts, completions
# ----------------------------------------------------------------------------------------------------------------
def test_content_parts_are_the_text_parts_joined_by_newlines():
    assert message_text({"role": "user", "content": PARTS}) == "Count the words\nin this caption.\nBe brief."
    assert message_text({"role": "user", "content": "plain"}) == "plain"
    assert message_text({"role": "assistant", "content": None}) == ""
    assert message_text({"role": "user", "content": [{"type": "text", "text": None}]}) == ""
    with pytest.raises(TypeError, match="string or a list of parts"):
        message_text({"role": "user", "content": 5})


def test_last_user_text_reads_the_last_user_message_by_the_same_rule():
    conversation = [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": PARTS},
    ]
    assert last_user_text(conversation) == "Count the words\nin this caption.\nBe brief."
    assert last_user_text("a plain prompt") == "a plain prompt"
    with pytest.raises(ValueError, match=r"no user message.*\['system', 'assistant'\]"):
        last_user_text([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}])
    with pytest.raises(TypeError, match="TRL's two formats"):
        last_user_text(42)


def test_completion_text_joins_the_assistant_messages():
    completion = [
        {"role": "assistant", "content": "step 1"},
        {"role": "tool", "content": "output"},
        {"role": "assistant", "content": [{"type": "text", "text": "step 2"}]},
    ]
    assert completion_text(completion) == "step 1\nstep 2"
    assert completion_text({"role": "assistant", "content": "one"}) == "one"
    assert completion_text("raw") == "raw"
    with pytest.raises(TypeError, match="list of message dicts"):
        completion_text(["not a message"])


def test_prompt_messages_turns_a_string_into_one_user_message_and_copies_conversations():
    assert prompt_messages("hi") == [{"role": "user", "content": "hi"}]
    conversation = [{"role": "user", "content": "hi"}]
    copied = prompt_messages(conversation)
    assert copied == conversation and copied[0] is not conversation[0]


# ----------------------------------------------------------------------------------------------------------------
# JSON in prose
# ----------------------------------------------------------------------------------------------------------------
def test_a_reply_that_is_json_comes_first():
    assert list(json_candidates('  {"a": 1}\n')) == [{"a": 1}, {"a": 1}]  # whole reply, then the same value embedded
    assert next(json_candidates("[1, 2]")) == [1, 2]
    assert next(json_candidates("42")) == 42


@pytest.mark.parametrize("fence", ["```", "```json", "```JSON", "```Json", "``` json"])
def test_fenced_blocks_of_any_case_are_read(fence):
    reply = f'See [1].\n{fence}\n{{"score": 7}}\n```\nDone.'
    assert next(json_candidates(reply)) == {"score": 7}  # before the [1] embedded in the prose


def test_a_one_line_fence_is_read():
    assert next(json_candidates('See [1]. Answer: ```{"score": 7}``` ok')) == {"score": 7}


def test_values_embedded_in_prose_are_found_in_text_order_nested_ones_too():
    reply = 'As shown in [1], the scores are {"p": 8, "r": [6, 7]} and then {"q": true}. Bye.'
    found = list(json_candidates(reply))
    assert found == [[1], {"p": 8, "r": [6, 7]}, [6, 7], {"q": True}]


def test_text_that_is_not_json_yields_nothing():
    assert list(json_candidates("")) == []
    assert list(json_candidates("no json {here} [or, here")) == []
    assert list(json_candidates("{'single': 'quotes'}")) == []


def test_a_fence_with_broken_json_does_not_hide_the_valid_value_after_it():
    reply = '```json\n{"score": \n```\nSorry, again: {"score": 5}'
    assert list(json_candidates(reply)) == [{"score": 5}]


def test_nesting_deeper_than_the_parser_stops_the_scan_without_an_error():
    deep = "[" * 100_000 + "]" * 100_000
    assert list(json_candidates(f'{{"a": 1}} then {deep}')) == [{"a": 1}]


def test_json_candidates_is_lazy_and_needs_a_string():
    candidates = json_candidates('{"first": 1} ' + "{" * 10 + " never read")
    assert next(candidates) == {"first": 1}
    with pytest.raises(TypeError, match="reply string"):
        next(json_candidates(None))


def test_top_level_json_values_never_reads_inside_a_value():
    from trl_ext.text import top_level_json_values

    reply = 'Draft [1] then {"spans": [], "note": "{\\"spans\\": [{\\"start\\": 0}]}"} and [2, [3]] end {broken'
    assert list(top_level_json_values(reply)) == [[1], {"spans": [], "note": '{"spans": [{"start": 0}]}'}, [2, [3]]]
    assert list(top_level_json_values("```json\n[]\n```")) == [[]]  # a fenced value is a value of the reply
    assert list(top_level_json_values('{"a": 1')) == []  # cut: nothing inside it is read as the reply's
    with pytest.raises(TypeError):
        list(top_level_json_values(None))
