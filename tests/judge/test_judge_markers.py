"""`insert_markers` / `build_marked_trace`: the marker invariants on real tokenizations (docs/judge_credit.md)."""

from __future__ import annotations

import random
import re

import pytest
import torch

from trl_ext.judge import build_marked_trace, insert_markers, strip_markers
from trl_ext.judge import markers as markers_module
from trl_ext.testing import build_tiny_tokenizer

TEXTS = {
    "code": "def f(x):\n    return x + 1\nfor i in range(10):\n    print(i)\n",
    "multibyte": "Héllo wörld: 中文 and 🙂 emoji, ñ, ß, Ω\nzweite Zeile: ∑ x² ≤ 1\n",
    "empty_lines": "first\n\n\n   \nlast line\n\n",
    "long_line": "The answer is 42. " * 60,
    "long_multibyte_line": "中文🙂é" * 80,
    "starts_with_newline": "\n\nanswer",
    "only_whitespace": " \n\t\n",
    "no_newline": "The quick brown fox",
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def sentencepiece_like_tokenizer():
    """A non-byte-level tokenizer (Metaspace-style, byte fallback, Strip decoder) to exercise the generic paths."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x + 1", "What is 2 + 3?"] * 4
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token=None, fuse_unk=False))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    special = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tok.train_from_iterator(corpus, trainer=trainers.BpeTrainer(vocab_size=400, special_tokens=special))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def assert_marker_invariants(tokenizer, ids: list[int], every: int) -> None:
    trace = build_marked_trace(tokenizer, ids, every=every)
    text = tokenizer.decode(ids)
    # 1. removing the markers gives back exactly the decoded completion
    assert strip_markers(trace.marked) == text
    assert insert_markers(tokenizer, ids, every=every) == trace.marked
    # 2. each marker sits where token i's text begins: the text before it is exactly the decoded tokens before i
    for match in re.finditer(r"⟦(\d+)⟧", trace.marked):
        index = int(match.group(1))
        before = strip_markers(trace.marked[: match.start()])
        assert before == tokenizer.decode(ids[:index]), (index, before)
        assert tokenizer.decode(ids[index:]) != "", "a marker must not point at a token without text"
    # 3. every line with visible text has a marker at (or after only whitespace from) its start, before its text
    position = 0
    for line in trace.marked.split("\n"):
        plain = strip_markers(line)
        if plain.strip():
            first_marker = line.find("⟦")
            first_visible = len(line) - len(line.lstrip())
            assert 0 <= first_marker <= first_visible or _line_start_is_mid_token(trace, position), line
        position += len(plain) + 1
    # 4. inside a line, markers are at least `every` tokens apart and never more than `every` + (tokens that
    #    cannot carry a marker) apart
    for line in trace.marked.split("\n"):
        indices = [int(i) for i in re.findall(r"⟦(\d+)⟧", line)]
        assert all(b - a >= every for a, b in zip(indices, indices[1:])), indices


def _line_start_is_mid_token(trace, char_position: int) -> bool:
    """True when no markable token begins between the line start and its first visible character."""
    return not any(o is not None and o >= char_position for o in trace.token_offsets)


@pytest.mark.parametrize("name", sorted(TEXTS))
@pytest.mark.parametrize("every", [1, 4, 64])
def test_marker_invariants_on_real_tokenizations(tokenizer, name, every):
    ids = encode(tokenizer, TEXTS[name])
    assert_marker_invariants(tokenizer, ids, every)


def test_multibyte_characters_split_across_tokens_get_one_marker_at_their_first_byte(tokenizer):
    ids = encode(tokenizer, "中文")
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert len(ids) == 6, tokens  # two 3-byte characters, one byte-level token per byte in this tiny vocabulary
    trace = build_marked_trace(tokenizer, ids, every=1)
    assert trace.token_offsets == (0, None, None, 1, None, None)
    assert trace.marked == "⟦0⟧中⟦3⟧文"
    # A span boundary inside a character is widened to the whole character.
    assert trace.span_text(1, 2) == "中"
    assert trace.span_text(2, 4) == "中文"
    assert trace.span_text(3, 6) == "文"


def test_empty_and_whitespace_lines_get_no_marker_and_lines_start_with_one(tokenizer):
    ids = encode(tokenizer, "first\n\n\n   \nlast line")
    trace = build_marked_trace(tokenizer, ids, every=64)
    lines = trace.marked.split("\n")
    assert [bool(re.search("⟦", line)) for line in lines] == [True, False, False, False, True]
    assert lines[0].startswith("⟦0⟧first")
    assert re.fullmatch(r"⟦\d+⟧last line", lines[-1])


def test_indented_line_marker_sits_after_a_newline_token_that_swallows_the_indentation(tokenizer):
    ids = encode(tokenizer, "def f(x):\n    return x")
    assert "ĊĠĠĠ" in tokenizer.convert_ids_to_tokens(ids)  # "\n   " is one token here, " return" the next
    trace = build_marked_trace(tokenizer, ids, every=64)
    second = trace.marked.split("\n")[1]
    assert re.fullmatch(r"   ⟦\d+⟧ return x", second), second


def test_long_lines_get_a_marker_every_n_tokens(tokenizer):
    ids = encode(tokenizer, "word " * 100)
    trace = build_marked_trace(tokenizer, ids, every=16)
    assert list(trace.markers) == list(range(0, len(ids), 16))
    assert trace.marked.startswith("⟦0⟧word")


def test_special_tokens_and_tensor_input(tokenizer):
    ids = encode(tokenizer, "The answer is 5.") + [tokenizer.eos_token_id]
    trace = build_marked_trace(tokenizer, torch.tensor(ids), every=4)
    assert trace.text.endswith("<|im_end|>")
    assert strip_markers(trace.marked) == tokenizer.decode(ids)
    assert_marker_invariants(tokenizer, ids, 4)


def test_random_token_sequences_all_paths_agree_with_the_definition(tokenizer):
    """Random ids (invalid UTF-8 included, as an untrained policy emits): the fast paths equal the definition."""
    rng = random.Random(0)
    for _ in range(150):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
        text = tokenizer.decode(ids)
        reference = markers_module._prefix_offsets(tokenizer, ids, text)
        assert markers_module._byte_level_offsets(tokenizer, ids, text) == reference, ids
        incremental = markers_module._incremental_offsets(tokenizer, ids, text)
        assert incremental in (None, reference), ids
        if "⟦" not in text:
            assert strip_markers(insert_markers(tokenizer, ids, every=3)) == text


def test_non_byte_level_tokenizer_takes_the_generic_path_and_keeps_the_invariants():
    tokenizer = sentencepiece_like_tokenizer()
    for text in ("Héllo 中文 🙂 ok\n  x\n\nThe fox", "The quick brown fox " * 10, "def f(x):\n    return x + 1"):
        ids = encode(tokenizer, text)
        assert markers_module._byte_level_offsets(tokenizer, ids, tokenizer.decode(ids)) is None
        assert markers_module._incremental_offsets(tokenizer, ids, tokenizer.decode(ids)) is not None
        for every in (1, 5):
            assert_marker_invariants(tokenizer, ids, every)


def test_render_shows_every_markable_token(tokenizer):
    ids = encode(tokenizer, "What is 2 + 3?")
    trace = build_marked_trace(tokenizer, ids, every=64)
    assert trace.render(0, 3) == "⟦0⟧What⟦1⟧ is⟦2⟧ 2"
    assert strip_markers(trace.render(0, len(ids))) == trace.text


@pytest.mark.parametrize("every", [0, -1, 2.5, True])
def test_bad_every_is_rejected_with_the_fix(tokenizer, every):
    with pytest.raises(ValueError, match="every=.*integer >= 1"):
        insert_markers(tokenizer, [5, 6], every=every)


def test_span_text_rejects_ranges_outside_the_trace(tokenizer):
    trace = build_marked_trace(tokenizer, encode(tokenizer, "abc"))
    with pytest.raises(ValueError, match="outside"):
        trace.span_text(0, trace.num_tokens + 1)


def test_empty_completion(tokenizer):
    trace = build_marked_trace(tokenizer, [])
    assert (trace.text, trace.marked, trace.markers, trace.num_tokens) == ("", "", (), 0)
