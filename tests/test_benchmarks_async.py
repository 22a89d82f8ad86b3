"""`benchmarks/async_overlap.py` at its smallest: one prompt per step, a 1-layer model, one timed step per trainer.

It checks that the benchmark runs end to end and that what it reports is there and consistent (the same samples per
step for both trainers, one timed step each, a row per trainer), and that every trainer trains (a grad norm above 0, no
token masked: a group's rollouts differ, and the scripted sampler's p_old = 1 is inside the trust region); it asserts
no wall time."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

import async_overlap  # noqa: E402


@pytest.mark.slow
def test_smallest_configuration_runs_every_trainer_for_one_timed_step(tmp_path):
    args = argparse.Namespace(rounds=1, steps=2, prompts=1, latency_ms=10.0, hidden=32, layers=1)
    model_dir = async_overlap.save_model(tmp_path / "model", args.hidden, args.layers)
    results = {
        kind: async_overlap.run(kind, model_dir, args, str(tmp_path / kind)) for kind in ("sync", "async-1", "async-2")
    }

    for kind, series in results.items():
        for name in ("step", "generation", "training"):
            assert len(series[name]) == 1, f"{kind}: one step timed after the warm-up, got {series[name]}"
            assert math.isfinite(series[name][0]) and series[name][0] >= 0
    assert results["sync"]["step"][0] == pytest.approx(
        results["sync"]["generation"][0] + results["sync"]["training"][0]
    )
    for kind in ("async-1", "async-2"):
        assert len(results[kind]["dropped"]) == args.steps and min(results[kind]["dropped"]) >= 0
    for kind, series in results.items():
        assert len(series["grad_norm"]) == args.steps, kind
        assert min(series["grad_norm"]) > 0 and max(series["masked"]) == 0.0, f"{kind} trained nothing: {series}"

    table, summary = async_overlap.report(results, args)
    assert table.count("\n| ") == 3  # header excluded: one row per trainer
    assert "max_staleness 1" in summary and "max_staleness 2" in summary
    assert "| grad norm | IPO masked |" in table and "trained nothing" not in summary
    assert "async_overlap.py --rounds 1 --steps 2 --prompts 1" in async_overlap.body(table, summary, args)


def test_report_names_a_trainer_that_trained_nothing():
    args = argparse.Namespace(rounds=1, steps=2, prompts=1, latency_ms=10.0, hidden=32, layers=1)
    series = {"step": [1.0], "generation": [0.5], "training": [0.5], "grad_norm": [0.0, 0.0], "masked": [1.0, 1.0]}
    table, summary = async_overlap.report({"sync": series}, args)
    assert table.endswith("| 0 | 100 % |")
    assert "sync `StepwiseRLMTrainer`: median grad norm 0: it trained nothing" in summary
