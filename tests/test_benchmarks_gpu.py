"""`benchmarks/gpu.py --smoke`: every arm of the GPU benchmark at tiny sizes on the CPU, so the script never rots.

It checks what the figures rest on, not wall times: each arm trains, the arms of a workload see the same rows
(same trained tokens, same losses: packing, flattening and the trainer change the cost, not the result), packing
forwards fewer tokens, LoRA trains fewer parameters, the judge marks spans, and the report renders every arm and
ratio. FlexAttention has no backward on the CPU: its arms must say so instead of running."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

import gpu  # noqa: E402


def options(**overrides) -> argparse.Namespace:
    defaults = dict(smoke=True, budget_s=None, peak_tflops=None, json=None)
    return argparse.Namespace(**{**defaults, **overrides})


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "gpu.json"
    return gpu.run(gpu.ARMS, gpu.SMOKE, "cpu", options(json=str(path))), path


def approx(values):
    return pytest.approx(values, rel=1e-3, abs=1e-6)


@pytest.mark.slow
def test_every_arm_trains_on_the_cpu_but_flex_which_says_why(report):
    results = report[0]["results"]
    assert list(results) == [arm.name for arm in gpu.ARMS]
    for name, result in results.items():
        if result["attention"] == "flex_attention":
            assert result["status"] == "skipped" and "no backward on the CPU" in result["reason"], name
            continue
        assert result["status"] == "ok", (name, result)
        assert result["steps_timed"] == gpu.SMOKE.timed_steps
        assert len(result["losses"]) == gpu.SMOKE.warmup_steps + gpu.SMOKE.timed_steps
        assert all(math.isfinite(loss) for loss in result["losses"]), name
        assert result["train_ms"] > 0 and result["step_ms"] >= result["train_ms"]
        assert result["mfu"] is None and result["peak_memory_gib"] is None  # no peak known, no GPU


@pytest.mark.slow
def test_arms_of_a_workload_train_on_the_same_rows(report):
    results = report[0]["results"]
    sizes = gpu.SMOKE
    grpo = [name for name, r in results.items() if r["workload"] == "grpo" and r["status"] == "ok"]
    for name in grpo:  # G completions a step, all trained on
        assert results[name]["loss_tokens"] == sizes.group * sizes.completion_tokens, name
    rows = sizes.group * (sizes.prompt_tokens + sizes.completion_tokens)
    assert results["grpo TRL dapo"]["forward_tokens"] == results["grpo Ext ipo"]["forward_tokens"] == rows
    # packed: the prompt's first P - 1 tokens once, then each branch re-reads the last prompt token (docs/packing.md)
    packed = sizes.prompt_tokens - 1 + sizes.group * (sizes.completion_tokens + 1)
    assert results["grpo Ext ipo packed"]["forward_tokens"] == packed
    # the same log-probs whatever the rows (the GRPO losses are ~0 on-policy: the entropies carry the check)
    for name in ("grpo Ext ipo", "grpo Ext ipo packed"):
        assert results[name]["entropies"] == approx(results["grpo TRL dapo"]["entropies"]), name

    for suffix in ("", " LoRA"):
        packed, unpacked, flat = (results[f"stepwise {kind}{suffix}"] for kind in ("packed", "rows", "flat"))
        assert packed["loss_tokens"] == unpacked["loss_tokens"] == flat["loss_tokens"] > 0
        for key in ("losses", "entropies"):
            assert packed[key] == approx(unpacked[key]) and flat[key] == approx(unpacked[key]), key
        assert (
            packed["forward_tokens"] < unpacked["forward_tokens"]
            and flat["forward_tokens"] < unpacked["forward_tokens"]
        )
        assert packed["nograd_tokens"] == unpacked["nograd_tokens"] == flat["nograd_tokens"] == 0  # on-policy
    assert results["stepwise packed LoRA"]["trainable_params"] < results["stepwise packed"]["trainable_params"] / 2


@pytest.mark.slow
def test_the_judge_marks_spans_on_every_step(report):
    judged = report[0]["results"]["grpo JudgeCredit ipo packed"]
    assert len(judged["judge_spans"]) == gpu.SMOKE.warmup_steps + gpu.SMOKE.timed_steps
    assert min(judged["judge_spans"]) >= 1


@pytest.mark.slow
def test_report_renders_every_arm_and_the_ratios_of_arms_that_ran(report):
    data, path = report
    assert path.is_file()  # written after every arm
    text = gpu.render(data)
    for name in data["results"]:
        assert f"| {name} |" in text
    labels = [label for label, _, _ in gpu.ratios(data["results"])]
    assert labels == [label for label, a, b in gpu.RATIOS if "flex" not in a and "flex" not in b]
    for label in labels:
        assert f"- {label}: **" in text
    assert "python benchmarks/gpu.py --smoke" in text


def test_full_size_needs_a_gpu_and_arm_names_are_checked(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["gpu.py", "--device", "cpu"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU; --smoke runs the tiny sizes"):
        gpu.main()
    monkeypatch.setattr(sys, "argv", ["gpu.py", "--smoke", "--device", "cpu", "--only", "grpo TRL dapo,no such arm"])
    with pytest.raises(SystemExit, match=r"unknown arm\(s\) \['no such arm'\]"):
        gpu.main()


def test_a_spent_budget_skips_the_remaining_arms():
    report = gpu.run(gpu.ARMS[:2], gpu.SMOKE, "cpu", options(budget_s=-1.0))
    assert [r["status"] for r in report["results"].values()] == ["skipped", "skipped"]
    assert "time budget" in report["results"]["grpo TRL dapo"]["reason"]


def test_the_scripted_judge_quotes_each_marked_segment():
    request = {
        "messages": [
            {
                "role": "user",
                "content": "<<<DATA-0123456789abcdef TRACE\n⟦0⟧alpha ⟦2⟧beta\n⟦5⟧ \nDATA-0123456789abcdef>>>\n\n"
                "The trace has 7 tokens (indices 0 to 6).",
            }
        ]
    }
    spans = json.loads(gpu.every_segment_judge(request))["spans"]
    assert spans == [
        {"start": 0, "end": 2, "label": "key_progress", "confidence": 1.0, "quote": "alpha"},
        {"start": 2, "end": 5, "label": "original_error", "confidence": 1.0, "quote": "beta"},
    ]
