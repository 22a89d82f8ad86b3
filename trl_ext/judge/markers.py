"""Token-index markers ``⟦i⟧`` inserted into a decoded completion before a judge reads it (docs/judge_credit.md).

The judge points at tokens by index, so it must see where each token begins. `insert_markers` returns the decoded
completion with ``⟦i⟧`` written where completion token ``i``'s text begins:

- at the start of every line that has visible text (the marker goes before the first token that begins inside the
  line, so with tokenizers that glue a newline to the next line's indentation, e.g. ``"\\n   "`` + ``" return"``,
  the marker sits after the indentation: ``"   ⟦6⟧ return"``), and
- inside long lines, at the first markable token at least ``every`` tokens after the previous marker.

**Which tokens can carry a marker.** Token ``i`` is *markable* when ``tokenizer.decode(ids[:i])`` is a prefix of
``tokenizer.decode(ids)`` — so the text before its marker is exactly the decoded tokens before it — and its own text
is not empty. For valid UTF-8 this means: token ``i`` holds the *first* byte of a character. Byte-level BPE splits
multi-byte characters across tokens (``"中"`` = ``ä`` ``¸`` ``Ń``, one byte each); the tokens holding the second and
third bytes begin inside the character and get no marker, and a span boundary on them is widened to the whole
character (`MarkedTrace.span_text`). (For invalid UTF-8 — garbage from an untrained policy — the same rule applies to
the U+FFFD replacement characters the decoder produces.)

**Invariant.** Removing the markers (`strip_markers`) gives back exactly ``tokenizer.decode(ids)`` — provided the
completion does not itself contain text of the form ``⟦digits⟧``; such text stays in the trace as written (the judge
is told markers are harness-made, and spans are validated against the real token text, not the markers).
"""

from __future__ import annotations

import bisect
import codecs
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

MARKER_OPEN, MARKER_CLOSE = "⟦", "⟧"
MARKER_RE = re.compile(r"⟦\d+⟧")


def format_marker(index: int) -> str:
    """The marker text for token ``index``: ``⟦index⟧``."""
    return f"{MARKER_OPEN}{index}{MARKER_CLOSE}"


def strip_markers(text: str) -> str:
    """Remove every ``⟦digits⟧`` from ``text`` (the inverse of `insert_markers` for marker-free completions)."""
    return MARKER_RE.sub("", text)


@dataclass(frozen=True)
class MarkedTrace:
    """A decoded completion with the character offset of every token and the markers placed for the judge.

    Attributes:
        text: ``tokenizer.decode(completion_ids)``.
        token_offsets: (num_tokens,) character offset in ``text`` where token ``i`` begins, or ``None`` when token
            ``i`` does not begin on a character boundary (second and later bytes of a split character) or cannot be
            aligned.
        markers: token indices that carry a marker in ``marked``, increasing.
        marked: ``text`` with ``⟦i⟧`` inserted before token ``i`` for each ``i`` in ``markers``.
    """

    text: str
    token_offsets: tuple[int | None, ...]
    markers: tuple[int, ...]
    marked: str
    _floor: tuple[int, ...] = field(repr=False, compare=False)
    _ceil: tuple[int, ...] = field(repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_offsets)

    def char_range(self, start: int, end: int) -> tuple[int, int]:
        """Character range ``[a, b)`` of ``text`` covering tokens ``[start, end)``, widened to whole characters."""
        if not 0 <= start <= end <= self.num_tokens:
            raise ValueError(
                f"Token range [{start}, {end}) is outside [0, {self.num_tokens}]; pass 0 <= start <= end <= num_tokens."
            )
        return self._floor[start], self._ceil[end]

    def span_text(self, start: int, end: int) -> str:
        """Decoded text of tokens ``[start, end)`` (end exclusive), widened to whole characters."""
        a, b = self.char_range(start, end)
        return self.text[a:b]

    def token_at_char(self, offset: int) -> int:
        """Index of the markable-or-not token whose text contains character ``offset`` (the last token starting at or
        before it)."""
        starts = [(o, i) for i, o in enumerate(self.token_offsets) if o is not None]
        position = bisect.bisect_right([o for o, _ in starts], offset) - 1
        return starts[max(position, 0)][1] if starts else 0

    def render(self, start: int, end: int) -> str:
        """Tokens ``[start, end)`` with a marker before every markable token: the judge's zoomed-in view."""
        a, b = self.char_range(start, end)
        pieces, cursor = [], a
        for i in range(start, end):
            offset = self.token_offsets[i]
            if offset is None or offset < a or offset >= b or offset == self._next_offset(i):
                continue
            pieces.append(self.text[cursor:offset])
            pieces.append(format_marker(i))
            cursor = offset
        pieces.append(self.text[cursor:b])
        return "".join(pieces)

    def _next_offset(self, i: int) -> int:
        return self._ceil[i + 1]


