"""`trl-ext push`: the real `huggingface_hub` upload path against a local Hub endpoint on 127.0.0.1.

`FakeHub` (tests/fake_hub.py) answers the four Hub API calls one ``create_repo`` + ``create_commit`` makes (repo creation, README YAML
validation, pre-upload, the NDJSON commit) and keeps every committed file, so the tests check exactly which bytes
reached the "Hub" and what the generated model card says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trl_ext.hub import PushError, build_model_card, collect_adapter_files, find_adapter_dir, push_adapter

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
    assert files.run_info["method"] == "stepwise-rlm"


def test_model_card_content(run_dir):
    card = build_model_card(run_dir, "someone/tiny-rlm")
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["base_model"] == "Qwen/Qwen3-4B"
    assert meta["library_name"] == "peft"
    assert {"trl-ext", "stepwise-rlm", "ipo-loss", "lora"} <= set(meta["tags"])
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
    assert "a local model, not on the Hub" in card
    assert "Dear diary" in card and "None: no monitor rule fired" in card


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
