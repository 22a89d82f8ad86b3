"""`benchmarks/async_overlap.py` at its smallest: one prompt per step, a 1-layer model, one timed step per trainer.

It checks that the benchmark runs end to end and that what it reports is there and consistent (the same samples per
step for both trainers, one timed step each, a row per trainer); it asserts no wall time."""

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

    table, summary = async_overlap.report(results, args)
    assert table.count("\n| ") == 3  # header excluded: one row per trainer
    assert "max_staleness 1" in summary and "max_staleness 2" in summary
    assert "async_overlap.py --rounds 1 --steps 2 --prompts 1" in async_overlap.body(table, summary, args)
