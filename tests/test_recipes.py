"""Recipes (`recipes/*.yaml`) and `trl-ext train`: every recipe parses into its config class with the published
settings, and a dry run builds its trainer on the tiny offline model with the recipe's algorithmic settings (model,
sizes, precision and vLLM swapped for CPU; loss, group size, λ, RLM limits, KL, temperature kept). Asynchronous
recipes (``asynchronous: true``) parse into the method's asynchronous classes here; their trainers need a running
``vllm serve``, so tests/test_vllm_async_recipe.py builds and trains one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from trl_ext.methods import METHODS, Method
from trl_ext.recipe_inputs import REWARD_REGISTRY, resolve_reward_funcs
from trl_ext.recipe_training import build_trainer, reward_names
from trl_ext.recipes import (
    RecipeError,
    TrainScriptArguments,
    config_class,
    parse_recipe,
    read_asynchronous,
    read_trainer_name,
    trainer_class,
)
from trl_ext.rlm import sandbox

from .fake_hub import TOKEN, FakeHub

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
ACCELERATE = RECIPES / "accelerate"

# recipe -> (config class, the settings its sources publish)
PUBLISHED = {
    "rlm_evidence_4b.yaml": (
        "StepwiseRLMConfig",
        {
            "num_generations": 8,
            "max_children": 4,
            "max_depth": 1,
            "use_vllm": True,
            "vllm_mode": "colocate",
            "rlm_loss_normalization": "subtree",
            "loss_type": "ipo",
        },
    ),
    "judge_credit_math_4b_lambda025.yaml": (
        "JudgeCreditConfig",
        {
            "judge_lambda": 0.25,
            "num_generations": 8,
            "per_device_train_batch_size": 8,
            "learning_rate": 1e-5,
            "loss_type": "ipo",
            "temperature": 1.0,
            "scale_rewards": "none",
            "max_steps": 40,
            "max_completion_length": 32768,
        },
    ),
    "judge_credit_math_4b_lambda1.yaml": (
        "JudgeCreditConfig",
        {"judge_lambda": 1.0, "num_generations": 8, "learning_rate": 1e-5, "loss_type": "ipo", "max_steps": 40},
    ),
    "async_rlm_evidence_4b.yaml": (
        "AsyncStepwiseRLMConfig",
        {
            "num_generations": 8,
            "max_children": 4,
            "max_depth": 1,
            "rlm_loss_normalization": "subtree",
            "loss_type": "ipo",
            "max_staleness": 2,
            "vllm_server_base_url": "http://127.0.0.1:8000",
        },
    ),
    "rlmt_llama31_8b_instruct.yaml": (
        "RLMTConfig",
        {
            "num_generations": 8,
            "learning_rate": 1e-6,
            "beta": 0.001,
            "temperature": 0.7,
            "rlmt_format": "instruct",
            "max_completion_length": 4096,
            "reward_model_name_or_path": "Skywork/Skywork-Reward-Llama-3.1-8B-v0.2",
        },
    ),
}
LORA_R16 = {
    "judge_credit_math_4b_lambda025.yaml",
    "judge_credit_math_4b_lambda1.yaml",
    "rlm_evidence_4b.yaml",
    "async_rlm_evidence_4b.yaml",
}
ASYNC_RECIPES = {"async_rlm_evidence_4b.yaml"}  # their trainers need a vllm serve: the vllm group builds one
SYNC_RECIPES = sorted(set(PUBLISHED) - ASYNC_RECIPES)


def test_every_recipe_is_covered():
    assert {p.name for p in RECIPES.glob("*.yaml")} == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_recipe_parses_into_its_config_class(name):
    import torch

    config_name, published = PUBLISHED[name]
    # bf16 needs a GPU (TrainingArguments checks it at parse time); everything else is parsed as written
    overrides = [] if torch.cuda.is_available() else ["--bf16", "false", "--use_cpu", "true"]
    recipe = parse_recipe(RECIPES / name, overrides)
    assert type(recipe.training_args).__name__ == config_name
    for key, value in published.items():
        assert getattr(recipe.training_args, key) == value, key
    if name in LORA_R16:
        assert (recipe.model_args.use_peft, recipe.model_args.lora_r, recipe.model_args.lora_alpha) == (True, 16, 32)
    assert recipe.script_args.monitors is True
    assert recipe.asynchronous is (name in ASYNC_RECIPES)


def test_judge_credit_recipes_differ_only_in_lambda_and_output():
    low = yaml.safe_load((RECIPES / "judge_credit_math_4b_lambda025.yaml").read_text())
    high = yaml.safe_load((RECIPES / "judge_credit_math_4b_lambda1.yaml").read_text())
    assert {k for k in low if low[k] != high[k]} == {"judge_lambda", "output_dir"}


# ----------------------------------------------------------------------------------------------------------------
# Dry runs on the tiny model
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny policy and reward model saved as local "checkpoints", and a small local dataset."""
    from trl_ext.testing import build_tiny_model_and_tokenizer, build_tiny_reward_model

    root = tmp_path_factory.mktemp("tiny")
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    model.save_pretrained(root / "policy")
    tokenizer.save_pretrained(root / "policy")
    reward_model, rm_tokenizer = build_tiny_reward_model(1)
    reward_model.save_pretrained(root / "rm")
    rm_tokenizer.save_pretrained(root / "rm")
    rows = [
        {"prompt": f"What is {i} + 1?", "context": f"n={i}", "answer": str(i + 1), "solution": str(i + 1)}
        for i in range(16)
    ]
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return root


