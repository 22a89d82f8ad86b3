"""`benchmarks/staleness_lag.py` at its smallest: what makes the study meaningful holds.

The study's claim rests on a real, steady lag: a trainer that sleeps after each optimizer step lets the sampler run
ahead until TRL's ``max_staleness`` = k holds it, so the trained samples are k versions old, and the trust region's
share is logged per lag. This runs one short arm at k = 2 from the seed's cold-start policy and checks exactly that,
and that the rendering names every arm it ran; it asserts no wall time and no learning outcome (the study's
outcomes differ by seed: benchmarks/RESULTS.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))


@pytest.mark.slow
def test_a_sleeping_trainer_trains_on_samples_k_versions_old(tmp_path, monkeypatch):
    import _plots
    import staleness_lag
    from _monitors_runs import async_sft_policy

    from trl_ext.quickstart.copy_task import copy_task_splits

    js, sft, sft_dir = async_sft_policy(0, tmp_path / "sft")
    _, _, eval_set = copy_task_splits(0, js.num_sft_examples, js.num_rl_examples, js.num_eval_examples, js.digits)
    args = argparse.Namespace(steps=7, prompts=2, sleep=1.0)
    record = staleness_lag.run_arm(js, sft, sft_dir, eval_set.select(range(16)), "ipo", 2, 3e-3, args)

    steps = record["steps"]
    assert len(steps) == args.steps
    lags = [entry["sample/staleness_mean"] for entry in steps]
    assert max(entry["sample/staleness_max"] for entry in steps) == 2, lags  # never older than max_staleness
    assert sum(lags[-3:]) / 3 >= 1.5, f"the sampler did not run ahead: lags {lags}"
    assert any("ipo/masked_ratio/lag_2" in entry for entry in steps), "no trust-region share logged at lag 2"
    assert 0.0 <= record["after"] <= 1.0 and 0.0 <= record["after_exact"] <= 1.0

    monkeypatch.setattr(_plots, "IMAGES", tmp_path)  # the plot of this one run, not benchmarks/images/
    record |= {"seed": 0, "before": 0.5, "before_exact": 0.1}
    names = argparse.Namespace(seeds=[0], ks=[2], lrs=[3e-3], steps=7, prompts=2, sleep=1.0, threads=1, jobs=1)
    table = staleness_lag.table([record])
    assert table.count("\n| 0.003 | 2 | IPO (default) | 0 |") == 1
    assert "k = 2" in staleness_lag.summary([record])
    assert "--ks 2 --lrs 0.003 --steps 7" in staleness_lag.render([record], names, None)
    assert (tmp_path / "staleness_lag.png").stat().st_size > 0
