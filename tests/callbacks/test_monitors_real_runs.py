"""The default monitors on real short runs: `benchmarks/monitors_eval.py` (issue 31) at its smallest, so the
benchmark never rots. The judge-credit miniature of the quickstart (a tiny model after cold-start SFT on digit
copying, `JudgeCreditTrainer`, IPO, LoRA, a scripted judge on 127.0.0.1) raises nothing on a healthy run, and a
learning rate x30 injected mid-run is caught by its rule within 5 steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import monitors_eval  # noqa: E402

STEPS, ONSET = 14, 8


@pytest.mark.slow
def test_a_learning_rate_blow_up_is_caught_within_5_steps_and_the_healthy_run_is_quiet():
    js, sft = monitors_eval.sft_policy(0, cache_dir=None)
    [blow_up] = [p for p in monitors_eval.PATHOLOGIES if p.name == "learning rate x30"]
    healthy, sick = monitors_eval.evaluate(
        [monitors_eval.run(js, sft, STEPS, ONSET, pathology) for pathology in (None, blow_up)]
    )
    assert healthy["alerts"] == []
    assert sick["false"] == []  # nothing before the onset
    assert sick["caught_by"] in blow_up.expected and sick["delay"] <= 5, sick["alerts"]