def cpu_overrides(tiny: Path, output_dir: Path) -> list[str]:
    """Swap model, sizes, precision and generation backend; keep every algorithmic setting."""
    return [
        "--model_name_or_path",
        str(tiny / "policy"),
        "--dtype",
        "float32",
        "--output_dir",
        str(output_dir),
        "--use_vllm",
        "false",
        "--bf16",
        "false",
        "--use_cpu",
        "true",
        "--gradient_checkpointing",
        "false",
        "--max_completion_length",
        "8",
        "--report_to",
        "none",
    ]


@pytest.mark.parametrize("name", SYNC_RECIPES)
def test_recipe_dry_run_builds_the_trainer_on_the_tiny_model(name, tiny, tmp_path):
    from datasets import load_dataset
    from peft import PeftModel

    from trl_ext.callbacks import MonitorCallback

    config_name, published = PUBLISHED[name]
    overrides = cpu_overrides(tiny, tmp_path)
    if name.startswith("rlmt"):
        overrides += ["--reward_model_name_or_path", str(tiny / "rm"), "--reward_model_dtype", "float32"]
    recipe = parse_recipe(RECIPES / name, overrides)
    dataset = load_dataset("json", data_files=str(tiny / "train.jsonl"), split="train")
    if name.startswith("judge_credit"):  # the recipe's data is conversational, as TRL's accuracy_reward needs
        dataset = dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})
    trainer = build_trainer(recipe, train_dataset=dataset)

    assert type(trainer).__name__ == config_name.replace("Config", "Trainer")
    kept = {
        k: v
        for k, v in published.items()
        if k not in ("use_vllm", "max_completion_length", "reward_model_name_or_path")
    }
    for key, value in kept.items():
        assert getattr(trainer.args, key) == value, key
    assert trainer.args.use_vllm is False and trainer.args.max_completion_length == 8
    assert any(isinstance(cb, MonitorCallback) for cb in trainer.callback_handler.callbacks)
    if name in LORA_R16:
        assert isinstance(trainer.model, PeftModel)
        assert trainer.model.peft_config["default"].r == 16
    if name.startswith("rlm_"):
        assert type(trainer.reward_funcs[0]).__name__ == "RubricJudgeReward"
        assert trainer.method.scaffold.max_children == 4
    if name.startswith("judge_credit"):
        assert trainer.reward_funcs[0].__name__ == "accuracy_reward"
    if name.startswith("rlmt"):
        assert type(trainer.reward_funcs[0]).__name__ == "RewardModelScorer"


# ----------------------------------------------------------------------------------------------------------------
# trl-ext train, end to end
# ----------------------------------------------------------------------------------------------------------------
def write_recipe(path: Path, **fields) -> Path:
    path.write_text(yaml.safe_dump(fields, sort_keys=False), encoding="utf-8")
    return path


def toy_stepwise_recipe(tiny: Path, output: Path, **fields) -> dict:
    """A `stepwise_rlm` recipe for the tiny model on CPU (2 steps, IPO, LoRA), pushing to the Hub; ``fields``
    override."""
    return {
        "trainer": "stepwise_rlm",
        "model_name_or_path": str(tiny / "policy"),
        "dtype": "float32",
        "use_peft": True,
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_target_modules": ["q_proj", "v_proj"],
        "datasets": [{"path": "json", "data_files": str(tiny / "train.jsonl"), "split": "train"}],
        "reward_funcs": ["trl_ext.quickstart.toy_task:exact_match_reward"],
        "max_turns": 2,
        "max_depth": 0,
        "loss_type": "ipo",
        "num_generations": 4,
        "per_device_train_batch_size": 8,
        "max_completion_length": 8,
        "max_steps": 2,
        "learning_rate": 1.0e-3,
        "use_cpu": True,
        "bf16": False,
        "gradient_checkpointing": False,
        "report_to": "none",
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_tqdm": True,
        "output_dir": str(output),
        "push_to_hub": True,
        **fields,
    }


@pytest.mark.slow
def test_train_command_runs_a_stepwise_recipe_end_to_end(tiny, tmp_path, monkeypatch):
    """`trl-ext train` on the tiny model: trains, saves the adapter, the run file and the plot, then pushes the adapter
    once, to a local Hub endpoint (`FakeHub`), under the token owner's namespace when ``hub_model_id`` has none."""
    import huggingface_hub.constants

    from trl_ext.cli import main

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the "Hub" is on 127.0.0.1

    output = tmp_path / "run"
    recipe = write_recipe(
        tmp_path / "toy.yaml", **toy_stepwise_recipe(tiny, output, hub_model_id="toy-rlm", hub_token=TOKEN)
    )
    with FakeHub(user="someone") as hub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        assert main(["train", str(recipe), "--max_steps", "1"]) == 0  # a command-line override wins over the file
    [commit] = hub.commits  # one commit at the end, not one per checkpoint
    assert commit["repo_id"] == "someone/toy-rlm"
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "trl_ext_run.json"} <= set(
        commit["files"]
    )
    assert not any(name.startswith("model") for name in commit["files"])
    assert "StepwiseRLMTrainer" in commit["files"]["README.md"].decode()
    assert (output / "adapter_config.json").is_file() and (output / "adapter_model.safetensors").is_file()
    assert not (output / "model.safetensors").exists()
    info = json.loads((output / "trl_ext_run.json").read_text())
    assert info["method"] == "stepwise-rlm" and info["trainer"] == "StepwiseRLMTrainer"
    assert info["steps"] == 1 and info["config"]["loss_type"] == "ipo"
    assert info["reward_funcs"] == ["exact_match_reward"]
    assert "reward" in info["metrics"] and "rlm/turns_mean" in info["metrics"]
    assert (output / "trainer_state.json").is_file() and (output / "monitors.png").is_file()
    assert list((output / "rlm_trees").glob("*.jsonl"))


