"""A miniature evidence-selection task with several right spans, to compare the char-span F1 reward with the rubric
judge reward on the same policy (benchmarks/evidence_rewards.py runs the study).

**Task** (`evidence_splits`): a context of short entries and a question with one or more right answers::

    a=37 b=52 c=37 d=90
    Quote an entry with value 37:

The policy answers with a quote; ``a=37`` and ``c=37`` are both right, and one of them answers the question. The gold
evidence (column ``evidence``, character offsets into ``context``) is every right entry; the ground truth shown to the
rubric judge (column ``answer``) names them all and says that any one answers.

**The two rewards** (`f1_reward`, `rubric_reward`): `trl_ext.rewards.CharSpanF1Reward` as it ships (the answer is one
quote located at its first exact occurrence; the gold side is the *union* of the right entries, so a single right
entry of two gets F1 = 2·4 / (4 + 8) = 0.67, and a contiguous stretch covering both can score higher), and
`trl_ext.rewards.RubricJudgeReward` asking `ScriptedRubricJudge` behind a `ScriptedChatServer` on 127.0.0.1.

**The judge is scripted**: an oracle that applies the rubric as a careful judge would (`rubric_scores`), from the
request alone (the QUERY, GROUND TRUTH and PREDICTION blocks), never from the trainer. The prediction is split at
whitespace into pieces, each a right entry, a wrong entry (another entry of the context), a fragment of an entry
(a proper part of one, e.g. ``a=3`` or ``37``) or invented text (anything else). Precision (1–10): how much of what was
quoted is supporting evidence and nothing else, ``1 + 9 · support / pieces`` rounded half up, where a right entry
supports 1 and a fragment of a right entry 0.5. Recall (1–10): does the quote hold a right entry; the question asks
for one, so one complete right entry is full recall (10), a fragment of one half (5), nothing right 1. Reward
``(p/10 + r/10) / 2``, as `RubricJudgeReward` maps it. A study with it measures how the two reward *definitions* can
be gamed, not how a real LLM judge fails (a real judge is noisier, and can be talked into scores).

**Behaviour** (`classify_quote`, one per answer): ``exact`` (one right entry), ``overlong`` (several pieces, of any
kind: e.g. a stretch of the context, or right entries with text around them), ``partial`` (one fragment), ``wrong``
(one wrong entry), ``invented`` (one piece that is in no entry, e.g. ``b=37``), ``empty``. `quote_metrics` gives their
rates over a set of answers, and beside them ``invented_text`` (some piece is in no entry), ``holds_right`` (some
piece is a right entry), ``multi_right``, ``whole_context`` and the mean quote length.

The study run (`trl_ext.quickstart.evidence_study`): per seed a tiny Qwen2 policy, a brief cold-start SFT on teacher answers
(`teacher_answer`: mostly one right entry, some over-long, partial, wrong or invented, so RL sees spread), then from
that policy one `trl_ext.ExtGRPOTrainer` run (IPO loss, LoRA) per arm: ``f1`` trained on `f1_reward`, ``rubric`` on
`rubric_reward`, the other reward and the behaviour rates logged beside it with weight 0; held-out evaluation
(greedy) with both rewards and the behaviour counts before and after RL.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Sequence
from typing import Any

__all__ = [
    "BEHAVIOURS",
    "canonical_answers",
    "definition_table",
    "ScriptedRubricJudge",
    "classify_quote",
    "evidence_example",
    "evidence_rows",
    "evidence_splits",
    "f1_reward",
    "piece_kinds",
    "quote_metrics",
    "rubric_reward",
    "rubric_scores",
    "rubric_value",
    "teacher_answer",
]

KEYS = "abcdefgh"
DIGITS = "23456789"  # no 0 or 1: the tiny tokenizer merges "10"-"20", so every value here is two digit tokens
QUESTION = "Quote an entry with value {value}:"
GROUND_TRUTH = "The right entries are {entries}; any one of them answers the question."
JUDGE_MODEL = "scripted-rubric-judge"
BEHAVIOURS = ("exact", "overlong", "partial", "wrong", "invented", "empty")
_ENTRY = re.compile(r"\b([a-z])=(\d+)\b")


# ----------------------------------------------------------------------------------------------------------------
# Task
# ----------------------------------------------------------------------------------------------------------------
def evidence_example(rng: random.Random, num_entries: int = 4, num_right: int = 2) -> dict[str, Any]:
    """One example: ``num_entries`` entries ``key=value`` (keys ``a``, ``b``, ... in order, two-digit values) of which
    ``num_right`` (at random places) hold the asked value and the others other values.

    Returns the row: ``prompt`` (context, newline, question), ``context``, ``value``, ``entries`` (all of them),
    ``right`` (the right entries), ``evidence`` (their ``[start, end]`` offsets in ``context``) and ``answer`` (the
    ground truth shown to the rubric judge).
    """
    if not 1 <= num_right <= num_entries <= len(KEYS):
        raise ValueError(f"Need 1 <= num_right ({num_right}) <= num_entries ({num_entries}) <= {len(KEYS)}.")
    values = [a + b for a in DIGITS for b in DIGITS]
    value = rng.choice(values)
    others = [v for v in values if v != value]
    right_at = set(rng.sample(range(num_entries), num_right))
    entries = [f"{KEYS[i]}={value if i in right_at else rng.choice(others)}" for i in range(num_entries)]
    context = " ".join(entries)
    right, evidence, position = [], [], 0
    for i, entry in enumerate(entries):
        if i in right_at:
            right.append(entry)
            evidence.append([position, position + len(entry)])
        position += len(entry) + 1
    return {
        "prompt": f"{context}\n{QUESTION.format(value=value)}",
        "context": context,
        "value": value,
        "entries": entries,
        "right": right,
        "evidence": evidence,
        "answer": GROUND_TRUTH.format(entries=", ".join(right)),
    }


def evidence_rows(
    seed: int, count: int, num_entries: int, right_weights: Sequence[float], exclude: set[str] | None = None
) -> list[dict[str, Any]]:
    """``count`` examples with distinct prompts (none in ``exclude``); the number of right entries is drawn with
    ``right_weights`` (index 0: one right entry)."""
    rng = random.Random(f"evidence-task-{seed}")
    seen = set(exclude or ())
    rows: list[dict[str, Any]] = []
    while len(rows) < count:
        num_right = rng.choices(range(1, len(right_weights) + 1), weights=right_weights)[0]
        row = evidence_example(rng, num_entries, num_right)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    return rows


def teacher_answer(row: dict[str, Any], rng: random.Random, mix: dict[str, float]) -> str:
    """A teacher's answer for cold-start SFT, of a kind drawn from ``mix`` (weights of ``exact``, ``overlong``,
    ``partial``, ``wrong``, ``invented``): one right entry; a stretch of the context of two or three entries holding a
    right one; a fragment of a right entry (``=37``, ``a=3`` or ``37``); a wrong entry; a right value under a key
    that does not hold it (``b=37``)."""
    kind = rng.choices(list(mix), weights=list(mix.values()))[0]
    entries, right = row["entries"], row["right"]
    wrong = [e for e in entries if e not in right]
    pick = rng.choice(right)
    if kind == "overlong":
        at = entries.index(pick)
        size = rng.choice((2, 3))
        start = rng.randint(max(0, at - size + 1), min(at, len(entries) - size))
        return " ".join(entries[start : start + size])
    if kind == "partial":
        key, value = pick.split("=")
        return rng.choice((f"={value}", f"{key}={value[0]}", value))
    if kind == "wrong" and wrong:
        return rng.choice(wrong)
    if kind == "invented" and wrong:
        return f"{rng.choice(wrong).split('=')[0]}={row['value']}"
    return pick


def evidence_splits(
    seed: int,
    num_sft: int,
    num_rl: int,
    num_eval: int,
    num_entries: int = 4,
    right_weights: Sequence[float] = (0.25, 0.5, 0.25),
    teacher_mix: dict[str, float] | None = None,
) -> tuple[Any, Any, Any]:
    """Seeded SFT, RL and held-out `datasets.Dataset`s with pairwise distinct prompts; SFT rows also have a
    ``completion`` (`teacher_answer` with ``teacher_mix``, default 60% exact, 15% over-long, 10% partial, 10% wrong,
    5% invented)."""
    from datasets import Dataset

    mix = teacher_mix or {"exact": 0.6, "overlong": 0.15, "partial": 0.1, "wrong": 0.1, "invented": 0.05}
    rows = evidence_rows(seed, num_sft + num_rl + num_eval, num_entries, right_weights)
    sft, rl, held_out = rows[:num_sft], rows[num_sft : num_sft + num_rl], rows[num_sft + num_rl :]
    teacher = random.Random(f"evidence-teacher-{seed}")
    for row in sft:
        row["completion"] = teacher_answer(row, teacher, mix)
    return Dataset.from_list(sft), Dataset.from_list(rl), Dataset.from_list(held_out)


# ----------------------------------------------------------------------------------------------------------------
# Reading a quote: its pieces, the scripted rubric, the behaviour
# ----------------------------------------------------------------------------------------------------------------
def piece_kinds(prediction: str, entries: Sequence[str], right: Sequence[str]) -> list[str]:
    """The kind of each whitespace-separated piece of ``prediction``: ``right`` (a right entry), ``wrong`` (another
    entry), ``right_fragment`` / ``fragment`` (a proper part of a right / another entry; a part of both counts as a
    right one), ``invented`` (in no entry)."""
    kinds = []
    for piece in prediction.split():
        if piece in right:
            kinds.append("right")
        elif piece in entries:
            kinds.append("wrong")
        elif any(piece in entry for entry in right):
            kinds.append("right_fragment")
        elif any(piece in entry for entry in entries):
            kinds.append("fragment")
        else:
            kinds.append("invented")
    return kinds


def _half_up(value: float) -> int:
    return int(math.floor(value + 0.5))


def rubric_scores(prediction: str, entries: Sequence[str], right: Sequence[str]) -> tuple[int, int, str]:
    """The careful judge's ``(precision, recall, explanation)`` on the 1–10 scale (module docstring)."""
    kinds = piece_kinds(prediction, entries, right)
    if not kinds:
        return 1, 1, "The prediction quotes nothing."
    support = sum(1.0 if k == "right" else 0.5 if k == "right_fragment" else 0.0 for k in kinds)
    precision = 1 + _half_up(9 * support / len(kinds))
    recall = 10 if "right" in kinds else 5 if "right_fragment" in kinds else 1
    counts = ", ".join(f"{kinds.count(k)} {k.replace('_', ' ')}" for k in dict.fromkeys(kinds))
    return precision, recall, f"The quote has {len(kinds)} piece(s): {counts}."


