"""The `trl-ext` command line: subcommands, clear argument errors, the quickstart's report."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trl_ext import __version__
from trl_ext.cli import build_parser, format_quickstart_report, main


def test_version_subprocess():
    out = subprocess.run([sys.executable, "-m", "trl_ext.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"trl-ext {__version__}"


def test_help_lists_the_subcommands(capsys):
    assert main([]) == 0
    printed = capsys.readouterr().out
    for command in ("quickstart", "train", "tiny-model", "push", "plot"):
        assert command in printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["quickstart", "--steps", "0"], "--steps: must be >= 1, got 0"),
        (["quickstart", "--steps", "many"], "--steps: expected a whole number, got 'many'"),
        (["quickstart", "--seed", "-1"], "--seed: must be >= 0, got -1"),
        (["quickstart", "--method", "ppo"], "--method: invalid choice: 'ppo'"),
        (["quickstart", "--bogus"], "unrecognized arguments: --bogus"),
        (["push", "only-one-argument"], "the following arguments are required: REPO_ID"),
        (["train"], "the following arguments are required: CONFIG.yaml"),
        (["nope"], "invalid choice: 'nope'"),
    ],
)
def test_bad_arguments_exit_2_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_train_without_a_file_names_only_the_file(capsys):
    """The overrides after CONFIG.yaml are optional: only the missing file is named."""
    with pytest.raises(SystemExit):
        main(["train"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "trl-ext train: error: the following arguments are required: CONFIG.yaml"
    assert build_parser().parse_args(["train", "r.yaml"]).overrides == []


def test_tiny_model_writes_folders_transformers_loads(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    folder = tmp_path / "tiny"
    assert main(["tiny-model", str(folder)]) == 0
    assert f"--model_name_or_path {folder}" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == "Qwen2ForCausalLM" and AutoTokenizer.from_pretrained(folder).chat_template
    assert main(["tiny-model", str(folder)]) == 0  # again: the tiny model there is replaced
    assert main(["tiny-model", str(tmp_path / "rm"), "--reward-model"]) == 0
    assert "--reward_model_name_or_path" in capsys.readouterr().out
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").config.num_labels == 1
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    assert main(["tiny-model", str(tmp_path / "notes")]) == 2
    assert "notes is not empty and holds no model (no config.json)" in capsys.readouterr().err
    assert main(["tiny-model", str(tmp_path / "notes" / "todo.txt")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


def test_quickstart_refuses_an_unwritable_output_dir_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["quickstart", "--output-dir", str(blocker / "out")]) == 2
    err = capsys.readouterr().err
    assert "trl-ext quickstart: error: --output-dir" in err and "not writable" in err
    assert main(["quickstart", "--output-dir", str(blocker)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


def test_train_errors_are_one_clear_line(tmp_path, capsys):
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "no such recipe file" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: stepwise_rlm\nmax_turn: 3\n")
    assert main(["train", str(bad)]) == 2
    assert "'max_turn' (did you mean 'max_turns'?)" in capsys.readouterr().err


def test_push_errors(tmp_path, capsys):
    assert main(["push", str(tmp_path), "user/repo"]) == 2
    assert "No LoRA adapter" in capsys.readouterr().err
    assert main(["push", str(tmp_path / "missing"), "user/repo"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_push_dry_run_prints_files_and_card(tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    from trl_ext.testing import build_tiny_model_and_tokenizer

    model, _ = build_tiny_model_and_tokenizer(0)
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
    assert main(["push", str(tmp_path), "user/repo", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "files: README.md, adapter_config.json, adapter_model.safetensors" in printed
    assert "library_name: peft" in printed


def test_plot_error_is_reported(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "missing")]) == 1
    assert "trl-ext plot: error:" in capsys.readouterr().err


def test_parser_defaults():
    args = build_parser().parse_args(["quickstart"])
    assert (args.output_dir, args.method, args.fast, args.steps, args.seed) == (
        "trl-ext-quickstart",
        "stepwise-rlm",
        False,
        None,
        0,
    )
    args = build_parser().parse_args(["train", "r.yaml", "--learning_rate", "1e-5", "--max_steps", "3"])
    assert args.config == "r.yaml" and args.overrides == ["--learning_rate", "1e-5", "--max_steps", "3"]


def _report(tmp_path, before=None, after=None, extra=None):
    from trl_ext.quickstart import QuickstartResult

    return QuickstartResult(
        method="stepwise-rlm" if before is not None else "judge-credit",
        output_dir=tmp_path,
        seed=0,
        fast=False,
        wall_time_s=1.0,
        train_steps=24,
        adapter_dir=tmp_path / "adapter",
        plot_file=tmp_path / "monitors.png",
        reward_first=0.2,
        reward_last=0.7,
        train_rewards=[0.2, 0.45, 0.7],
        trust_region_metric="ipo/masked_ratio",
        trust_region_mean=0.002,
        trust_region_max=0.006,
        alerts={"clip_rate_low": 1, "kl_spike": 0},
        alert_log=[],
        before=before,
        after=after,
        extra=extra or {},
    )


def test_report_table(tmp_path):
    from trl_ext.quickstart import EvalResult

    before = EvalResult(
        0.1725, 96, 0.94, 2.0, 1.58, {"delegate": 0.6, "read": 0.34, "no_answer": 0.06},
        child_answer_rate=0.917, child_correct_rate=0.277, child_strategies={"copy": 0.58, "lookup": 0.234},
    )  # fmt: skip
    after = EvalResult(
        0.653, 96, 0.84, 2.0, 2.15, {"delegate": 0.83, "no_answer": 0.17},
        child_answer_rate=0.847, child_correct_rate=0.777, child_strategies={"copy": 0.012, "lookup": 0.76},
    )  # fmt: skip
    (tmp_path / "rlm_trees").mkdir()
    table = format_quickstart_report(_report(tmp_path, before, after, {"eval_samples": 2}), 250.0)
    assert "held-out reward (share of parts right)" in table and "0.172 →     0.653" in table
    assert "root delegates to children" in table and "60.0% →     83.0%" in table
    assert "root reads the values itself" in table and "34.0% →      0.0%" in table  # absent strategy: 0
    assert "children per root" in table and "1.58 →      2.15" in table
    assert "children that answer right" in table and "27.7% →     77.7%" in table
    assert "children using the lookup program" in table and "23.4% →     76.0%" in table
    assert "48 held-out tasks x 2 samples" in table
    no_children = EvalResult(0.0, 96, 1.0, 2.0, 0.0, {"read": 1.0})
    table_without = format_quickstart_report(_report(tmp_path, no_children, no_children, {"eval_samples": 2}), 9.0)
    assert "n/a →       n/a" in table_without  # no child was started: no child figures, not 0 %
    assert "training reward per generation batch: 0.20 0.45 0.70" in table
    assert "IPO masked ratio: mean 0.2%, max 0.6%" in table
    assert "monitor alerts: clip_rate_low ×1" in table and "kl_spike" not in table
    assert f"LoRA adapter      {tmp_path / 'adapter'}/" in table
    assert f"trl-ext push {tmp_path} <user>/<repo>" in table


def test_report_table_of_the_judge_credit_miniature(tmp_path):
    heldout = {
        "exact_match_before": 0.219,
        "exact_match_after": 0.395,
        "digit_acc_before": 0.712,
        "digit_acc_after": 0.805,
    }
    outcome = {
        "exact_match_before": 0.219,
        "exact_match_after": 0.344,
        "digit_acc_before": 0.712,
        "digit_acc_after": 0.703,
    }
    table = format_quickstart_report(
        _report(tmp_path, extra={"heldout": heldout, "heldout_outcome_only": outcome}), 60.0
    )
    assert "with judge credit" in table and "0.219 → 0.395" in table and "0.712 → 0.805" in table
    assert "outcome-only (λ = 0)" in table and "0.219 → 0.344" in table and "0.712 → 0.703" in table


@pytest.mark.slow
def test_quickstart_fast_end_to_end(tmp_path, capsys):
    """The CI run of the whole pipeline: teacher traces, SFT, evaluation, stepwise RL, evaluation, outputs."""
    import json

    from trl_ext.quickstart import QuickstartSettings

    # --verbose: leave the libraries' log levels alone in the test process
    assert main(["quickstart", "--fast", "--no-progress", "--verbose", "--output-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for line in (
        "[1/6] toy task",
        "[2/6] scripted teacher",
        "[3/6] cold-start SFT",
        "[4/6] held-out reward",
        "[5/6] StepwiseRLMTrainer",
        "[6/6] held-out reward after RL",
        "held-out reward (share of parts right)",
        "root delegates to children",
        "children per root",
        "children that answer right",
        "IPO masked ratio",
        "monitor alerts:",
        "LoRA adapter",
    ):
        assert line in printed, line
    assert "{'loss'" not in printed  # the trainers' per-step log dicts go to the state and the plot, not the screen
    for path in (
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
        "sft_model/config.json",
        "trainer_state.json",
        "monitors.png",
        "teacher_traces.jsonl",
        "eval/sft_only.jsonl",
        "eval/after_rl.jsonl",
        "trl_ext_run.json",
    ):
        assert (tmp_path / path).is_file(), path
    assert list((tmp_path / "rlm_trees").glob("train-v*.jsonl"))
    info = json.loads((tmp_path / "trl_ext_run.json").read_text())
    fast = QuickstartSettings.fast()
    assert info["trainer"] == "StepwiseRLMTrainer" and info["config"]["loss_type"] == "ipo"
    assert info["base_model"] == str(tmp_path / "sft_model")
    assert info["extra"]["result"]["train_steps"] == info["steps"] == fast.rl_steps
    rollouts = fast.num_eval_examples * fast.eval_samples
    assert info["extra"]["result"]["before"]["rollouts"] == info["extra"]["result"]["after"]["rollouts"] == rollouts
    for key in ("eval/reward_sft_only", "eval/reward_after_rl"):
        assert 0.0 <= info["metrics"][key] <= 1.0
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and adapter["peft_type"] == "LORA"
    history = json.loads((tmp_path / "trainer_state.json").read_text())["log_history"]
    assert any("rlm/children_mean" in h for h in history)  # the stepwise trainer logged its tree statistics


def test_readme_set_up_commands_are_what_ci_runs():
    """The README's two set-up commands come first; `.ci/run` runs the test command exactly; the quickstart command
    installs the plot extra (the learning curve)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = root / "README.md"
    block = readme.read_text(encoding="utf-8").split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2
    quickstart, tests = commands
    assert quickstart.endswith("trl-ext quickstart") and '".[plot]"' in quickstart
    assert "python -m pytest -q &&" in tests  # the main suite, then the vLLM group in its own environment
    assert tests.endswith("bash scripts/setup_vllm_cpu.sh && .venv-vllm/bin/python -m pytest -q -m vllm")
    ci = (root / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert tests in ci