@pytest.mark.slow
def test_train_command_resumes_from_the_latest_complete_checkpoint(tiny, tmp_path, caplog):
    """`--resume_from_checkpoint true` takes the latest complete checkpoint (a half-written one after it is skipped)
    and redoes the steps after it without keeping their rollout trees twice."""
    from trl_ext.cli import main

    output = tmp_path / "run"
    fields = toy_stepwise_recipe(tiny, output, push_to_hub=False, save_strategy="steps", save_steps=1, max_steps=1)
    recipe = write_recipe(tmp_path / "toy.yaml", **fields)
    assert main(["train", str(recipe)]) == 0
    (output / "checkpoint-2").mkdir()  # what a kill while saving step 2 leaves: no trainer_state.json
    (output / "rlm_trees" / "train-v000001-rank0.jsonl").write_text('{"a stale": "tree"}\n')  # a killed step 2
    with caplog.at_level("WARNING", logger="trl_ext.checkpoints"):
        assert main(["train", str(recipe), "--max_steps", "2", "--resume_from_checkpoint", "true"]) == 0
    assert "Skipping the incomplete checkpoint" in caplog.text and "checkpoint-2" in caplog.text
    info = json.loads((output / "trl_ext_run.json").read_text())
    assert info["steps"] == 2
    trees = sorted((output / "rlm_trees").glob("*.jsonl"))
    assert [path.name for path in trees] == ["train-v000000-rank0.jsonl", "train-v000001-rank0.jsonl"]
    assert all(len(path.read_text().splitlines()) == 8 for path in trees)  # 8 roots a step, none twice


