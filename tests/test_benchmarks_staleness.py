"""`benchmarks/staleness_lag.py` at its smallest: what makes the study meaningful, and the direction that held on
every seed.

The study's claim rests on a real, steady lag: a trainer that sleeps after each optimizer step lets the sampler run
ahead until TRL's ``max_staleness`` = k holds it, so the trained samples are k versions old, and the trust region's
share is logged per lag. Its one finding that held on every seed and learning rate is that this share rises with the
lag; a CI-sized run (10 steps, 2 prompts, lr 6e-3) of IPO at k = 1 and k = 4 gave a lag-4 share 2.0-3.0x the lag-1
share on seeds 0-2, alike with native and scalar CPU kernels. The study's learning outcomes differ by seed and are not
asserted; nor is any wall time."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))


@pytest.mark.slow
def test_a_sleeping_trainer_trains_on_samples_k_versions_old_and_the_trust_region_acts_more_at_a_larger_lag(
    tmp_path, monkeypatch
):
    import _plots
    import staleness_lag
    from _monitors_runs import async_sft_policy

    from trl_ext.quickstart.copy_task import copy_task_splits

    js, sft, sft_dir = async_sft_policy(0, tmp_path / "sft")
    _, _, eval_set = copy_task_splits(0, js.num_sft_examples, js.num_rl_examples, js.num_eval_examples, js.digits)
    args = argparse.Namespace(steps=10, prompts=2, sleep=1.0)
    runs = {
        k: staleness_lag.run_arm(js, sft, sft_dir, eval_set.select(range(16)), "ipo", k, 6e-3, args) for k in (1, 4)
    }

    for k, record in runs.items():
        steps = record["steps"]
        assert len(steps) == args.steps
        lags = [entry["sample/staleness_mean"] for entry in steps]
        assert max(entry["sample/staleness_max"] for entry in steps) == k, lags  # never older than max_staleness
        assert sum(lags[-3:]) / 3 >= k - 0.5, f"k = {k}: the sampler did not run ahead: lags {lags}"
        assert staleness_lag.lag_share(record) is not None, f"no trust-region share logged at lag {k}"
        assert 0.0 <= record["after"] <= 1.0 and 0.0 <= record["after_exact"] <= 1.0
    assert staleness_lag.lag_share(runs[4]) > staleness_lag.lag_share(runs[1]), [
        staleness_lag.lag_share(r) for r in runs.values()
    ]

    record = runs[4]
    monkeypatch.setattr(_plots, "IMAGES", tmp_path)  # the plot of this one run, not benchmarks/images/
    record |= {"seed": 0, "before": 0.5, "before_exact": 0.1}
    names = argparse.Namespace(seeds=[0], ks=[4], lrs=[6e-3], steps=10, prompts=2, sleep=1.0, threads=1, jobs=1)
    table = staleness_lag.table([record])
    assert table.count("\n| 0.006 | 4 | IPO (default) | 0 |") == 1
    assert "k = 4" in staleness_lag.summary([record])
    assert "--ks 4 --lrs 0.006 --steps 10" in staleness_lag.render([record], names, None)
    assert (tmp_path / "staleness_lag.png").stat().st_size > 0