def insert_markers(tokenizer: Any, completion_ids: Sequence[int] | Any, every: int = 64) -> str:
    """Decode ``completion_ids`` and insert ``⟦i⟧`` at line starts and every ``every`` tokens in long lines.

    Args:
        tokenizer: a `transformers` tokenizer (any; byte-level BPE takes a linear-time exact path).
        completion_ids: (num_tokens,) token ids of one completion, without padding (list or 1-D tensor).
        every: marker spacing, in tokens, inside long lines; must be >= 1.

    Returns:
        The marked text; `strip_markers` of it equals ``tokenizer.decode(completion_ids)``.
    """
    return build_marked_trace(tokenizer, completion_ids, every=every).marked


def build_marked_trace(tokenizer: Any, completion_ids: Sequence[int] | Any, every: int = 64) -> MarkedTrace:
    """Like `insert_markers`, but returns the `MarkedTrace` (text, token offsets, markers) the judge works with."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every={every!r} must be an integer >= 1 (tokens between markers in long lines), e.g. 64.")
    ids = _as_id_list(completion_ids)
    text = tokenizer.decode(ids)
    offsets = _token_offsets(tokenizer, ids, text)
    floor, ceil = _floor_ceil(offsets, len(text))
    markable = [offsets[i] is not None and ceil[i + 1] > offsets[i] for i in range(len(ids))]
    markers = _place_markers(text, offsets, markable, every)
    marked = _join_markers(text, offsets, markers)
    return MarkedTrace(
        text=text, token_offsets=tuple(offsets), markers=tuple(markers), marked=marked, _floor=floor, _ceil=ceil
    )


def _as_id_list(completion_ids: Any) -> list[int]:
    if hasattr(completion_ids, "tolist"):
        completion_ids = completion_ids.tolist()
    ids = list(completion_ids)
    if any(isinstance(t, list) for t in ids):
        raise ValueError("completion_ids must be one completion (a 1-D list or tensor of ints), not a batch.")
    return [int(t) for t in ids]


def _place_markers(text: str, offsets: list[int | None], markable: list[bool], every: int) -> list[int]:
    """Token indices that get a marker: the first markable token of each non-blank line, then every ``every``."""
    markers: list[int] = []
    line_start = 0
    token = 0  # tokens are visited in order of their offsets, which increase with the index
    n = len(offsets)
    while line_start <= len(text):
        newline = text.find("\n", line_start)
        line_end = len(text) if newline < 0 else newline
        blank = not text[line_start:line_end].strip()
        last_marker: int | None = None
        while token < n:
            offset = offsets[token]
            if offset is not None and offset >= line_end and (offset > line_end or newline >= 0):
                break  # this token begins on a later line (or at the newline ending this one)
            if markable[token] and offset is not None and offset >= line_start and not blank:
                if last_marker is None or token - last_marker >= every:
                    markers.append(token)
                    last_marker = token
            token += 1
        if newline < 0:
            break
        line_start = newline + 1
    return markers


def _join_markers(text: str, offsets: list[int | None], markers: list[int]) -> str:
    pieces, cursor = [], 0
    for i in markers:
        offset = offsets[i]
        assert offset is not None
        pieces.append(text[cursor:offset])
        pieces.append(format_marker(i))
        cursor = offset
    pieces.append(text[cursor:])
    return "".join(pieces)


def _floor_ceil(offsets: list[int | None], text_length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(num_tokens + 1,) each: character offset of the last aligned token <= i, and of the first aligned token >= i
    (``text_length`` at the end)."""
    n = len(offsets)
    floor, last = [], 0
    for i in range(n):
        if offsets[i] is not None:
            last = offsets[i]
        floor.append(last)
    floor.append(text_length)
    ceil, following = [0] * (n + 1), text_length
    ceil[n] = text_length
    for i in range(n - 1, -1, -1):
        if offsets[i] is not None:
            following = offsets[i]
        ceil[i] = following
    return tuple(floor), tuple(ceil)


