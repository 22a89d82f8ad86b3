"""Tests of `plot_run` and `trl-ext plot` on real and synthetic run folders."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trl_ext.callbacks import ALERTS, find_trainer_state, plot_run, plotting
from trl_ext.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DPI, WIDTH_IN = 110, 11


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def expected_size(panels: int) -> tuple[int, int]:
    return round(WIDTH_IN * DPI), round((2.2 * panels + 0.9) * DPI)


@pytest.fixture(scope="module")
def collapsed_run(tmp_path_factory):
    """A real GRPO run (tiny model, KL to a reference, num_iterations=2) that collapses and is stopped."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from trl_ext.callbacks import add_monitors
    from trl_ext.testing import build_tiny_model_and_tokenizer

    root = tmp_path_factory.mktemp("plot_run")
    model, tokenizer = build_tiny_model_and_tokenizer(seed=0)
    model.save_pretrained(root / "model")  # beta > 0 needs a model path (the reference is loaded from it)
    tokenizer.save_pretrained(root / "model")

    def repetition_reward(completions, completion_ids=None, **kwargs):
        return [1.0 - len(set(ids)) / max(1, len(ids)) for ids in completion_ids]

    args = GRPOConfig(
        output_dir=str(root / "run"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        disable_tqdm=True,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        num_iterations=2,
        beta=0.01,
        max_steps=40,
        logging_steps=1,
        save_strategy="steps",
        save_steps=10,
        seed=0,
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i} + 3?"}] for i in range(16)]})
    trainer = GRPOTrainer(
        model=str(root / "model"),
        reward_funcs=repetition_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    add_monitors(trainer)
    trainer.train()
    return root / "run", trainer.state.global_step


@pytest.mark.slow  # trains the tiny model (~5-12 s on a shared CPU)
def test_plot_of_a_real_collapsed_run(collapsed_run, tmp_path):
    run_dir, stopped_at = collapsed_run
    assert stopped_at < 40  # the default monitors stopped it
    # The stop wrote trainer_state.json at the top level; it is newer than the last checkpoint.
    assert find_trainer_state(run_dir) == run_dir / "trainer_state.json"
    history = json.loads((run_dir / "trainer_state.json").read_text())["log_history"]
    assert any(key.startswith("monitor/alerts/") for entry in history for key in entry)

    path = plot_run(run_dir)
    assert path == run_dir / "monitors.png"
    assert png_size(path) == expected_size(4)  # reward, clip rate, entropy, KL
    assert path.stat().st_size > 20_000


@pytest.mark.slow  # trains the tiny model (~5-12 s on a shared CPU)
def test_cli_plot_writes_the_png_and_prints_its_path(collapsed_run, tmp_path, capsys):
    run_dir, _ = collapsed_run
    out = tmp_path / "figures" / "health.png"
    assert main(["plot", str(run_dir), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert png_size(out) == expected_size(4)


def test_cli_plot_reports_errors_with_exit_code_1(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "missing")]) == 1
    assert "does not exist; pass the output_dir of a training run" in capsys.readouterr().err
    assert main(["plot", str(tmp_path)]) == 1
    assert "No trainer_state.json" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Synthetic run folders


def write_state(folder: Path, history, global_step=None, **extra) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    step = global_step if global_step is not None else max((h.get("step", 0) for h in history), default=0)
    state = {"global_step": step, "max_steps": extra.pop("max_steps", step), "log_history": history, **extra}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    return folder / "trainer_state.json"


def synthetic_history(steps=12, judge=False, alerts=()):
    history = []
    for step in range(1, steps + 1):
        entry = {"step": step, "reward": 0.1 * step, "reward_std": 0.1, "entropy": 1.0 - 0.05 * step}
        entry["clip_ratio/region_mean"] = 0.05
        if judge:
            entry.update({"judge/share": 0.06, "judge/failure_ratio": 0.02})
        for rule, at in alerts:
            if at == step:
                entry[f"monitor/alerts/{rule}"] = 1.0
        history.append(entry)
    history.append({"step": steps, "eval_reward": 0.3})  # eval logs are skipped
    history.append({"step": steps, "train_runtime": 1.0})
    return history


def test_newest_checkpoint_is_used_when_there_is_no_top_level_state(tmp_path):
    write_state(tmp_path / "checkpoint-5", synthetic_history(5))
    newest = write_state(tmp_path / "checkpoint-10", synthetic_history(10))
    write_state(tmp_path / "checkpoint-9", synthetic_history(9))
    (tmp_path / "checkpoint-20").mkdir()  # no state inside: ignored
    assert find_trainer_state(tmp_path) == newest
    # A stale top-level file (saved before a resume) loses against a newer checkpoint ...
    write_state(tmp_path, synthetic_history(4))
    assert find_trainer_state(tmp_path) == newest
    # ... a newer one wins, and a file or checkpoint folder can be passed directly.
    top = write_state(tmp_path, synthetic_history(12))
    assert find_trainer_state(tmp_path) == top
    assert find_trainer_state(newest) == newest and find_trainer_state(newest.parent) == newest


def test_panels_follow_the_logged_metrics(tmp_path):
    with_judge = write_state(tmp_path / "judge", synthetic_history(judge=True, alerts=[("judge_failure", 4)]))
    assert png_size(plot_run(with_judge.parent)) == expected_size(4)  # reward, clip, entropy, judge (no KL)
    reward_only = write_state(tmp_path / "reward", [{"step": s, "reward": 0.5} for s in range(1, 6)])
    out = plot_run(reward_only.parent, out=tmp_path / "reward.png")
    assert out == tmp_path / "reward.png" and png_size(out) == expected_size(1)


def test_alerts_and_the_monitor_settings_saved_in_the_state_are_drawn(tmp_path):
    monitors = {
        "ClipRateMonitor": {
            "args": {"healthy_min": 0.02, "healthy_max": 0.3},
            "attributes": {"monitor_state": {"aggregate": 2}},
        },
        "EntropyMonitor": {"args": {"entropy_floor": 0.1, "max_drop": 0.8, "baseline_logs": 3}, "attributes": {}},
    }
    history = synthetic_history(alerts=[("entropy_collapse", 9), ("clip_rate_drop", 6)])
    state_path = write_state(tmp_path, history, max_steps=50, stateful_callbacks=monitors)
    assert png_size(plot_run(state_path)) == expected_size(3)
    assert (tmp_path / "monitors.png").exists()


def async_history(steps=12, staleness=True, wait=True, alerts=()):
    """`synthetic_history` with the keys TRL's AsyncGRPOTrainer logs (staleness: sample/*, batch/samples_per_step;
    wait: perf/rollout_wait_s, perf/step_s - none at the first step)."""
    history = synthetic_history(steps, alerts=alerts)
    for entry in history[:steps]:
        step = entry["step"]
        if staleness:
            entry.update({"batch/samples_per_step": 16.0, "sample/staleness_mean": 1.5, "sample/staleness_max": 3.0})
            if step > 8:
                entry["sample/dropped_stale_total"] = 24.0  # absent before: nothing dropped
        if wait:
            entry["perf/rollout_wait_s"] = 0.5
            if step > 1:
                entry["perf/step_s"] = 2.0
    return history


def test_an_asynchronous_run_gets_staleness_and_rollout_wait_panels(tmp_path):
    monitors = {
        "StalenessMonitor": {
            "args": {"max_wait_share": 0.8},
            "attributes": {"monitor_state": {"max_staleness": 4, "last_window_end": 12}},
        }
    }
    history = async_history(alerts=[("stale_rollouts", 10), ("trainer_starved", 11)])
    state_path = write_state(tmp_path / "async", history, stateful_callbacks=monitors)
    assert png_size(plot_run(state_path)) == expected_size(5)  # reward, clip, entropy, staleness, rollout wait
    # Without saved monitor state the panels still draw (max_staleness unknown: no line).
    bare = write_state(tmp_path / "bare", async_history(wait=False))
    assert png_size(plot_run(bare.parent)) == expected_size(4)  # reward, clip, entropy, staleness
    # A synchronous run's history has neither panel.
    sync = write_state(tmp_path / "sync", synthetic_history())
    assert png_size(plot_run(sync.parent)) == expected_size(3)
    # The staleness metrics alone are enough for a plot.
    only = [{k: v for k, v in e.items() if k == "step" or "/" in k and "clip" not in k} for e in async_history()]
    write_state(tmp_path / "only", only)
    assert png_size(plot_run(tmp_path / "only")) == expected_size(2)


def test_the_derived_shares_follow_trls_counting():
    history = async_history(steps=10)
    steps, shares = plotting._derived_series(history, plotting.DROPPED_SHARE)
    assert steps == list(range(1, 11)) and shares == [0.0] * 8 + [0.6, 0.6]  # 24 dropped, 16 trained
    sparse = [history[1], history[4], history[9]]  # steps 2, 5, 10: windows of 2, 3 and 5 steps
    assert plotting._derived_series(sparse, plotting.DROPPED_SHARE)[1] == [0.0, 0.0, 24 / (24 + 80)]
    steps, waits = plotting._derived_series(history, plotting.WAIT_SHARE)
    assert steps == list(range(2, 11)) and waits == [0.25] * 9  # no perf/step_s at the first step


def test_every_rule_has_a_marker_panel():
    assert set(plotting._RULE_MARKER) == set(ALERTS)


def test_a_history_without_grpo_metrics_is_an_error(tmp_path):
    write_state(tmp_path, [{"step": 1, "loss": 0.3}])
    with pytest.raises(
        ValueError, match="no reward, clip_ratio/region_mean, ipo/masked_ratio, entropy, kl, judge or st"
    ):
        plot_run(tmp_path)


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    write_state(tmp_path, synthetic_history())
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=r"pip install 'trl-ext\[plot\]'"):
        plot_run(tmp_path)


def test_plotting_imports_neither_transformers_nor_pyplot(tmp_path):
    write_state(tmp_path, synthetic_history())
    code = (
        "import sys, trl_ext.cli\n"
        "from trl_ext.callbacks import plot_run\n"
        "assert 'transformers' not in sys.modules and 'matplotlib' not in sys.modules\n"
        f"plot_run({str(tmp_path)!r})\n"
        "assert 'transformers' not in sys.modules and 'matplotlib.pyplot' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "monitors.png").exists()
