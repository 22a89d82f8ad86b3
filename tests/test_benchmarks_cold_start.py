"""`benchmarks/cold_start_ablation.py` reduced to the direction that held on every seed measured (seeds 0-2,
benchmarks/RESULTS.md "Cold start"): SFT on the whole RL set collapses the RL policy's entropy at once (the
`EntropyMonitor` fires within the first 8 steps), SFT on a small holdout does not. The study's other finding, that
whole-set SFT did not hurt the held-out score on this task, is not asserted: it is a property of the copy task, not a
guarantee."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))


@pytest.mark.slow
def test_sft_on_the_whole_rl_set_collapses_entropy_where_a_small_holdout_does_not(tmp_path):
    import cold_start_ablation as study

    holdout = study.run_arm("holdout", 0, 12, tmp_path)
    full = study.run_arm("full", 0, 12, tmp_path)

    def entropy(record):
        return study.window(record["steps"], "entropy", first=True, share=1.0)

    def rules(record):
        return {rule for rule, _ in record["alerts"]}

    assert "entropy_collapse" in rules(full), full["alerts"]
    assert "entropy_collapse" not in rules(holdout), holdout["alerts"]
    assert entropy(full) < entropy(holdout) / 3, (entropy(full), entropy(holdout))
    assert len(full["steps"]) == len(holdout["steps"]) == 12
    assert 0.0 <= holdout["before"] <= 1.0 and 0.0 <= full["after"] <= 1.0