# ---------------------------------------------------------------------------------------------------------------------
# Token -> character offsets.
# ---------------------------------------------------------------------------------------------------------------------


def _token_offsets(tokenizer: Any, ids: list[int], text: str) -> list[int | None]:
    """(num_tokens,) character offset where each token begins, ``None`` when it does not begin a character.

    Byte-level BPE (GPT-2, Qwen, Llama 3) is handled exactly in linear time from the tokens' bytes; any other
    tokenizer goes through windowed incremental decoding, checked against ``text``, then plain prefix decoding.
    """
    offsets = _byte_level_offsets(tokenizer, ids, text)
    if offsets is None:
        offsets = _incremental_offsets(tokenizer, ids, text)
    if offsets is None:
        offsets = _prefix_offsets(tokenizer, ids, text)
    return offsets


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-character table, inverted (character -> byte)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    bytes_, chars, extra = list(printable), list(printable), 0
    for b in range(256):
        if b not in printable:
            bytes_.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bytes_, chars)}


def _byte_level_offsets(tokenizer: Any, ids: list[int], text: str) -> list[int | None] | None:
    tokens = tokenizer.convert_ids_to_tokens(ids)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    table = _byte_decoder()
    pieces: list[bytes] = []
    for token_id, token in zip(ids, tokens):
        if token_id in added:
            pieces.append(str(added[token_id]).encode("utf-8"))
        elif token is None or any(ch not in table for ch in token):
            return None  # not a byte-level vocabulary
        else:
            pieces.append(bytes(table[ch] for ch in token))
    # Feed the tokens' bytes to an incremental UTF-8 decoder (invalid bytes -> U+FFFD, as the tokenizer's own
    # decoder does): a token begins on a character boundary iff no partial character is buffered before it.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets: list[int | None] = []
    chunks: list[str] = []
    position = 0
    for piece in pieces:
        buffered, flags = decoder.getstate()
        if not buffered:
            offsets.append(position)
        else:  # decode(ids[:i]) ends with the buffered bytes flushed as U+FFFD: a boundary iff the text agrees
            flush = codecs.getincrementaldecoder("utf-8")(errors="replace")
            flush.setstate((buffered, flags))
            tail = flush.decode(b"", final=True)
            offsets.append(position + len(tail) if text.startswith(tail, position) else None)
        chunk = decoder.decode(piece)
        chunks.append(chunk)
        position += len(chunk)
    chunks.append(decoder.decode(b"", final=True))
    return offsets if "".join(chunks) == text else None


def _incremental_offsets(tokenizer: Any, ids: list[int], text: str, context: int = 4) -> list[int | None] | None:
    """Windowed incremental detokenization (decode a few tokens of left context so leading-space rules apply as in
    the full decode); a token whose text ends in an incomplete character is merged with the next ones."""
    offsets: list[int | None] = [None] * len(ids)
    position, pending = 0, 0
    for i in range(len(ids)):
        window = max(0, pending - context)
        before = tokenizer.decode(ids[window:pending])
        after = tokenizer.decode(ids[window : i + 1])
        piece = after[len(before) :] if after.startswith(before) else None
        if piece is None or not text.startswith(piece, position):
            if "\ufffd" in after and i + 1 < len(ids):
                continue  # an incomplete character garbles the window: wait for the tokens that complete it
            return None
        offsets[pending] = position
        position += len(piece)
        pending = i + 1
    if pending < len(ids):
        offsets[pending] = position
        position = len(text)
    return offsets if position == len(text) else None


def _prefix_offsets(tokenizer: Any, ids: list[int], text: str) -> list[int | None]:
    """The definition, for any tokenizer, in quadratic time: token i begins at ``len(decode(ids[:i]))`` when that
    decoded prefix is a prefix of ``text``."""
    offsets: list[int | None] = []
    for i in range(len(ids)):
        prefix = tokenizer.decode(ids[:i])
        offsets.append(len(prefix) if text.startswith(prefix) else None)
    return offsets
