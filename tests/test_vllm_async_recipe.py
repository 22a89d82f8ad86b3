"""An asynchronous recipe (``asynchronous: true``, docs/recipes.md) trained against a real ``vllm serve`` (vLLM's
CPU build, `tests/vllm_server.py`): two steps of a tiny recipe written to a temporary folder, for ``grpo``
(`ExtAsyncGRPOTrainer`, through the ``trl-ext train`` command: its rollout worker is a spawned process that imports
the recipe's reward function by its path) and for ``stepwise_rlm`` (`AsyncStepwiseRLMTrainer`, through
`train_from_recipe`, which returns the trainer). Both runs use the session's shared server (`tests/conftest.py`),
cleared of earlier runs' adapters (each run publishes ``trl-policy-v1``, ``-v2``, ... again). The outputs are
checked: the LoRA adapter, ``trl_ext_run.json`` (the method, the asynchronous trainer, ``asynchronous: true``, the
asynchronous settings, the staleness metrics), the monitors (the `StalenessMonitor` among them) and their plot.

Skipped where vLLM is not installed; run with
``.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_async_recipe.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from .vllm_server import VLLM_TEST_MARKS

pytestmark = VLLM_TEST_MARKS

MAX_STEPS = 2
MAX_STALENESS = 1
REWARD = "tests.async_rewards:vowel_share_reward"  # module-level: the spawned rollout worker imports it

# Small steps for 2 CPU cores (as tests/test_vllm_async.py and tests/test_vllm_async_rlm.py): a few samples a step,
# not a whole `max_model_len` of tokens (token_budget 0), and a short queue, so the worker stops generating samples
# that would only be dropped as stale.
METHOD_FIELDS = {
    "grpo": {
        "num_generations": 4,
        "per_device_train_batch_size": 8,
    },
    "stepwise_rlm": {
        "num_generations": 2,
        "per_device_train_batch_size": 4,
        "max_inflight_tasks": 4,
        "max_turns": 2,
        "max_depth": 0,
        "max_prompt_tokens": 400,
        # A short system prompt: the built-in one is long in the tiny tokenizer's tokens (max_model_len 512).
        "rlm_system_prompt": "Answer with Python in a repl block. Context: {context_description}.{recursion_note}",
    },
}


def write_data(path: Path, trainer: str) -> Path:
    """16 tasks: short conversational prompts for grpo (the qwen2_5 template's default system prompt is ~70 tiny
    tokens), questions with a context for the RLM."""
    if trainer == "grpo":
        rows = [
            {"prompt": [{"role": "system", "content": "Count."}, {"role": "user", "content": f"to {i}"}]}
            for i in range(16)
        ]
    else:
        rows = [{"prompt": f"count to {i}", "context": f"n={i}"} for i in range(16)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_async_recipe(tmp_path: Path, trainer: str, model_name_or_path: str, server_url: str) -> Path:
    """A two-step asynchronous recipe for the tiny model on the CPU (IPO loss, LoRA r8)."""
    fields = {
        "trainer": trainer,
        "asynchronous": True,
        "model_name_or_path": model_name_or_path,
        "use_peft": True,
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "lora_target_modules": ["q_proj", "v_proj"],
        "datasets": [
            {"path": "json", "data_files": str(write_data(tmp_path / "train.jsonl", trainer)), "split": "train"}
        ],
        "reward_funcs": [REWARD],
        "vllm_server_base_url": server_url,
        "max_staleness": MAX_STALENESS,
        "token_budget": 0,
        "queue_maxsize": 16,
        "loss_type": "ipo",
        "max_completion_length": 12,
        "learning_rate": 1.0e-2,
        "max_steps": MAX_STEPS,
        "use_cpu": True,
        "gradient_checkpointing": False,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": 0,
        "output_dir": str(tmp_path / "run"),
        **METHOD_FIELDS[trainer],
    }
    path = tmp_path / f"async_{trainer}.yaml"
    path.write_text(yaml.safe_dump(fields, sort_keys=False), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("trainer", "trainer_class"),
    [("grpo", "ExtAsyncGRPOTrainer"), ("stepwise_rlm", "AsyncStepwiseRLMTrainer")],
)
def test_an_async_recipe_trains_against_vllm_serve(tmp_path, vllm_server, trainer, trainer_class):
    from trl_ext.callbacks import MonitorCallback
    from trl_ext.cli import main
    from trl_ext.recipe_training import train_from_recipe
    from trl_ext.recipes import parse_recipe

    recipe_path = write_async_recipe(tmp_path, trainer, vllm_server.model, vllm_server.url)
    if trainer == "grpo":  # the command itself
        assert main(["train", str(recipe_path)]) == 0
        run_trainer = None
    else:  # the same path, with the trainer returned for a look at its monitors
        run_trainer = train_from_recipe(parse_recipe(recipe_path))
    served = vllm_server.served_models()

    output = tmp_path / "run"
    assert (output / "adapter_config.json").is_file() and (output / "adapter_model.safetensors").is_file()
    assert not (output / "model.safetensors").exists()
    info = json.loads((output / "trl_ext_run.json").read_text())
    assert info["method"] == trainer.replace("_", "-") and info["trainer"] == trainer_class
    assert info["extra"]["asynchronous"] is True and info["extra"]["recipe"] == str(recipe_path)
    assert info["steps"] == MAX_STEPS and info["reward_funcs"] == ["vowel_share_reward"]
    assert info["peft"]["r"] == 8
    config = info["config"]
    assert config["loss_type"] == "ipo" and config["max_staleness"] == MAX_STALENESS and config["token_budget"] == 0
    assert "vllm_server_base_url" not in config  # an endpoint, not a training choice
    metrics = info["metrics"]
    assert 0.0 <= metrics["sample/staleness_max"] <= MAX_STALENESS, metrics
    assert "ipo/masked_ratio" in metrics and "reward" in metrics, metrics
    if trainer == "stepwise_rlm":
        assert metrics["rlm/turns_mean"] >= 1.0, metrics
    assert (output / "trainer_state.json").is_file() and (output / "monitors.png").is_file()
    assert f"trl-policy-v{MAX_STEPS + 1}" in served  # the cold sync, then one per step: the server has the last

    if run_trainer is not None:  # default_monitors for an asynchronous config: the StalenessMonitor too
        monitors = [cb for cb in run_trainer.callback_handler.callbacks if isinstance(cb, MonitorCallback)]
        names = {type(monitor).__name__ for monitor in monitors}
        assert {"ClipRateMonitor", "EntropyMonitor", "RewardMonitor", "StalenessMonitor"} <= names, names
