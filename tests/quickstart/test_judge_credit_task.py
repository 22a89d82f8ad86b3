"""The judge-credit miniature's task, judge and reward (trl_ext.quickstart.copy_task) and settings
(trl_ext.quickstart.judge_credit); its end-to-end run is in test_quickstart.py."""

from __future__ import annotations

import json

import pytest

from trl_ext.judge.markers import build_marked_trace
from trl_ext.judge.prompts import build_messages
from trl_ext.quickstart.copy_task import (
    ScriptedSpanJudge,
    copy_digit_accuracy_reward,
    copy_exact_match_reward,
    copy_prompt,
    copy_task_splits,
    digit_accuracy,
)
from trl_ext.quickstart.judge_credit import JudgeCreditSettings
from trl_ext.quickstart.settings import QuickstartSettings
from trl_ext.testing import build_tiny_tokenizer


def test_copy_task_splits_are_seeded_disjoint_and_well_formed():
    sft, rl, held_out = copy_task_splits(3, 40, 200, 60, digits=5)
    again = copy_task_splits(3, 40, 200, 60, digits=5)
    other = copy_task_splits(4, 40, 200, 60, digits=5)
    assert [len(sft), len(rl), len(held_out)] == [40, 200, 60]
    assert sft["answer"] == again[0]["answer"] and held_out["prompt"] == again[2]["prompt"]
    assert sft["answer"] != other[0]["answer"]
    answers = [set(sft["answer"]), set(rl["answer"]), set(held_out["answer"])]
    assert sum(map(len, answers)) == 300 and len(set.union(*answers)) == 300  # distinct, pairwise disjoint
    for row in held_out:
        assert len(row["answer"]) == 5 and row["answer"].isdigit()
        assert row["prompt"] == copy_prompt(row["answer"]) == f"Copy: {' '.join(row['answer'])} ="
    assert sft["completion"] == sft["answer"] and "completion" not in rl.column_names


def test_digits_are_tokens_but_100():
    """Mostly one token per digit; the tiny tokenizer's few merges (``10``, ``100``, ...) make a multi-digit token,
    which the judge grades as a whole (test_judge_grades_a_multi_digit_token)."""
    tokenizer = build_tiny_tokenizer()
    for answer in ("47291", "38567", "99999"):
        assert [tokenizer.decode([i]) for i in tokenizer(answer)["input_ids"]] == list(answer)
    assert [tokenizer.decode([i]) for i in tokenizer("10020")["input_ids"]] == ["100", "2", "0"]


def test_rewards():
    completions = ["47291", " 47291 ", "47281", "4729", "472911", "", [{"role": "assistant", "content": "47291"}]]
    assert copy_exact_match_reward(completions, ["47291"] * 7) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert copy_digit_accuracy_reward(completions, ["47291"] * 7) == [1.0, 1.0, 0.8, 0.8, 1.0, 0.0, 1.0]
    assert digit_accuracy("9", "47291") == 0.0


def _marked(text: str) -> str:
    tokenizer = build_tiny_tokenizer()
    return build_marked_trace(tokenizer, tokenizer(text)["input_ids"], every=1).marked


def test_judge_marks_exactly_the_wrong_digit():
    judge = ScriptedSpanJudge(progress_confidence=1.0, error_confidence=0.5)
    marked = "⟦0⟧4⟦1⟧7⟦2⟧8⟦3⟧9⟦4⟧1"  # reference 47291: token 2 is wrong
    assert _marked("47891") == marked
    spans = judge.spans(marked, "47291")
    assert [(s["start"], s["end"], s["label"], s["quote"]) for s in spans] == [
        (0, 1, "key_progress", "4"),
        (1, 2, "key_progress", "7"),
        (2, 3, "original_error", "8"),
        (3, 4, "key_progress", "9"),
        (4, 5, "key_progress", "1"),
    ]
    assert [s["confidence"] for s in spans] == [1.0, 1.0, 0.5, 1.0, 1.0]


