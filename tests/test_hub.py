"""`trl-ext push`, the model card and ``trl_ext_run.json``.

The push goes through the real `huggingface_hub` upload path against a local Hub endpoint on 127.0.0.1: `FakeHub`
(tests/fake_hub.py) answers the four Hub API calls one ``create_repo`` + ``create_commit`` makes (repo creation, README
YAML validation, pre-upload, the NDJSON commit) and keeps every committed file, so the tests check exactly which bytes
reached the "Hub" and what the generated model card says. The card is TRL's (`generate_model_card`, fed by the
trainers' `_tag_names`/`_name`/`_paper`) with trl-ext's sections; the run file is `trl_ext.run_info.RunInfo`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trl_ext.hub import (
    METHODS,
    PushError,
    build_model_card,
    collect_adapter_files,
    find_adapter_dir,
    push_adapter,
)
from trl_ext.run_info import (
    RUN_INFO_FILE,
    RunInfo,
    collect_monitor_alerts,
    last_logged_metrics,
    read_run_info,
    write_run_info,
)

from .fake_hub import TOKEN, FakeHub

RUN_INFO = {
    "source": "trl-ext quickstart",
    "method": "stepwise-rlm",
    "trainer": "StepwiseRLMTrainer",
    "base_model": "Qwen/Qwen3-4B",
    "config": {"loss_type": "ipo", "learning_rate": 0.002, "num_generations": 8, "max_turns": 3},
    "metrics": {"eval/reward_sft_only": 0.3125, "eval/reward_after_rl": 0.6510, "train/steps": 24, "not_shown": 1},
    "alerts": {"clip_rate_low": 1, "kl_spike": 0},
    "alert_log": [
        {"monitor": "ClipRateMonitor", "rule": "clip_rate_low", "step": 6, "value": 0.004, "action": "warn"}
    ],
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """An output directory as `trl-ext quickstart` leaves it: adapter/ (+ tokenizer), run file, plot, and full
    weights of the SFT base model that must never be uploaded."""
    from peft import LoraConfig, get_peft_model

    from trl_ext.testing import build_tiny_model_and_tokenizer

    root = tmp_path_factory.mktemp("run")
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    model.save_pretrained(root / "sft_model")  # full weights: must not be pushed
    (root / "model.safetensors").write_bytes(b"full weights that must stay local")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    peft_model.save_pretrained(root / "adapter")
    tokenizer.save_pretrained(root / "adapter")
    (root / "trl_ext_run.json").write_text(json.dumps(RUN_INFO), encoding="utf-8")
    (root / "monitors.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    return root


def expected_files(run_dir: Path) -> set[str]:
    adapter = run_dir / "adapter"
    tokenizer = {
        p.name for p in adapter.iterdir() if p.name.startswith(("tokenizer", "special_tokens", "chat_template"))
    }
    return {
        "adapter_config.json",
        "adapter_model.safetensors",
        "trl_ext_run.json",
        "monitors.png",
        "README.md",
        *tokenizer,
    }


def test_collects_adapter_files_only(run_dir):
    files = collect_adapter_files(run_dir)
    assert files.adapter_dir == run_dir / "adapter"
    assert set(files.files) | {"README.md"} == expected_files(run_dir)
    assert not any(name.startswith("model") for name in files.files)
    assert files.run_info.method == "stepwise-rlm" and files.run_info.source == "trl-ext quickstart"


def test_model_card_content(run_dir):
    import trl

    card = build_model_card(run_dir, "someone/tiny-rlm")
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["base_model"] == "Qwen/Qwen3-4B"
    assert meta["library_name"] == "peft"
    assert meta["model_name"] == "tiny-rlm" and "licence" in meta
    assert {"generated_from_trainer", "trl", "grpo", "trl-ext", "stepwise-rlm", "ipo-loss", "lora"} <= set(
        meta["tags"]
    )
    # TRL's card: quick start, training procedure, framework versions, the trainer's and TRL's citations
    assert '"text-generation", model="someone/tiny-rlm"' in card
    assert "This model was trained with Stepwise RLM." in card and f"- TRL: {trl.__version__}" in card
    assert "Cite Stepwise RLM as:" in card and "@misc{kim2026reinforcing," in card and "Cite TRL as:" in card
    # trl-ext's sections come before the citations
    assert card.index("### Framework versions") < card.index("## Method:") < card.index("## Citations")
    assert "## Sandbox isolation" not in card  # the run file has no sandbox
    assert "Reinforcing Recursive Language Models" in card and "arXiv:2512.24601" in card
    assert "prime-rl" in card  # the IPO loss's source, since loss_type is ipo
    assert "| `loss_type` | `ipo` |" in card and "| `max_turns` | `3` |" in card
    assert "| `eval/reward_sft_only` | 0.3125 |" in card and "| `eval/reward_after_rl` | 0.651 |" in card
    assert "not_shown" not in card
    assert "| `clip_rate_low` | 1 |" in card and "kl_spike" not in card  # rules that never fired are left out
    assert "step 6: `clip_rate_low`" in card
    assert "![" in card and "(monitors.png)" in card
    assert 'PeftModel.from_pretrained(base, "someone/tiny-rlm")' in card


def test_card_for_a_local_base_model_has_no_hub_metadata(run_dir, tmp_path):
    import shutil

    local = tmp_path / "run"
    shutil.copytree(run_dir, local)
    info = dict(RUN_INFO, base_model=str(local / "sft_model"), alerts={}, alert_log=[], method="judge-credit")
    (local / "trl_ext_run.json").write_text(json.dumps(info), encoding="utf-8")
    card = build_model_card(local, "someone/x")
    assert "base_model:" not in card.split("---")[1]
    assert "a local model, not on the Hub" in card and "[None]" not in card
    assert "Dear diary" in card and "None: no monitor rule fired" in card
    assert "This model was trained with Judge Credit." in card and "@misc{dear_diary_judge2026," in card
    assert "judge-credit" in yaml.safe_load(card.split("---")[1])["tags"]


def test_card_reports_the_sandbox_and_a_legacy_recipe_run_file(run_dir, tmp_path):
    """A run file as ``trl-ext train`` wrote it before the shared schema (method ``judge_credit``, ``recipe`` at
    the top level) still gives a full card; the sandbox section lists what the REPLs were isolated from and what not."""
    import shutil

    local = tmp_path / "run"
    shutil.copytree(run_dir, local)
    sandbox = {"repl/isolation": "process", "isolated": ["environment (allow-list)"], "open": ["the network"]}
    legacy = dict(RUN_INFO, method="judge_credit", recipe="recipes/judge.yaml", sandbox=sandbox, dataset="org/data")
    (local / "trl_ext_run.json").write_text(json.dumps(legacy), encoding="utf-8")
    card = build_model_card(local, "someone/x")
    meta = yaml.safe_load(card.split("---")[1])
    assert "judge-credit" in meta["tags"] and meta["datasets"] == "org/data"
    assert "- recipe: `recipes/judge.yaml`" in card
    section = card.split("## Sandbox isolation", 1)[1].split("##", 1)[0]
    assert "`process` backend" in section and "- environment (allow-list)" in section
    assert "Left open:" in section and "- the network" in section


def test_run_info_round_trip_and_normalisation(tmp_path):
    info = RunInfo(
        source="trl-ext train",
        method="Stepwise_RLM",
        alerts={"kl_spike": 0, "clip_rate_low": 2},
        alert_log=[{"rule": "b", "step": 9}, {"rule": "a", "step": 3}],
        extra={"recipe": "r.yaml"},
    )
    assert info.method == "stepwise-rlm" and info.alerts == {"clip_rate_low": 2}
    assert [record["step"] for record in info.alert_log] == [3, 9]
    path = write_run_info(tmp_path, info)
    assert path == tmp_path / RUN_INFO_FILE
    data = json.loads(path.read_text())
    assert data["schema_version"] == 1 and data["extra"] == {"recipe": "r.yaml"}
    assert read_run_info(tmp_path) == info == read_run_info(path)
    # Keys the schema does not have (older files) are kept in `extra`, never dropped.
    legacy = RunInfo.from_dict({"method": "rlmt", "settings": {"seed": 1}, "result": {"train_steps": 2}})
    assert legacy.source == "unknown" and legacy.extra == {"settings": {"seed": 1}, "result": {"train_steps": 2}}
    (tmp_path / RUN_INFO_FILE).write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        read_run_info(tmp_path)


def test_collect_monitor_alerts_and_last_metrics():
    from types import SimpleNamespace

    from trl_ext.callbacks import ClipRateMonitor, EntropyMonitor

    clip = ClipRateMonitor(expect_nonzero=True, aggregate_logs=1, patience=3)
    for step, value in enumerate([0.05, 0.06, 0.04, 0.05, 0.055, 0.045, 0.05, 0.06, 0.35, 0.4, 0.38], start=1):
        clip.observe({"clip_ratio/region_mean": value}, step)
    entropy = EntropyMonitor()
    for step, value in enumerate([0.5, 0.4, 0.02, 0.01, 0.01], start=1):
        entropy.observe({"entropy": value}, step)
    trainer = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[object(), entropy, clip]))
    alerts, log = collect_monitor_alerts(trainer)
    assert alerts == {"clip_rate_high": 1, "entropy_collapse": 1}  # rules that never fired are left out
    assert [(r["monitor"], r["rule"], r["step"]) for r in log] == [
        ("EntropyMonitor", "entropy_collapse", 4),
        ("ClipRateMonitor", "clip_rate_high", 11),
    ]
    assert collect_monitor_alerts([clip, entropy]) == (alerts, log)
    history = [{"loss": 1.0, "step": 1, "epoch": 0.5}, {"loss": 0.5, "reward": 0.2, "step": 2}, {"train_runtime": 3}]
    assert last_logged_metrics(history) == {"loss": 0.5, "reward": 0.2, "train_runtime": 3}


def test_quickstart_writes_the_shared_schema(tmp_path):
    from trl_ext.quickstart import QuickstartResult, QuickstartSettings
    from trl_ext.quickstart import write_run_info as quickstart_write

    settings = QuickstartSettings.fast()
    result = QuickstartResult(
        method="rlmt",
        output_dir=tmp_path,
        seed=0,
        fast=True,
        wall_time_s=1.0,
        train_steps=2,
        adapter_dir=tmp_path / "adapter",
        plot_file=None,
        reward_first=0.25,
        reward_last=0.5,
        train_rewards=[0.25, 0.5],
        masked_ratio_mean=0.01,
        masked_ratio_max=0.02,
        alerts={"kl_spike": 1, "clip_rate_low": 0},
        alert_log=[{"monitor": "EntropyMonitor", "rule": "kl_spike", "step": 2, "value": 1.0, "action": "warn"}],
        extra={"base_model": "tiny (in memory)", "config": {"loss_type": "ipo"}, "task": "toy"},
    )
    info = read_run_info(quickstart_write(tmp_path, result, settings))
    assert (info.source, info.method, info.trainer, info.steps) == ("trl-ext quickstart", "rlmt", "RLMTTrainer", 2)
    assert info.base_model == "tiny (in memory)" and info.dataset == "toy" and info.config == {"loss_type": "ipo"}
    assert info.metrics["train/reward_last"] == 0.5 and info.alerts == {"kl_spike": 1}
    assert info.extra["settings"]["seed"] == settings.seed and info.extra["result"]["train_rewards"] == [0.25, 0.5]


def test_trainer_card_attributes_come_from_the_method_table():
    """Each trainer's TRL card attributes are its `METHODS` entry, in the shape of `trl.GRPOTrainer`'s."""
    import trl

    import trl_ext

    for tag, method in METHODS.items():
        trainer_class = getattr(trl_ext, method.trainer)
        assert method.tag == tag and trainer_class._name == method.name
        assert trainer_class._tag_names == method.tag_names and {"trl-ext", tag} <= set(trainer_class._tag_names)
        assert trainer_class._paper is method.paper and set(method.paper) == set(trl.GRPOTrainer._paper)
        assert method.paper["citation"].startswith("@") and method.paper["title"]
    assert METHODS["grpo"].paper == trl.GRPOTrainer._paper  # ExtGRPOTrainer cites what GRPOTrainer cites


def test_trainer_create_model_card_uses_the_trl_ext_attributes(tmp_path):
    """`trainer.create_model_card()` (what `trainer.push_to_hub()` writes) on a real `StepwiseRLMTrainer`."""
    from datasets import Dataset

    from trl_ext.testing import build_tiny_model_and_tokenizer
    from trl_ext.trainers import StepwiseRLMConfig, StepwiseRLMTrainer

    from .utils import cpu_config_kwargs

    model, tokenizer = build_tiny_model_and_tokenizer(0)
    trainer = StepwiseRLMTrainer(
        model,
        lambda completions, **kwargs: [0.0] * len(completions),
        args=StepwiseRLMConfig(**cpu_config_kwargs(str(tmp_path))),
        train_dataset=Dataset.from_dict({"prompt": ["task"] * 4}),
        processing_class=tokenizer,
    )
    trainer.create_model_card(model_name="tiny-rlm")
    card = (tmp_path / "README.md").read_text(encoding="utf-8")
    meta = yaml.safe_load(card.split("---")[1])
    assert {"trl", "grpo", "trl-ext", "stepwise-rlm"} <= set(meta["tags"])
    assert "This model was trained with Stepwise RLM." in card and "@misc{kim2026reinforcing," in card


def test_push_uploads_exactly_the_adapter_and_card(run_dir, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the "Hub" is on 127.0.0.1
    with FakeHub() as hub:
        info = push_adapter(run_dir, "someone/tiny-rlm", token=TOKEN, endpoint=hub.url, private=True)
    assert info.oid == f"{1:040x}"
    [commit] = hub.commits
    assert commit["repo_id"] == "someone/tiny-rlm" and commit["revision"] == "main"
    assert commit["other_keys"] == []  # no LFS, no deletions
    assert set(commit["files"]) == expected_files(run_dir)
    adapter = run_dir / "adapter"
    assert commit["files"]["adapter_model.safetensors"] == (adapter / "adapter_model.safetensors").read_bytes()
    assert commit["files"]["adapter_config.json"] == (adapter / "adapter_config.json").read_bytes()
    assert commit["files"]["README.md"].decode() == build_model_card(run_dir, "someone/tiny-rlm")
    assert hub.repos["someone/tiny-rlm"]["private"] is True
    assert commit["header"]["summary"] == "Upload LoRA adapter trained with trl-ext"
    paths = [path for _, path, _ in hub.requests]
    assert paths[0] == "/api/repos/create" and "/api/validate-yaml" in paths


def test_push_cli_end_to_end_with_hf_endpoint(run_dir):
    """`trl-ext push OUTPUT_DIR REPO_ID` in a fresh process, configured only through HF_ENDPOINT and HF_TOKEN."""
    with FakeHub() as hub:
        env = {
            **os.environ,
            "HF_ENDPOINT": hub.url,
            "HF_TOKEN": TOKEN,
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1",
        }
        out = subprocess.run(
            [sys.executable, "-m", "trl_ext.cli", "push", str(run_dir), "org/adapter", "--commit-message", "v1"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    assert out.returncode == 0, out.stderr
    assert "org/adapter/commit/" in out.stdout
    [commit] = hub.commits
    assert set(commit["files"]) == expected_files(run_dir)
    assert commit["header"]["summary"] == "v1"


def test_push_refuses_full_weights_and_missing_adapter(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(PushError, match="full model weights"):
        find_adapter_dir(tmp_path)
    with pytest.raises(PushError, match="not a directory"):
        find_adapter_dir(tmp_path / "missing")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(PushError, match="no adapter weights"):
        collect_adapter_files(tmp_path)


def test_push_rejects_a_bad_repo_id(run_dir):
    with pytest.raises(ValueError, match="user/name"):
        push_adapter(run_dir, "no-namespace", token=TOKEN, endpoint="http://127.0.0.1:9")