@pytest.mark.slow
def test_train_command_runs_in_two_processes(tiny, tmp_path):
    """`trl-ext train` as `accelerate launch -m trl_ext.cli train` runs it on GPUs: one process per device, started by
    torch's launcher (what `accelerate launch --multi_gpu` wraps; Accelerate reads the same environment). Here two
    CPU processes with gloo: both generate and train, rank 0 alone writes the outputs and pushes once."""
    import os
    import subprocess
    import sys

    output = tmp_path / "run"
    recipe = write_recipe(
        tmp_path / "toy.yaml",
        # 2 processes x 4 rows = 2 prompts x 4 rollouts per step
        **toy_stepwise_recipe(tiny, output, per_device_train_batch_size=4, hub_model_id="org/toy-rlm"),
    )
    with FakeHub() as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "0", "OMP_NUM_THREADS": "1"}
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
            + ["-m", "trl_ext.cli", "train", str(recipe)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("trl-ext train: done") == 1
    trees = sorted(path.name for path in (output / "rlm_trees").glob("*.jsonl"))
    assert trees == [f"train-v{step:06d}-rank{rank}.jsonl" for step in (0, 1) for rank in (0, 1)]
    info = json.loads((output / "trl_ext_run.json").read_text())
    assert info["steps"] == 2
    host = sandbox.isolation_report(sandbox.SandboxLimits())  # what the REPLs of the run were isolated from
    assert info["sandbox"]["repl/isolation"] == host["repl/isolation"] and info["sandbox"]["open"] == host["open"]
    assert (output / "adapter_model.safetensors").is_file()
    [commit] = hub.commits
    assert commit["repo_id"] == "org/toy-rlm" and "adapter_model.safetensors" in commit["files"]


# ----------------------------------------------------------------------------------------------------------------
# The offline commands of docs/recipes.md
# ----------------------------------------------------------------------------------------------------------------
DOCS = RECIPES.parent / "docs" / "recipes.md"
OFFLINE_SECTION = "## Try a recipe offline"


def documented_offline_commands() -> list[list[str]]:
    """The ``trl-ext ...`` commands of the bash blocks of docs/recipes.md's offline section, as argv lists."""
    import re
    import shlex

    section = DOCS.read_text(encoding="utf-8").split(OFFLINE_SECTION, 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv and argv[0] == "trl-ext":
                commands.append(argv[1:])
    return commands


def train_commands() -> list[list[str]]:
    return [argv for argv in documented_offline_commands() if argv[0] == "train"]


@pytest.fixture
def docs_cwd(tiny, tmp_path, monkeypatch):
    """An empty working directory as a reader's: recipes/ of the repository, and the folders `trl-ext tiny-model`
    writes (the fixture's tiny models, the same builders)."""
    import shutil

    (tmp_path / "recipes").symlink_to(RECIPES)
    makes = [argv for argv in documented_offline_commands() if argv[0] == "tiny-model"]
    assert [argv[1] for argv in makes] == ["tiny", "tiny-rm"] and makes[1][2:] == ["--reward-model"]
    shutil.copytree(tiny / "policy", tmp_path / "tiny")
    shutil.copytree(tiny / "rm", tmp_path / "tiny-rm")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_docs_offline_commands_cover_every_recipe():
    recipes = {Path(argv[1]).name for argv in train_commands()}
    assert recipes == set(SYNC_RECIPES)
    for argv in train_commands():
        assert argv[1].startswith("recipes/") and "--model_name_or_path" in argv and "--datasets" in argv
        assert argv[argv.index("--max_steps") + 1] == "1" and argv[argv.index("--use_vllm") + 1] == "false"


@pytest.mark.parametrize("argv", train_commands(), ids=lambda argv: Path(argv[1]).stem)
def test_docs_offline_command_builds_its_trainer(argv, docs_cwd):
    """Each documented offline command, offline (HF_HUB_OFFLINE), in a reader's working directory: the tiny model,
    the local data file instead of the recipe's, the stand-in reward; the recipe's algorithm kept."""
    config_name, published = PUBLISHED[Path(argv[1]).name]
    recipe = parse_recipe(argv[1], argv[2:])
    assert [(d.path, d.data_files) for d in recipe.dataset_args.datasets] == [
        ("json", "recipes/data/tiny_prompts.jsonl")
    ]
    trainer = build_trainer(recipe)
    assert type(trainer).__name__ == config_name.replace("Config", "Trainer")
    assert len(trainer.train_dataset) == 16 and {"prompt", "answer"} <= set(trainer.train_dataset.column_names)
    assert trainer.args.max_steps == 1 and trainer.args.use_vllm is False
    for key, value in published.items():
        if key not in ("use_vllm", "max_completion_length", "reward_model_name_or_path", "max_steps"):
            assert getattr(trainer.args, key) == value, key


@pytest.mark.slow
@pytest.mark.parametrize("argv", train_commands(), ids=lambda argv: Path(argv[1]).stem)
def test_docs_offline_command_trains_one_step(argv, docs_cwd):
    """The documented offline commands run as written (`trl-ext train ...`): one step on the CPU, outputs saved."""
    from trl_ext.cli import main

    assert main(argv) == 0
    output = docs_cwd / argv[argv.index("--output_dir") + 1]
    info = json.loads((output / "trl_ext_run.json").read_text())
    assert info["steps"] == 1 and info["dataset"] == ["recipes/data/tiny_prompts.jsonl"]
    assert info["base_model"] == str(docs_cwd / "tiny")
    assert (output / ("adapter_config.json" if "rlmt" not in argv[1] else "model.safetensors")).is_file()


# ----------------------------------------------------------------------------------------------------------------
# Data and model overrides
# ----------------------------------------------------------------------------------------------------------------
def test_command_line_datasets_replace_the_recipes(tiny, tmp_path, monkeypatch):
    """TRL's `--datasets` (local files or Hub ids) and `--dataset_name` both replace the file's `datasets:`; a local
    data file is read with its builder (load_dataset("x.jsonl") would look for it on the Hub)."""
    from trl_ext.recipe_inputs import load_recipe_datasets

    monkeypatch.chdir(tiny)
    recipe_path = write_recipe(tmp_path / "r.yaml", **toy_stepwise_recipe(tiny, tmp_path / "out", push_to_hub=False))
    recipe_path.write_text(
        recipe_path.read_text().replace(str(tiny / "train.jsonl"), "data/missing.jsonl"), encoding="utf-8"
    )
    with pytest.raises(RecipeError) as caught:  # the recipe's own data file is not there
        load_recipe_datasets(parse_recipe(recipe_path))
    assert "cannot load the dataset 'data/missing.jsonl'" in str(caught.value)
    assert "`--datasets train.jsonl`" in str(caught.value)

    for overrides in (["--datasets", "train.jsonl"], ["--dataset_name", "train.jsonl"], ["--datasets=train.jsonl"]):
        recipe = parse_recipe(recipe_path, overrides)
        train, _ = load_recipe_datasets(recipe)
        assert len(train) == 16 and train[0]["answer"] == "1", overrides
    assert parse_recipe(recipe_path, ["--dataset_name", "train.jsonl"]).dataset_args.datasets == []
    with pytest.raises(RecipeError, match="'nope.jsonl': no such data file"):
        parse_recipe(recipe_path, ["--datasets", "nope.jsonl"])
    with pytest.raises(RecipeError, match="'nope.jsonl': no such data file"):
        load_recipe_datasets(parse_recipe(recipe_path, ["--dataset_name", "nope.jsonl"]))


def test_a_model_that_is_neither_a_folder_nor_on_the_hub_is_a_clear_error(tiny, tmp_path, monkeypatch):
    """Offline, `--model_name_or_path tiny` without a `tiny` folder says so and how to make one, instead of
    transformers' "couldn't connect" from inside the trainer; a path-like name or a file says what is wrong."""
    import huggingface_hub.constants

    from trl_ext.recipe_inputs import check_model_source

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    recipe_path = write_recipe(tmp_path / "r.yaml", **toy_stepwise_recipe(tiny, tmp_path / "out", push_to_hub=False))
    with pytest.raises(RecipeError) as caught:
        build_trainer(parse_recipe(recipe_path, ["--model_name_or_path", "tiny"]))
    message = str(caught.value)
    assert f"r.yaml: model_name_or_path='tiny': no folder of that name ({tmp_path / 'tiny'} does not exist)" in message
    assert "the Hub is offline (HF_HUB_OFFLINE is set)" in message and "`trl-ext tiny-model tiny`" in message
    with pytest.raises(RecipeError, match=r"model_name_or_path='\./tiny': no such folder"):
        check_model_source("./tiny", "model_name_or_path")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(RecipeError, match="is a file, not a model folder"):
        check_model_source("weights.bin", "model_name_or_path")
    with pytest.raises(RecipeError, match="reward_model_name_or_path='org/rm'.*offline"):
        check_model_source("org/rm", "reward_model_name_or_path")
    check_model_source(str(tiny / "policy"), "model_name_or_path")  # a folder passes


def test_run_config_lists_the_recipes_choices_only(tiny, tmp_path):
    """`config` of the run file: the keys the recipe and its command line set that differ from the defaults, without
    bookkeeping (output_dir, logging, saving, reporting) or what the config derived (generation_batch_size)."""
    from trl_ext.run_info import config_summary

    recipe = parse_recipe(
        write_recipe(tmp_path / "r.yaml", **toy_stepwise_recipe(tiny, tmp_path / "out", push_to_hub=False)),
        ["--learning_rate", "0.002", "--seed=3"],
    )
    summary = config_summary(recipe.training_args, recipe.set_keys)
    assert summary["learning_rate"] == 0.002 and summary["seed"] == 3 and summary["loss_type"] == "ipo"
    assert summary["max_turns"] == 2 and summary["num_generations"] == 4
    for key in ("output_dir", "logging_steps", "report_to", "save_strategy", "disable_tqdm", "use_cpu"):
        assert key not in summary, key
    assert "generation_batch_size" not in summary and "model_init_kwargs" not in summary
    assert set(summary) <= recipe.set_keys


# ----------------------------------------------------------------------------------------------------------------
# Errors and reward resolution
# ----------------------------------------------------------------------------------------------------------------
def test_unknown_keys_are_named_with_a_hint(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", trainer="grpo", learnng_rate=1e-5, judge_lambda=0.5, zzz=1)
    with pytest.raises(RecipeError) as error:
        parse_recipe(path)
    message = str(error.value)
    assert "'learnng_rate' (did you mean 'learning_rate'?)" in message
    assert "'judge_lambda' (a field of trainer 'judge_credit')" in message
    assert "'zzz'" in message


def test_every_scaffold_and_sandbox_setting_is_a_recipe_key(tiny, tmp_path):
    """Each field of RLMScaffoldConfig (but the Python-only helper_objects and the nested sandbox) and of
    SandboxLimits (but the uid pool) is a stepwise recipe key, and reaches the scaffold the trainer builds."""
    from trl_ext.rlm import RLMScaffoldConfig, SandboxLimits

    scaffold_fields = {f.name for f in dataclasses.fields(RLMScaffoldConfig)} - {"helper_objects", "sandbox"}
    settings = {
        "max_prompt_tokens": 512,
        "max_batch_wait_s": 0.25,
        "max_batch_size": 16,
        "max_llm_queries": 8,
        "rlm_helpers": "def helper():\n    return 1\n",
        "rlm_no_code_prompt": "Write a repl block.",
        "rlm_leaf_recursion_note": "No children here.",
        "repl_isolation": "process",
        "repl_max_processes": 7,
        "repl_cpu_time_s": 30.0,
    }
    recipe = parse_recipe(write_recipe(tmp_path / "r.yaml", **toy_stepwise_recipe(tiny, tmp_path / "out", **settings)))
    config = recipe.training_args
    scaffold = config.scaffold_config()
    for name in scaffold_fields - {"helpers"}:
        key = name if hasattr(config, name) else f"rlm_{name}"
        assert hasattr(config, key), f"scaffold setting {name!r} has no recipe key"
    assert (scaffold.max_prompt_tokens, scaffold.max_batch_wait_s, scaffold.max_batch_size) == (512, 0.25, 16)
    assert scaffold.max_llm_queries == 8 and scaffold.helpers == (settings["rlm_helpers"],)
    assert (scaffold.no_code_prompt, scaffold.leaf_recursion_note) == ("Write a repl block.", "No children here.")
    for name in {f.name for f in dataclasses.fields(SandboxLimits)} - {"sandbox_uids"}:
        assert hasattr(config, f"repl_{name}"), f"sandbox limit {name!r} has no recipe key"
    assert (scaffold.sandbox.isolation, scaffold.sandbox.max_processes, scaffold.sandbox.cpu_time_s) == (
        "process",
        7,
        30.0,
    )


def test_bad_trainer_file_and_yaml(tmp_path):
    with pytest.raises(RecipeError, match="not one of stepwise_rlm, judge_credit, rlmt, grpo"):
        read_trainer_name(write_recipe(tmp_path / "a.yaml", trainer="ppo"))
    with pytest.raises(RecipeError, match="no such recipe file"):
        parse_recipe(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="YAML mapping"):
        parse_recipe(tmp_path / "list.yaml")
    assert read_trainer_name(write_recipe(tmp_path / "b.yaml", trainer="grpo"), ["--trainer", "rlmt"]) == "rlmt"


def test_config_validation_errors_name_the_file(tmp_path):
    path = write_recipe(
        tmp_path / "r.yaml",
        trainer="stepwise_rlm",
        child_sampling="some",
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
    )
    with pytest.raises(RecipeError, match=r"r\.yaml: child_sampling='some'"):
        parse_recipe(path)


def test_no_reward_and_no_data_are_clear_errors(tmp_path, tiny):
    base = dict(
        trainer="grpo",
        model_name_or_path=str(tiny / "policy"),
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
    )
    recipe = parse_recipe(write_recipe(tmp_path / "r.yaml", **base))
    with pytest.raises(RecipeError, match="no reward"):
        build_trainer(recipe)
    recipe = parse_recipe(
        write_recipe(tmp_path / "r2.yaml", reward_funcs=["trl_ext.quickstart.toy_task:exact_match_reward"], **base)
    )
    with pytest.raises(RecipeError, match="no data"):
        build_trainer(recipe)


def test_reward_resolution(tmp_path, monkeypatch):
    from trl_ext.quickstart.toy_task import exact_match_reward
    from trl_ext.rewards import CharSpanF1Reward, RubricJudgeReward

    (tmp_path / "my_rewards.py").write_text("def score(completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    rewards = resolve_reward_funcs(
        [
            "trl_ext.rewards.char_span_f1",  # the metric's path means the reward class
            "trl_ext.quickstart.toy_task:exact_match_reward",
            "trl_ext.quickstart.toy_task.exact_match_reward",
            "my_rewards:score",  # ./my_rewards.py, as TRL's scripts allow
            {"path": "rubric_judge", "kwargs": {"base_url": "http://127.0.0.1:9/v1", "model": "judge"}},
            {"path": "trl_ext.rewards:CharSpanF1Reward", "kwargs": {"gold_column": "gold"}},
        ]
    )
    assert isinstance(rewards[0], CharSpanF1Reward)
    assert rewards[1] is exact_match_reward and rewards[2] is exact_match_reward
    assert rewards[3](completions=["a", "b"]) == [1.0, 1.0]
    assert isinstance(rewards[4], RubricJudgeReward) and rewards[4].client.base_url == "http://127.0.0.1:9/v1"
    assert rewards[5].gold_column == "gold"
    assert REWARD_REGISTRY["char_span_f1"].endswith("CharSpanF1Reward")
    with pytest.raises(RecipeError, match="signature"):
        resolve_reward_funcs(["trl_ext.rewards.span_f1:char_span_f1"])  # the metric itself is not a reward
    with pytest.raises(RecipeError, match="cannot import module"):
        resolve_reward_funcs(["no_such_module:f"])
    with pytest.raises(RecipeError, match="has no attribute"):
        resolve_reward_funcs(["trl_ext.quickstart.toy_task:nope"])
    with pytest.raises(RecipeError, match="not a built-in name"):
        resolve_reward_funcs(["nonsense"])
    with pytest.raises(RecipeError, match="unknown keys"):
        resolve_reward_funcs([{"path": "char_span_f1", "weight": 2}])


def test_rlmt_refuses_reward_models_that_would_score_the_plan(tmp_path, tiny):
    recipe = parse_recipe(
        write_recipe(
            tmp_path / "r.yaml",
            trainer="rlmt",
            model_name_or_path=str(tiny / "policy"),
            reward_models=[str(tiny / "rm")],
            output_dir=str(tmp_path),
            use_cpu=True,
            bf16=False,
            report_to="none",
        )
    )
    with pytest.raises(RecipeError, match="reward_model_name_or_path"):
        build_trainer(recipe)


def test_script_arguments_extend_trl():
    from trl import ScriptArguments

    assert issubclass(TrainScriptArguments, ScriptArguments)


@pytest.mark.parametrize("name", ["single_gpu.yaml", "multi_gpu_zero3.yaml", "fsdp.yaml", "vllm_server.yaml"])
def test_accelerate_configs_load(name):
    """Each loads as an Accelerate config file (the class `accelerate launch --config_file` reads)."""
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ACCELERATE / name))
    expected = {
        "single_gpu.yaml": ("NO", 1),
        "multi_gpu_zero3.yaml": ("DEEPSPEED", 8),
        "fsdp.yaml": ("FSDP", 8),
        "vllm_server.yaml": ("DEEPSPEED", 7),
    }[name]
    assert (str(config.distributed_type).split(".")[-1], config.num_processes) == expected
    if "zero3" in name or "vllm" in name:
        assert config.deepspeed_config["zero_stage"] == 3
    if name == "fsdp.yaml":
        assert config.fsdp_config["fsdp_version"] == 2


# ----------------------------------------------------------------------------------------------------------------
# Asynchronous recipes (`asynchronous: true`)
# ----------------------------------------------------------------------------------------------------------------
def test_async_recipe_is_the_synchronous_one_asynchronously():
    """async_rlm_evidence_4b.yaml trains the task of rlm_evidence_4b.yaml: the same model, data, reward, scaffold,
    sandbox and loss; only the generation backend, the batch of turns and the output folder differ."""
    sync = yaml.safe_load((RECIPES / "rlm_evidence_4b.yaml").read_text())
    asyn = yaml.safe_load((RECIPES / "async_rlm_evidence_4b.yaml").read_text())
    assert set(asyn) - set(sync) == {
        "asynchronous",
        "vllm_server_base_url",
        "max_staleness",
        "weight_sync_steps",
        "queue_maxsize",
    }
    assert set(sync) - set(asyn) == {
        "attn_implementation",  # TRL's asynchronous trainer attends with its own tree kernel
        "beta",
        "use_vllm",
        "vllm_mode",
        "vllm_gpu_memory_utilization",
        "vllm_tensor_parallel_size",
        "vllm_enable_sleep_mode",
    }
    common = set(sync) & set(asyn)
    assert {key for key in common if sync[key] != asyn[key]} == {
        "output_dir",
        "gradient_accumulation_steps",
    }


def async_recipe(tmp_path: Path, trainer: str = "grpo", **fields) -> Path:
    """A small asynchronous recipe (nothing is loaded by parsing it)."""
    defaults = dict(
        trainer=trainer,
        asynchronous=True,
        model_name_or_path=str(tmp_path / "model"),
        use_peft=True,
        lora_r=4,
        reward_funcs=["tests.async_rewards:vowel_share_reward"],
        vllm_server_base_url="http://127.0.0.1:8123",
        max_staleness=1,
        loss_type="ipo",
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        report_to="none",
    )
    return write_recipe(tmp_path / "async.yaml", **{**defaults, **fields})


@pytest.mark.parametrize(
    ("trainer", "config_name", "trainer_name"),
    [
        ("grpo", "ExtAsyncGRPOConfig", "ExtAsyncGRPOTrainer"),
        ("stepwise_rlm", "AsyncStepwiseRLMConfig", "AsyncStepwiseRLMTrainer"),
    ],
)
def test_asynchronous_picks_the_methods_async_classes(tmp_path, trainer, config_name, trainer_name):
    """`asynchronous: true` keeps the method and picks its asynchronous config and trainer; TRL's async fields and
    trl-ext's loss fields parse; `dtype` is one key for the config and `ModelConfig`."""
    fields = {"max_turns": 3, "child_sampling": "one"} if trainer == "stepwise_rlm" else {}
    path = async_recipe(tmp_path, trainer, weight_sync_steps=2, ipo_threshold=0.25, dtype="bfloat16", **fields)
    recipe = parse_recipe(path, ["--queue_maxsize", "32"])
    args = recipe.training_args
    assert recipe.asynchronous and recipe.method is METHODS[trainer.replace("_", "-")]
    assert type(args).__name__ == config_name and config_class(recipe.method, True) is type(args)
    assert trainer_class(recipe.method, True).__name__ == trainer_name
    assert (args.max_staleness, args.weight_sync_steps, args.queue_maxsize) == (1, 2, 32)
    assert args.vllm_server_base_url == "http://127.0.0.1:8123"
    assert (args.loss_type, args.ipo_threshold) == ("ipo", 0.25)
    assert args.dtype == recipe.model_args.dtype == "bfloat16"
    assert recipe.model_args.use_peft and recipe.model_args.lora_r == 4
    if trainer == "stepwise_rlm":
        assert args.scaffold_config().max_turns == 3 and args.child_sampling == "one"
    # without the asynchronous-only keys, `--asynchronous false` on the command line gives the synchronous classes
    sync_fields = yaml.safe_load(path.read_text())
    for key in ("max_staleness", "weight_sync_steps", "vllm_server_base_url", "dtype"):
        sync_fields.pop(key)
    sync = parse_recipe(write_recipe(tmp_path / "sync.yaml", **sync_fields), ["--asynchronous", "false"])
    assert not sync.asynchronous and type(sync.training_args).__name__ == sync.method.config


def test_the_asynchronous_key_reads_like_trls_booleans(tmp_path):
    path = async_recipe(tmp_path, asynchronous=False)
    assert read_asynchronous(path) is False
    assert read_asynchronous(path, ["--asynchronous"]) is True  # a bare flag means true, as TRL's parser reads it
    assert read_asynchronous(path, ["--asynchronous", "--max_steps", "2"]) is True
    assert read_asynchronous(path, ["--asynchronous=true"]) is True
    assert read_asynchronous(path, ["--asynchronous", "true", "--asynchronous", "no"]) is False  # the last wins
    assert parse_recipe(path, ["--asynchronous"]).asynchronous
    with pytest.raises(RecipeError, match=r"asynchronous='maybe' is not a boolean; write `asynchronous: true`"):
        read_asynchronous(write_recipe(tmp_path / "bad.yaml", trainer="grpo", asynchronous="maybe"))


def test_every_method_names_its_async_classes_and_a_missing_one_fails_clearly(tmp_path):
    """The table names each method's asynchronous classes; a recipe that picks one trl-ext does not have (yet) fails
    at parse time, naming the class and the fix, and so does a method without an asynchronous trainer."""
    import trl_ext.trainers

    for method in METHODS.values():
        assert method.async_trainer and method.async_config, method.tag
        path = async_recipe(tmp_path, method.recipe_name)
        if hasattr(trl_ext.trainers, method.async_config) and hasattr(trl_ext.trainers, method.async_trainer):
            assert config_class(method, True).__name__ == method.async_config
            assert trainer_class(method, True).__name__ == method.async_trainer
        else:  # being written: the recipe says so instead of an AttributeError
            with pytest.raises(RecipeError) as caught:
                parse_recipe(path)
            message = str(caught.value)
            assert f"trainer {method.recipe_name!r} needs" in message and "does not have yet" in message
            assert "Remove `asynchronous: true`" in message and "grpo" in message.rsplit("exists:", 1)[1]

    unwritten = Method("x", "X", "ExtGRPOTrainer", "ExtGRPOConfig", {}, False, "NoSuchTrainer", "NoSuchConfig")
    with pytest.raises(RecipeError, match=r"trainer 'x' needs NoSuchConfig, which this trl-ext does not have yet"):
        config_class(unwritten, True)
    assert config_class(unwritten) is trl_ext.trainers.ExtGRPOConfig  # the synchronous one is there
    none = Method("y", "Y", "ExtGRPOTrainer", "ExtGRPOConfig", {}, False)
    with pytest.raises(RecipeError, match=r"trainer 'y' has no asynchronous trainer; remove `asynchronous: true`"):
        trainer_class(none, True)


def test_a_key_of_the_other_mode_is_named_with_the_fix(tmp_path):
    """`use_vllm` in an asynchronous recipe, `max_staleness` in a synchronous one: the error says whose key it is."""
    with pytest.raises(RecipeError) as caught:
        parse_recipe(async_recipe(tmp_path, use_vllm=True, learnng_rate=1e-5))
    message = str(caught.value)
    assert "unknown key(s) for asynchronous trainer 'grpo'" in message
    assert "'use_vllm' (a field of the synchronous trainer's ExtGRPOConfig, not of the asynchronous one's" in message
    assert "'learnng_rate' (did you mean 'learning_rate'?)" in message
    with pytest.raises(
        RecipeError, match=r"'max_staleness' \(a field of the asynchronous AsyncStepwiseRLMConfig: set"
    ):
        parse_recipe(async_recipe(tmp_path, "stepwise_rlm", asynchronous=False))


@pytest.mark.parametrize(
    ("fields", "build", "expected"),
    [
        ({"attn_implementation": "sdpa"}, {}, "attn_implementation='sdpa': TRL's asynchronous trainer packs"),
        ({"load_in_4bit": True}, {}, "load_in_4bit/load_in_8bit: TRL's asynchronous trainer does not load quantized"),
        ({"reward_models": ["org/rm"]}, {}, "reward_models: TRL's asynchronous rollout worker scores with reward"),
        ({"eval_strategy": "steps"}, {}, "eval_strategy='steps'\\): TRL's asynchronous trainer takes no eval_dataset"),
        ({}, {"model": object()}, "model= is a object: TRL's asynchronous trainer loads the model itself, by name"),
    ],
)
def test_what_the_async_trainer_cannot_take_is_refused_before_loading(tmp_path, fields, build, expected):
    """Each refusal names the recipe, `asynchronous: true`, the key and the fix; nothing is loaded (the recipe's model
    folder does not even exist)."""
    recipe = parse_recipe(async_recipe(tmp_path, **fields))
    with pytest.raises(RecipeError, match=f"async.yaml: asynchronous: true, .*{expected}"):
        build_trainer(recipe, **build)


def test_an_async_recipe_that_names_no_server_is_refused_before_loading(tmp_path, capsys):
    """Without `vllm_server_base_url` the trainer would wait 240 s for TRL's default, http://localhost:8000: the
    recipe is refused before anything loads (its model folder does not even exist), naming the key to add and the
    `vllm serve` command of docs/async.md for its model, LoRA rank and max_staleness."""
    from trl_ext.cli import main

    fields = yaml.safe_load(async_recipe(tmp_path, max_staleness=2).read_text())
    fields.pop("vllm_server_base_url")
    path = write_recipe(tmp_path / "async.yaml", **fields)
    with pytest.raises(RecipeError) as caught:
        build_trainer(parse_recipe(path))
    message = str(caught.value)
    assert message.startswith(f"{path}: asynchronous: true, but no vLLM server is named."), message
    assert "add its address to the recipe, `vllm_server_base_url: http://127.0.0.1:8000`" in message
    assert "`--vllm_server_base_url http://HOST:PORT`" in message and "docs/async.md" in message
    assert (
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 VLLM_SERVER_DEV_MODE=1 vllm serve "
        f"{tmp_path / 'model'} --port 8000 --enable-lora --max-lora-rank 4 --max-loras 4"
    ) in message
    assert "would wait vllm_server_timeout=240 s for TRL's default, http://localhost:8000" in message
    assert main(["train", str(path)]) == 2 and "no vLLM server is named" in capsys.readouterr().err
    full_weights = write_recipe(tmp_path / "full.yaml", **{**fields, "use_peft": False})
    with pytest.raises(RecipeError, match=r"VLLM_SERVER_DEV_MODE=1 vllm serve \S+ --port 8000\n"):
        build_trainer(parse_recipe(full_weights))

    # named on the command line, or a sampler without a server (LocalPolicy): past this check, to the next one
    with pytest.raises(RecipeError, match="model_name_or_path=.*no such folder"):
        build_trainer(parse_recipe(path, ["--vllm_server_base_url", "http://127.0.0.1:8123"]))

    class NoServer:  # what `trl_ext.trainers.LocalPolicy` says of itself
        uses_server = False

    with pytest.raises(RecipeError, match="model_name_or_path=.*no such folder"):
        build_trainer(parse_recipe(path), weight_transfer=NoServer())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--vllm_server_base_url", "127.0.0.1:8000"],
            r"vllm_server_base_url='127\.0\.0\.1:8000' is not an http:// or https:// URL.*'http://127\.0\.0\.1:8000'",
        ),
        (
            ["--vllm_server_base_url", "http://127.0.0.1:8000/v1"],
            r"vllm_server_base_url=.* ends in /v1, the OpenAI API",
        ),
        (["--max_staleness", "-1"], r"max_staleness=-1: max_staleness is how many policy versions"),
        (["--queue_maxsize", "-5"], r"queue_maxsize=-5: the bound of the rollout queue"),
    ],
)
def test_bad_async_settings_in_a_recipe_fail_at_parse_time(tmp_path, overrides, message):
    with pytest.raises(RecipeError, match=f"async.yaml: {message}"):
        parse_recipe(async_recipe(tmp_path), overrides)


def test_run_file_reward_names_come_from_the_recipe_when_the_trainer_keeps_none(tmp_path):
    """TRL's asynchronous trainer keeps its reward functions in the rollout worker: the run file names them from the
    recipe's entries (built-in names resolved); a trainer's own list wins."""
    from trl_ext.quickstart.toy_task import exact_match_reward

    recipe = parse_recipe(
        async_recipe(tmp_path),
        [
            "--reward_funcs",
            "tests.async_rewards:vowel_share_reward",
            "trl_ext.quickstart.toy_task.exact_match_reward",
            "char_span_f1",
        ],
    )
    assert reward_names(None, recipe) == ["vowel_share_reward", "exact_match_reward", "CharSpanF1Reward"]
    assert reward_names([exact_match_reward], recipe) == ["exact_match_reward"]