def test_judge_grades_a_multi_digit_token():
    spans = ScriptedSpanJudge().spans(_marked("10030"), "10020")
    assert [(s["start"], s["end"], s["label"], s["quote"]) for s in spans] == [
        (0, 1, "key_progress", "100"),
        (1, 2, "original_error", "3"),
        (2, 3, "key_progress", "0"),
    ]
    assert ScriptedSpanJudge().spans(_marked("10020"), "12020")[0]["label"] == "original_error"


def test_judge_later_errors_and_overrun():
    judge = ScriptedSpanJudge(error_confidence=0.1, overrun_confidence=1.0)
    labels = [(s["label"], s["confidence"]) for s in judge.spans(_marked("3729155"), "47291")]
    assert labels == [("original_error", 0.1)] + [("key_progress", 1.0)] * 4 + [("dependent_error", 1.0)] * 2
    first_only = ScriptedSpanJudge(later_errors=False).spans(_marked("37391"), "47291")
    assert [s["label"] for s in first_only] == ["original_error", "key_progress", "key_progress", "key_progress"]
    assert judge.spans(_marked("47291"), "47291") == [
        {"start": i, "end": i + 1, "label": "key_progress", "confidence": 1.0, "quote": d}
        for i, d in enumerate("47291")
    ]


def test_judge_reads_the_request_the_trainer_sends():
    """The verdict comes from the TRACE and REFERENCE ANSWER blocks of a real judge request (nonce-fenced)."""
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer("41291")["input_ids"]
    trace = build_marked_trace(tokenizer, ids, every=1)
    messages = build_messages(
        question=copy_prompt("47291"),
        marked_trace=trace.marked,
        num_tokens=len(ids),
        final_answer="41291",
        verdict="copy_exact_match_reward = 0",
        reference_answer="47291",
        reference_solution=None,
        label_scores={"key_progress": 0.5, "original_error": -1.0, "dependent_error": -0.5},
        tool_names=[],
        max_rounds=0,
    )
    reply = json.loads(ScriptedSpanJudge()({"messages": messages}))
    errors = [s for s in reply["spans"] if s["label"] != "key_progress"]
    assert errors == [{"start": 1, "end": 2, "label": "original_error", "confidence": 1.0, "quote": "1"}]
    no_reference = [
        m if m["role"] == "system" else {**m, "content": m["content"].split("REFERENCE")[0]} for m in messages
    ]
    assert json.loads(ScriptedSpanJudge()({"messages": no_reference})) == {"spans": []}


def test_settings_follow_the_quickstart_seed():
    assert JudgeCreditSettings.from_quickstart(QuickstartSettings(seed=7), fast=False) == JudgeCreditSettings(seed=7)
    fast = JudgeCreditSettings.from_quickstart(QuickstartSettings(seed=7), fast=True)
    assert fast.seed == 7 and fast.rl_steps == 2 and not fast.compare_outcome_only
    JudgeCreditSettings.default().validate()
    with pytest.raises(ValueError, match="num_generations"):
        JudgeCreditSettings(num_generations=1).validate()


@pytest.mark.slow
def test_ablation_runs_both_arms_from_one_sft_model(tmp_path):
    """Two tiny RL runs (λ = 0 and 1) from the same SFT model: same starting figures, one row each, the judge's
    credit present only with λ > 0."""
    from trl_ext.quickstart.judge_credit import judge_credit_ablation

    settings = JudgeCreditSettings.fast()
    rows = judge_credit_ablation(seeds=(0,), lambdas=(0.0, 1.0), output_root=tmp_path, settings=settings)
    assert [(r["seed"], r["judge_lambda"]) for r in rows] == [(0, 0.0), (0, 1.0)]
    assert rows[0]["exact_match_before"] == rows[1]["exact_match_before"]
    assert rows[0]["digit_acc_before"] == rows[1]["digit_acc_before"]
    # λ = 0: a share of 0, or none where every advantage was 0 too (0/0 is not logged); λ = 1: credit.
    assert rows[0]["judge_share_mean"] in (0.0, None) and rows[1]["judge_share_mean"] > 0.0
