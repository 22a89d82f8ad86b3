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
    PushError,
    build_model_card,
    collect_adapter_files,
    find_adapter_dir,
    push_adapter,
)
from trl_ext.methods import METHODS
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
    assert meta["model_name"] == "tiny-rlm"
    assert "licence" not in meta and "license" not in meta  # no placeholder: the run does not know the license
    assert {"generated_from_trainer", "trl", "grpo", "trl-ext", "stepwise-rlm", "ipo-loss", "lora"} <= set(
        meta["tags"]
    )
    # TRL's card (training procedure, framework versions, the trainer's and TRL's citations) with a quick start that
    # loads the adapter: TRL's pipeline(model=<repo>) cannot (the adapter config names no Hub base here)
    assert "pipeline(" not in card and "## Quick start" in card and "## Loading the adapter" not in card
    quick_start = card.split("## Quick start", 1)[1].split("## Training procedure", 1)[0]
    assert 'AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-4B", device_map="auto")' in quick_start
    assert 'PeftModel.from_pretrained(base, "someone/tiny-rlm")' in quick_start
    assert 'AutoTokenizer.from_pretrained("someone/tiny-rlm")' in quick_start  # the tokenizer was uploaded
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
    assert "license: apache-2.0" in build_model_card(run_dir, "someone/tiny-rlm", license="apache-2.0").split("---")[1]


def test_card_for_a_local_base_model_has_no_hub_metadata(run_dir, tmp_path):
    import shutil

    local = tmp_path / "run"
    shutil.copytree(run_dir, local)
    info = dict(RUN_INFO, base_model=str(local / "sft_model"), alerts={}, alert_log=[], method="judge-credit")
    (local / "trl_ext_run.json").write_text(json.dumps(info), encoding="utf-8")
    card = build_model_card(local, "someone/x")
    assert "base_model:" not in card.split("---")[1]
    assert "a local base model (the folder `sft_model`, not on the Hub)" in card and "[None]" not in card
    assert str(tmp_path) not in card  # the local path stays local
    assert 'from_pretrained("path/to/the/base/model", device_map="auto")' in card
    assert "Dear diary" in card and "None: no monitor rule fired" in card
    assert "This model was trained with Judge Credit." in card and "@misc{dear_diary_judge2026," in card
    assert "judge-credit" in yaml.safe_load(card.split("---")[1])["tags"]


def test_card_reports_the_sandbox_and_a_legacy_recipe_run_file(run_dir, tmp_path):
    """A run file with a key the schema does not have (``recipe`` at the top level) still gives a full card; the
    sandbox section lists what the REPLs were isolated from and what not."""
    import shutil

    local = tmp_path / "run"
    shutil.copytree(run_dir, local)
    sandbox = {"repl/isolation": "process", "isolated": ["environment (allow-list)"], "open": ["the network"]}
    legacy = dict(RUN_INFO, method="judge-credit", recipe="recipes/judge.yaml", sandbox=sandbox, dataset="org/data")
    (local / "trl_ext_run.json").write_text(json.dumps(legacy), encoding="utf-8")
    card = build_model_card(local, "someone/x")
    meta = yaml.safe_load(card.split("---")[1])
    assert "judge-credit" in meta["tags"] and meta["datasets"] == "org/data"
    assert "- recipe: `judge.yaml`" in card  # the file name only
    section = card.split("## Sandbox isolation", 1)[1].split("##", 1)[0]
    assert "`process` backend" in section and "- environment (allow-list)" in section
    assert "Left open:" in section and "- the network" in section


def _adapter_run(root: Path, *, base: str | None, run_info: dict) -> Path:
    """An output directory with a tiny LoRA adapter whose adapter_config.json names ``base``, and a run file."""
    from peft import LoraConfig, get_peft_model

    from trl_ext.testing import build_tiny_model_and_tokenizer

    model, tokenizer = build_tiny_model_and_tokenizer(0)
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(root)
    tokenizer.save_pretrained(root)
    config = json.loads((root / "adapter_config.json").read_text())
    (root / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base}))
    (root / "trl_ext_run.json").write_text(json.dumps(run_info), encoding="utf-8")
    return root


def _run_quick_start(card: str, replacements: dict[str, str]) -> str:
    """Run the card's quick start with Hub ids and placeholders replaced by local folders; returns what it printed."""
    import contextlib
    import io

    code = card.split("## Quick start", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    for old, new in replacements.items():
        code = code.replace(f'"{old}"', repr(new))
    code = code.replace("max_new_tokens=128", "max_new_tokens=4").replace(', device_map="auto"', "")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "<quick start>", "exec"), {})
    return printed.getvalue()


def test_card_quick_start_loads_the_adapter(tmp_path):
    """The quick start runs: with a Hub base named in adapter_config.json, AutoPeftModelForCausalLM (one line); with a
    local base, the base from a placeholder path then PeftModel. Run offline with the ids swapped for local folders."""
    from trl_ext.testing import build_tiny_model_and_tokenizer, save_tiny_model

    base_dir = save_tiny_model(*build_tiny_model_and_tokenizer(0), tmp_path / "base")
    info = dict(RUN_INFO, base_model="org/tiny-base")
    hub = _adapter_run(tmp_path / "hub", base="org/tiny-base", run_info=info)
    card = build_model_card(hub, "someone/adapter")
    assert 'AutoPeftModelForCausalLM.from_pretrained("someone/adapter", device_map="auto")' in card
    assert yaml.safe_load(card.split("---")[1])["base_model"] == "org/tiny-base"
    # AutoPeftModel reads the base from adapter_config.json: point a copy of it at the local base
    runnable = _adapter_run(tmp_path / "runnable", base=str(base_dir), run_info=info)
    assert _run_quick_start(card, {"someone/adapter": str(runnable)}) is not None

    local = _adapter_run(tmp_path / "local", base=str(base_dir), run_info=dict(RUN_INFO, base_model=str(base_dir)))
    card = build_model_card(local, "someone/adapter")
    assert "AutoPeftModel" not in card and str(tmp_path) not in card
    _run_quick_start(card, {"someone/adapter": str(local), "path/to/the/base/model": str(base_dir)})