def classify_quote(prediction: str, entries: Sequence[str], right: Sequence[str]) -> str:
    """The behaviour of one answer, one of `BEHAVIOURS` (module docstring)."""
    kinds = piece_kinds(prediction, entries, right)
    if not kinds:
        return "empty"
    if len(kinds) > 1:
        return "overlong"
    return {"right": "exact", "wrong": "wrong", "invented": "invented"}.get(kinds[0], "partial")


def quote_metrics(answers: Sequence[str], rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Behaviour rates over ``answers`` (stripped) to ``rows``: each of `BEHAVIOURS`, ``invented_text`` (some piece is
    in no entry), ``holds_right`` (some piece is a right entry), ``multi_right`` (two or more right entries quoted),
    ``whole_context`` (the whole context quoted) and ``quote_chars`` (mean stripped length)."""
    total = max(1, len(answers))
    counts = dict.fromkeys(BEHAVIOURS, 0)
    invented = holds = multi = whole = chars = 0
    for answer, row in zip(answers, rows, strict=True):
        text = answer.strip()
        counts[classify_quote(text, row["entries"], row["right"])] += 1
        kinds = piece_kinds(text, row["entries"], row["right"])
        invented += "invented" in kinds
        holds += "right" in kinds
        multi += kinds.count("right") >= 2
        whole += text == row["context"]
        chars += len(text)
    return {
        **{k: v / total for k, v in counts.items()},
        "invented_text": invented / total,
        "holds_right": holds / total,
        "multi_right": multi / total,
        "whole_context": whole / total,
        "quote_chars": chars / total,
    }


def rubric_value(prediction: str, entries: Sequence[str], right: Sequence[str]) -> float:
    """The reward `RubricJudgeReward` gives for the scripted judge's scores: ``(p/10 + r/10) / 2``."""
    precision, recall, _ = rubric_scores(prediction, entries, right)
    return (precision / 10 + recall / 10) / 2


def canonical_answers(row: dict[str, Any]) -> dict[str, str]:
    """Answers of each type to one row, to score the reward definitions without a policy: ``one right entry`` (the
    first); with several right entries ``every right entry`` (joined by spaces: not a verbatim stretch when they are
    apart) and ``stretch over the right entries`` (the context from the first right entry to the last); ``whole
    context``; ``the value under every key`` (``a=37 b=37 c=37 d=37``: every candidate listed, the wrong ones
    invented); ``value fragment``
    (``=37``), ``wrong entry`` (when there is one), ``invented entry`` (the value under a key that does not hold it,
    when there is one)."""
    entries, right = row["entries"], row["right"]
    first, last = entries.index(right[0]), entries.index(right[-1])
    wrong = [e for e in entries if e not in right]
    answers = {"one right entry": right[0]}
    if len(right) > 1:
        answers["every right entry"] = " ".join(right)
        answers["stretch over the right entries"] = " ".join(entries[first : last + 1])
    answers["whole context"] = row["context"]
    answers["value fragment"] = f"={row['value']}"
    answers["the value under every key"] = " ".join(f"{e.split('=')[0]}={row['value']}" for e in entries)
    if wrong:
        answers["wrong entry"] = wrong[0]
        answers["invented entry"] = f"{wrong[0].split('=')[0]}={row['value']}"
    return answers


def definition_table(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Answer type -> ``{"f1": [...], "rubric": [...]}``: each reward of `canonical_answers` over ``rows`` (the F1 of
    `CharSpanF1Reward`'s scoring, the rubric reward of the scripted judge's scores)."""
    from trl_ext.rewards.span_f1 import char_span_f1

    table: dict[str, dict[str, list[float]]] = {}
    for row in rows:
        for kind, answer in canonical_answers(row).items():
            scores = table.setdefault(kind, {"f1": [], "rubric": []})
            scores["f1"].append(char_span_f1([answer], [tuple(s) for s in row["evidence"]], row["context"]))
            scores["rubric"].append(rubric_value(answer, row["entries"], row["right"]))
    return table


class ScriptedRubricJudge:
    """The rubric judge as a `ScriptedChatServer` script (an oracle, module docstring): it reads the request's QUERY
    (context and question), GROUND TRUTH (the right entries) and PREDICTION blocks, scores the prediction with
    `rubric_scores` and replies in the shape the system prompt asks for: the JSON verdict between the request's
    verdict tags. With ``echo_prediction`` it first writes a line quoting the prediction, as a judge that cites what
    it grades does: text in the prediction imitating a verdict then reaches the reply, and `RubricJudgeReward` must
    still read only the judge's own verdict."""

    _BLOCK = re.compile(r"<<<(DATA-[0-9a-f]{16}) ([A-Z ]+)\n(.*?)\n\1>>>", re.DOTALL)
    _TAG = re.compile(r"<(VERDICT-[0-9a-f]{16})>")

    def __init__(self, echo_prediction: bool = True):
        self.echo_prediction = echo_prediction

    @classmethod
    def blocks(cls, request: dict[str, Any]) -> dict[str, str]:
        """The DATA blocks of the request's first user message (a repair request repeats it), by name."""
        users = [m for m in request.get("messages", []) if m.get("role") == "user"]
        text = str(users[0].get("content") or "") if users else ""
        found: dict[str, str] = {}
        for _, name, body in cls._BLOCK.findall(text):
            found.setdefault(name, body)
        return found

    @staticmethod
    def read_task(query: str, ground_truth: str) -> tuple[list[str], list[str]]:
        """The context's entries (the query's first line) and the right entries (named in the ground truth)."""
        first_line = query.split("\n", 1)[0]
        return first_line.split(), ["=".join(m) for m in _ENTRY.findall(ground_truth)]

    def __call__(self, request: dict[str, Any]) -> str:
        blocks = self.blocks(request)
        system = " ".join(
            str(m.get("content") or "") for m in request.get("messages", []) if m.get("role") == "system"
        )
        tag = self._TAG.search(system)
        entries, right = self.read_task(blocks.get("QUERY", ""), blocks.get("GROUND TRUTH", ""))
        prediction = blocks.get("PREDICTION", "")
        precision, recall, explanation = rubric_scores(prediction, entries, right)
        verdict = json.dumps({"explanation": explanation, "precision": precision, "recall": recall})
        echo = f"The prediction reads: {prediction}\n" if self.echo_prediction else ""
        return f"{echo}<{tag.group(1)}>\n{verdict}\n</{tag.group(1)}>" if tag else f"{echo}{verdict}"


# ----------------------------------------------------------------------------------------------------------------
# Rewards and monitors (TRL reward functions)
# ----------------------------------------------------------------------------------------------------------------
def f1_reward() -> Any:
    """`CharSpanF1Reward` as it ships, on the ``evidence`` (offsets) and ``context`` columns; named ``char_span_f1``."""
    from trl_ext.rewards import CharSpanF1Reward

    return CharSpanF1Reward(gold_column="evidence", context_column="context")


def rubric_reward(base_url: str, **config: Any) -> Any:
    """`RubricJudgeReward` against the scripted judge at ``base_url`` (the ``answer`` column is the ground truth, the
    prompt the query); named ``rubric_judge``."""
    from trl_ext.rewards import RubricJudgeReward

    fields = {"api_key_env": None, "max_retries": 1, "timeout": 10.0, "max_concurrency": 64, **config}
    return RubricJudgeReward(base_url=base_url, model=JUDGE_MODEL, **fields)


def _texts(completions: Sequence[Any]) -> list[str]:
    from trl_ext.text import completion_text

    return [completion_text(c).strip() for c in completions]


def exact_entry_rate(
    completions: Sequence[Any], entries: Sequence[Any], right: Sequence[Any], **_: Any
) -> list[float]:
    """1.0 for an answer that is exactly one right entry (a monitor, weight 0)."""
    return [float(classify_quote(t, e, r) == "exact") for t, e, r in zip(_texts(completions), entries, right)]


def overlong_rate(completions: Sequence[Any], entries: Sequence[Any], right: Sequence[Any], **_: Any) -> list[float]:
    """1.0 for an answer of several pieces (a monitor, weight 0)."""
    return [float(classify_quote(t, e, r) == "overlong") for t, e, r in zip(_texts(completions), entries, right)]


def quote_chars(completions: Sequence[Any], **_: Any) -> list[float]:
    """The answer's length in characters, stripped (a monitor, weight 0)."""
    return [float(len(t)) for t in _texts(completions)]


MONITORS = (exact_entry_rate, overlong_rate, quote_chars)
