"""`ExtAsyncGRPOTrainer` (on TRL's asynchronous GRPO trainer) against a real `vllm serve`, LoRA synced over HTTP.

The session's shared server (`tests/conftest.py`, `tests/vllm_server.py`: vLLM's CPU build, float32, a fixed 1 GiB
KV cache), cleared of earlier runs' adapters, and one training run of three asynchronous steps against it with the
IPO loss (`loss_type="ipo"`, `max_staleness=1`): TRL's rollout worker in a spawned child process samples from the
server, and after every optimizer step the trainer publishes its LoRA adapter as ``trl-policy-v{N}``
(``/v1/load_lora_adapter``). The tests then check the run's metrics, which adapters the server holds, and that the
server generates with the trained weights: it scores a fixed prompt and completion under the latest adapter with the
same per-token log-probs as the trainer's final policy, and differently from the base model.

Skipped where vLLM is not installed (the main environment); run with
``.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_async.py``.

The trainer runs on the CPU by itself: `trl_ext.trainers.async_seam` puts a CPU kernel under TRL's tree attention
(FlashAttention-3 on CUDA) when the model trains off CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .async_rewards import vowel_share_reward
from .vllm_server import VLLM_TEST_MARKS, VLLMServer, start_vllm_server

pytestmark = VLLM_TEST_MARKS

MAX_STEPS = 3
MAX_STALENESS = 1
# Both sides score in float32 with the same weights; they differ only in kernels and summation order (about 1e-6
# nats per token here). 1e-3 is the group's float32 sync tolerance (tests/test_vllm.py): far above that noise, and far
# below what the adapter changes (checked: at least TRAINED_SHIFT_FACTOR times more).
LOGPROB_TOLERANCE = 1e-3
TRAINED_SHIFT_FACTOR = 10
LORA_RANK = 8


@dataclass
class TrainedRun:
    trainer: Any
    server: VLLMServer
    model_dir: Path
    history: list[dict]  # the per-step logs (the final summary entry left out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_vllm_server) -> TrainedRun:
    from datasets import Dataset
    from peft import LoraConfig

    from trl_ext.trainers import ExtAsyncGRPOConfig, ExtAsyncGRPOTrainer

    server = shared_vllm_server  # module-scoped, so not the function-scoped `vllm_server`: cleared here instead
    server.clear_lora_adapters()
    model_dir = Path(server.model)
    # A short system prompt: the qwen2_5 template's default one is ~70 tokens of the tiny tokenizer.
    prompts = [[{"role": "system", "content": "Count."}, {"role": "user", "content": f"to {i}"}] for i in range(32)]
    args = ExtAsyncGRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("vllm_async") / "run"),
        loss_type="ipo",
        max_steps=MAX_STEPS,
        max_staleness=MAX_STALENESS,
        # Small steps for 2 CPU cores: 8 samples (2 prompts x 4 completions) a step, not a whole `max_model_len` of
        # tokens (the default token budget), and a short queue, so the worker stops generating samples that would
        # only be dropped as stale.
        per_device_train_batch_size=8,
        token_budget=0,
        queue_maxsize=16,
        num_generations=4,
        max_completion_length=12,
        learning_rate=1e-2,  # large, so three steps move the policy far beyond the log-prob tolerance
        vllm_server_base_url=server.url,
        use_cpu=True,  # float32 (TRL's default dtype; no bf16 on the CPU)
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
    )
    trainer = ExtAsyncGRPOTrainer(
        str(model_dir),
        vowel_share_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        peft_config=LoraConfig(r=LORA_RANK, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
    )
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "train_runtime" not in entry]
    return TrainedRun(trainer=trainer, server=server, model_dir=model_dir, history=history)


def test_async_steps_log_staleness_and_loss_metrics(trained):
    assert trained.trainer.state.global_step == MAX_STEPS
    assert [entry["step"] for entry in trained.history] == list(range(1, MAX_STEPS + 1))
    for entry in trained.history:
        # Every trained sample was at most MAX_STALENESS policy versions old (older ones are dropped).
        assert 0.0 <= entry["sample/staleness_mean"] <= entry["sample/staleness_max"] <= MAX_STALENESS, entry
        # The IPO loss's metrics (trl_ext.losses.ipo_loss) and TRL's policy metrics; not TRL's PPO-clip ones.
        for name in ("loss", "ipo/masked_ratio", "ipo/capped_ratio", "ipo/ratio_mean", "ratio", "kl", "entropy"):
            assert isinstance(entry[name], float), (name, entry)
        assert 0.0 <= entry["ipo/masked_ratio"] <= 1.0 and 0.0 <= entry["ipo/capped_ratio"] <= 1.0, entry
        # p_old is the sampler's (vLLM's float32 log-probs of the version that sampled): ratios near 1.
        assert abs(entry["ratio"] - 1.0) < 0.5 and abs(entry["ipo/ratio_mean"] - 1.0) < 0.5, entry
        assert not any(key.startswith("clip_ratio/") for key in entry), entry


def test_server_holds_the_latest_policy_versions(trained):
    # One cold sync before training, then one per optimizer step (weight_sync_steps=1).
    version = trained.trainer.model_version
    assert version == MAX_STEPS + 1
    adapters = sorted(trained.server.lora_adapters())
    # Each sync unloads the version that fell out of the staleness window: the last MAX_STALENESS + 1 remain.
    assert adapters == [f"trl-policy-v{v}" for v in range(version - MAX_STALENESS, version + 1)]


def fixed_sequence(model_dir: Path) -> list[int]:
    """The token ids of a fixed chat prompt followed by a fixed completion and the end-of-turn token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "count to 3"}], add_generation_prompt=True, tokenize=False
    )
    completion = "1 2 3, one two three"
    return tokenizer.encode(prompt + completion, add_special_tokens=False) + [tokenizer.eos_token_id]


