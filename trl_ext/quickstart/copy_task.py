"""The judge-credit miniature's task and judge (`trl_ext.quickstart.judge_credit` runs them).

**Task** (`copy_task_splits`): the prompt ``"Copy: 4 7 2 9 1 ="``, the answer ``"47291"`` (one token per digit with
the tiny tokenizer, except its few merges such as ``10`` and ``100``, which the judge grades as one segment). The
outcome reward (`copy_exact_match_reward`) is exact match: one wrong digit and the whole rollout scores 0, so a group
whose rollouts all miss carries no outcome signal at all. Per-digit accuracy (`copy_digit_accuracy_reward`) is the
monitor beside it.

**Judge** (`ScriptedSpanJudge`, behind a `ScriptedChatServer` on 127.0.0.1): it reads the marked trace and the
REFERENCE ANSWER block of the request the trainer sends it (never the trainer's state), lines the trace's digits up
with the reference, and marks each right digit ``key_progress``, the first wrong one ``original_error`` and the wrong
ones after it ``dependent_error``: the per-token signal the outcome reward lacks.

`last_number_reward` is a toy verifier for other miniatures and tests.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ScriptedSpanJudge",
    "copy_digit_accuracy_reward",
    "copy_exact_match_reward",
    "copy_prompt",
    "copy_task_splits",
    "digit_accuracy",
    "last_number_reward",
]


def copy_prompt(answer: str) -> str:
    """``"47291"`` -> ``"Copy: 4 7 2 9 1 ="`` (the policy answers ``47291``)."""
    return f"Copy: {' '.join(answer)} ="


def _digit_strings(count: int, digits: int, rng: random.Random, exclude: set[str]) -> list[str]:
    if count > 10**digits - len(exclude):
        raise ValueError(f"Cannot draw {count} distinct {digits}-digit strings outside the {len(exclude)} excluded.")
    drawn: list[str] = []
    seen = set(exclude)
    while len(drawn) < count:
        answer = "".join(rng.choice("0123456789") for _ in range(digits))
        if answer not in seen:
            seen.add(answer)
            drawn.append(answer)
    return drawn


def copy_task_splits(seed: int, num_sft: int, num_rl: int, num_eval: int, digits: int = 5) -> tuple[Any, Any, Any]:
    """Seeded SFT, RL and held-out sets of the copy task (columns ``prompt``, ``answer``; SFT also ``completion``),
    pairwise disjoint in their answers (so in their prompts)."""
    from datasets import Dataset

    rng = random.Random(f"copy-task-{seed}-{digits}")
    answers = _digit_strings(num_sft + num_rl + num_eval, digits, rng, set())
    sft, rl, held_out = answers[:num_sft], answers[num_sft : num_sft + num_rl], answers[num_sft + num_rl :]

    def table(rows: list[str], completion: bool) -> Any:
        data = {"prompt": [copy_prompt(a) for a in rows], "answer": rows}
        if completion:
            data["completion"] = list(rows)
        return Dataset.from_dict(data)

    return table(sft, True), table(rl, False), table(held_out, False)


def _completion_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    return str(completion[-1].get("content", "")) if completion else ""


def copy_exact_match_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """The outcome reward: 1.0 when the completion (stripped) is exactly the answer, else 0.0 (one wrong digit: 0)."""
    return [
        1.0 if _completion_text(c).strip() == expected else 0.0
        for c, expected in zip(completions, answer, strict=True)
    ]


def digit_accuracy(completion: str, answer: str) -> float:
    """The share of the answer's positions where the completion (stripped) has the right digit."""
    text = completion.strip()
    return sum(1 for i, digit in enumerate(answer) if i < len(text) and text[i] == digit) / len(answer)


def copy_digit_accuracy_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """Per-digit accuracy as a reward function: logged beside the outcome reward with weight 0 (a monitor only)."""
    return [digit_accuracy(_completion_text(c), expected) for c, expected in zip(completions, answer, strict=True)]


_NUMBER = re.compile(r"-?\d+")


def last_number_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """1.0 when the last number in the completion equals ``answer``; 0.1 for any number; else 0 (a toy verifier)."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        numbers = _NUMBER.findall(_completion_text(completion))
        rewards.append(1.0 if numbers and numbers[-1] == expected else 0.1 if numbers else 0.0)
    return rewards


# ----------------------------------------------------------------------------------------------------------------
# The judge
# ----------------------------------------------------------------------------------------------------------------
class ScriptedSpanJudge:
    """The miniature's judge, a `ScriptedChatServer` script: from the request alone (the marked TRACE and the
    REFERENCE ANSWER blocks), the trace's visible characters are lined up with the reference, position by position;
    each marked segment (the text from one marker ``⟦i⟧`` to the next) gets a span: ``key_progress`` when all its
    characters match, ``original_error`` for the first segment with a mismatch (a wrong digit, a stray character, a
    digit past the reference's end), ``dependent_error`` for the later mismatches. Whitespace is skipped; a trace
    with no reference answer block gets no spans.
    """

    _BLOCK = re.compile(r"<<<(DATA-[0-9a-f]{16}) ([A-Z ]+)\n(.*?)\n\1>>>", re.DOTALL)
    _MARK = re.compile(r"⟦(\d+)⟧")

    def __init__(
        self,
        progress_confidence: float = 1.0,
        error_confidence: float = 1.0,
        overrun_confidence: float = 1.0,
        later_errors: bool = True,
    ):
        self.progress_confidence = progress_confidence
        self.error_confidence = error_confidence
        self.overrun_confidence = overrun_confidence
        self.later_errors = later_errors

    @classmethod
    def blocks(cls, request: dict[str, Any]) -> dict[str, str]:
        """The DATA blocks of the request's user messages, by name (``TRACE``, ``REFERENCE ANSWER``, ...)."""
        text = "\n".join(str(m.get("content") or "") for m in request.get("messages", []) if m.get("role") == "user")
        return {name: body for _, name, body in cls._BLOCK.findall(text)}

    @classmethod
    def marked_segments(cls, marked: str) -> list[tuple[int, str]]:
        """``(marker index, text up to the next marker)`` for each marker of a marked trace, in order."""
        parts = cls._MARK.split(marked)  # text, index, text, index, text...
        return [(int(parts[i]), parts[i + 1]) for i in range(1, len(parts), 2)]

    def spans(self, marked: str, reference: str) -> list[dict[str, Any]]:
        """The spans for a marked trace against the reference answer."""
        segments = self.marked_segments(marked)
        reference = reference.strip()
        spans: list[dict[str, Any]] = []
        position, erred = 0, False
        for k, (start, body) in enumerate(segments):
            visible = "".join(body.split())
            if not visible:
                continue
            expected = reference[position : position + len(visible)]
            position += len(visible)
            end = segments[k + 1][0] if k + 1 < len(segments) else start + 1
            if visible == expected:
                label, confidence = "key_progress", self.progress_confidence
            elif erred and not self.later_errors:
                continue
            else:
                label = "dependent_error" if erred else "original_error"
                # past the reference's end a character is surely wrong; a wrong digit inside it, less surely
                confidence = self.error_confidence if len(expected) == len(visible) else self.overrun_confidence
                erred = True
            spans.append({"start": start, "end": end, "label": label, "confidence": confidence, "quote": visible})
        return spans

    def __call__(self, request: dict[str, Any]) -> str:
        blocks = self.blocks(request)
        marked, reference = blocks.get("TRACE"), blocks.get("REFERENCE ANSWER")
        if marked is None or reference is None:
            return json.dumps({"spans": []})
        return json.dumps({"spans": self.spans(marked, reference)})
