"""The default monitors on real short runs: `benchmarks/monitors_eval.py` (issue 31) at its smallest, so the
benchmark never rots. The judge-credit miniature of the quickstart (a tiny model after cold-start SFT on digit
copying, `JudgeCreditTrainer`, IPO, LoRA, a scripted judge on 127.0.0.1) raises nothing on a healthy run, and a
learning rate x30 injected mid-run is caught by its rule within 5 steps."""

from __future__ import annotations

import dataclasses
import json
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


@pytest.mark.slow
def test_the_rlmt_and_async_workloads_run_quiet_when_healthy_and_catch_a_judge_outage(tmp_path):
    # The benchmark's other workloads at their smallest: a healthy RLMT miniature run raises nothing; an asynchronous
    # judge-credit run whose judge goes down at step 3 is caught by judge_failure.
    healthy = monitors_eval.run_rlmt(0, 6, 3, None)
    [outage] = [p for p in monitors_eval.ASYNC_PATHOLOGIES if p.name == "judge fails"]
    js, sft, sft_dir = monitors_eval.async_sft_policy(0, tmp_path / "sft")
    sick = monitors_eval.run_async(js, sft, sft_dir, 6, 3, outage, logs_dir=str(tmp_path / "logs"))
    healthy, sick = monitors_eval.evaluate([healthy, sick])
    assert healthy["steps"] == 6 and healthy["alerts"] == []
    assert sick["false"] == [] and sick["caught_by"] == "judge_failure" and sick["delay"] <= 3, sick["alerts"]
    # The saved logs replay to the same alerts under the current rules.
    [saved] = (tmp_path / "logs").glob("*.json")
    assert monitors_eval.replayed_record(saved)["alerts"] == sick["alerts"]


def quickstart_run(folder: Path, kls: list[float], **settings) -> Path:
    """A quickstart RL output folder as `trl-ext quickstart` leaves it: its settings in ``trl_ext_run.json``, a log
    history with the KL ``kls`` (one log per step)."""
    from trl_ext.quickstart import QuickstartSettings

    folder.mkdir(parents=True)
    recorded = dataclasses.asdict(dataclasses.replace(QuickstartSettings.default(1), **settings))
    (folder / "trl_ext_run.json").write_text(json.dumps({"extra": {"settings": recorded}}))
    history = [
        {"step": step, "loss": 0.0, "kl": kl, "entropy": 1.0, "ipo/masked_ratio": 0.0}
        for step, kl in enumerate(kls, start=1)
    ]
    (folder / "trainer_state.json").write_text(json.dumps({"log_history": history, "global_step": len(kls)}))
    return folder


def test_replayed_quickstart_runs_keep_their_folder_settings_and_alerts(tmp_path):
    quiet = [0.01, 0.012, 0.011, 0.013, 0.012, 0.014]
    quickstart_run(tmp_path / "seed1-default" / "default", quiet)
    quickstart_run(tmp_path / "seed1-default" / "constant", [*quiet, 0.09], rl_steps=7)
    records = monitors_eval.stepwise_log_records([tmp_path])
    assert [(r["run"], r["seed"], r["alerts"]) for r in records] == [
        ("seed1-default/constant", 1, [("kl_spike", 7)]),
        ("seed1-default/default", 1, []),
    ]
    assert records[0]["settings"] == "not the default: rl_steps=7 (default 28)"
    assert records[1]["settings"] == "default settings" and records[1]["pathology"] == "healthy"
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "trainer_state.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no trl_ext_run.json: --stepwise-logs replays the output folders"):
        monitors_eval.stepwise_log_records([tmp_path / "bare"])