def test_card_and_uploaded_run_file_hold_no_local_path_and_only_choices(tmp_path, monkeypatch):
    """A recipe run from local folders: the card and the uploaded trl_ext_run.json name the base model, the recipe and
    the data by their last component; the settings table lists choices, not bookkeeping."""
    import huggingface_hub.constants

    config = {
        "loss_type": "ipo",
        "learning_rate": 1e-5,
        "seed": 7,
        "output_dir": str(tmp_path / "out"),
        "logging_dir": str(tmp_path / "out" / "runs"),
        "run_name": str(tmp_path / "out"),
        "report_to": [],
        "model_init_kwargs": {"dtype": "bfloat16"},
        "hub_model_id": "someone/x",
        "save_steps": 10,
        "reward_model_name_or_path": str(tmp_path / "rm"),
    }
    info = dict(
        RUN_INFO,
        base_model=str(tmp_path / "models" / "policy"),
        dataset=[str(tmp_path / "data" / "train.jsonl")],
        config=config,
        extra={"recipe": str(tmp_path / "recipes" / "mine.yaml")},
    )
    root = _adapter_run(tmp_path / "run", base=str(tmp_path / "models" / "policy"), run_info=info)
    card = build_model_card(root, "someone/x")
    assert str(tmp_path) not in card
    assert "the folder `policy`" in card and "- recipe: `mine.yaml`" in card and '`["train.jsonl"]`' in card
    table = card.split("Settings chosen for this run", 1)[1].split("##", 1)[0]
    for chosen in ("| `loss_type` | `ipo` |", "| `learning_rate` | `1e-05` |", "| `seed` | `7` |"):
        assert chosen in table
    assert "| `reward_model_name_or_path` | `rm` |" in table
    for bookkeeping in ("output_dir", "logging_dir", "run_name", "report_to", "model_init_kwargs", "hub_", "save_"):
        assert bookkeeping not in table, bookkeeping

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with FakeHub() as hub:
        push_adapter(root, "someone/x", token=TOKEN, endpoint=hub.url)
    [commit] = hub.commits
    uploaded = commit["files"]["trl_ext_run.json"].decode()
    assert str(tmp_path) not in uploaded and str(tmp_path) in (root / "trl_ext_run.json").read_text()
    assert json.loads(uploaded)["base_model"] == "policy" and json.loads(uploaded)["extra"]["recipe"] == "mine.yaml"
    assert str(tmp_path) not in commit["files"]["README.md"].decode()
    adapter = json.loads(commit["files"]["adapter_config.json"].decode())  # PEFT wrote the local base's path
    assert (
        adapter["base_model_name_or_path"] == "policy" and str(tmp_path) in (root / "adapter_config.json").read_text()
    )
    for name, content in commit["files"].items():
        assert str(tmp_path).encode() not in (content if isinstance(content, bytes) else content.encode()), name


def test_push_failures_say_offline_unreachable_or_refused_token(run_dir, monkeypatch, capsys):
    """`trl-ext push` tells offline mode, an unreachable Hub and a refused token apart (exit 1), instead of blaming
    HF_TOKEN for all three."""
    import socket

    import huggingface_hub.constants

    from trl_ext.cli import main
    from trl_ext.hub import HubUploadError

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main(["push", str(run_dir), "someone/x"]) == 1
    err = capsys.readouterr().err
    assert "the Hub is offline for this process: HF_HUB_OFFLINE is set" in err and "HF_TOKEN" not in err

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(HubUploadError, match=f"could not reach the Hub at {closed}") as caught:
        push_adapter(run_dir, "someone/x", token=TOKEN, endpoint=closed)
    assert "HF_TOKEN" not in str(caught.value)

    with FakeHub() as hub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
        assert main(["push", str(run_dir), "someone/x"]) == 1
    err = capsys.readouterr().err
    assert f"{hub.url} refused the token (HTTP 401" in err and "HF_TOKEN" in err
    assert not hub.commits


def test_run_info_round_trip_and_method_check(tmp_path):
    info = RunInfo(
        source="trl-ext train",
        method="stepwise-rlm",
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
    with pytest.raises(ValueError, match="'stepwise_rlm' is not a trl-ext method; use one of stepwise-rlm, "):
        RunInfo(source="x", method="stepwise_rlm")  # one spelling: the method's name
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
    from trl_ext.quickstart import QuickstartResult, QuickstartSettings, quickstart_run_info

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
        trust_region_metric="ipo/masked_ratio",
        trust_region_mean=0.01,
        trust_region_max=0.02,
        alerts={"kl_spike": 1, "clip_rate_low": 0},
        alert_log=[{"monitor": "EntropyMonitor", "rule": "kl_spike", "step": 2, "value": 1.0, "action": "warn"}],
        extra={"base_model": "tiny (in memory)", "config": {"loss_type": "ipo"}, "task": "toy"},
    )
    info = read_run_info(write_run_info(tmp_path, quickstart_run_info(result, settings)))
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