def transformers_logprobs(model, token_ids: list[int]) -> list[float]:
    """Per-token log-probs of ``token_ids[1:]`` under `model` (float32, raw logits): ``len(token_ids) - 1`` floats."""
    import torch

    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0].tolist()


def max_gap(a: list[float], b: list[float]) -> float:
    """The largest per-token difference of two log-prob lists (nats)."""
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_server_generates_with_the_trained_adapter(trained):
    import torch
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    token_ids = fixed_sequence(trained.model_dir)
    latest = f"trl-policy-v{trained.trainer.model_version}"
    served_trained = trained.server.prompt_logprobs(latest, token_ids)
    served_base = trained.server.prompt_logprobs(trained.server.model, token_ids)

    # The trainer's final policy, scored by plain transformers: the base weights plus the LoRA weights the trainer
    # holds after its last step (copied from memory, not read from the adapter files the server loaded).
    trainer_model = trained.trainer.accelerator.unwrap_model(trained.trainer.model)
    base = AutoModelForCausalLM.from_pretrained(trained.model_dir, dtype=torch.float32)
    policy = get_peft_model(base, trainer_model.peft_config["default"]).eval()
    loaded = set_peft_model_state_dict(policy, get_peft_model_state_dict(trainer_model))
    assert not [key for key in loaded.unexpected_keys if "lora_" in key], loaded
    final = transformers_logprobs(policy, token_ids)
    with policy.disable_adapter():
        initial = transformers_logprobs(policy, token_ids)

    report = {
        "served adapter vs trainer": max_gap(served_trained, final),
        "served base vs transformers base": max_gap(served_base, initial),
        "trainer final vs base": max_gap(final, initial),
    }
    print(f"\n{latest}, {len(token_ids) - 1} tokens, max |Δ log-prob| (nats): {report}")
    # The server scores with the weights the trainer ended with ...
    assert report["served adapter vs trainer"] < LOGPROB_TOLERANCE, report
    # ... (its base model is the trainer's, so the comparison is like for like) ...
    assert report["served base vs transformers base"] < LOGPROB_TOLERANCE, report
    # ... and those weights have moved: the adapter changes the log-probs far beyond the tolerance.
    assert report["trainer final vs base"] > TRAINED_SHIFT_FACTOR * LOGPROB_TOLERANCE, report
    assert max_gap(served_trained, served_base) > TRAINED_SHIFT_FACTOR * LOGPROB_TOLERANCE, report


def test_a_server_that_fails_to_start_raises_with_its_log(tmp_path):
    (tmp_path / "not_a_model").mkdir()
    with pytest.raises(RuntimeError, match="exited with code") as failure:
        start_vllm_server(tmp_path / "not_a_model", tmp_path / "failed.log", timeout_s=120)
    log = (tmp_path / "failed.log").read_text()
    assert "Error" in log and log[-200:] in str(failure.value)  # the error ends with the log's tail


def test_a_cleared_server_serves_a_reused_adapter_name_with_the_new_weights(vllm_server, tmp_path):
    """What one server for many trainers rests on: every run publishes ``trl-policy-v1``, ``-v2``, ... again, and after
    `VLLMServer.clear_lora_adapters` a name loaded again serves the new adapter, not the one it named before."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    token_ids = fixed_sequence(Path(vllm_server.model))
    name = "trl-policy-v1"
    served, expected = [], []
    for seed in (1, 2):  # two adapters with different random weights, loaded in turn under the same name
        base = AutoModelForCausalLM.from_pretrained(vllm_server.model, dtype=torch.float32)
        torch.manual_seed(seed)
        lora = LoraConfig(r=LORA_RANK, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        adapter = get_peft_model(base, lora).eval()
        adapter.save_pretrained(tmp_path / f"adapter_{seed}")
        vllm_server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(tmp_path / f"adapter_{seed}")})
        served.append(vllm_server.prompt_logprobs(name, token_ids))
        expected.append(transformers_logprobs(adapter, token_ids))
        vllm_server.clear_lora_adapters()
        assert vllm_server.lora_adapters() == []

    report = {"adapter 1 served vs its weights": max_gap(served[0], expected[0])}
    report["adapter 2 served vs its weights"] = max_gap(served[1], expected[1])
    report["adapter 2 vs adapter 1"] = max_gap(expected[1], expected[0])
    assert report["adapter 1 served vs its weights"] < LOGPROB_TOLERANCE, report
    assert report["adapter 2 served vs its weights"] < LOGPROB_TOLERANCE, report
    assert report["adapter 2 vs adapter 1"] > TRAINED_SHIFT_FACTOR * LOGPROB_TOLERANCE, report
