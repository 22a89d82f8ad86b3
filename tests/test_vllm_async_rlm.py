"""`AsyncStepwiseRLMTrainer` against a real ``vllm serve`` (vLLM's CPU build; the session's shared server,
`tests/conftest.py`), LoRA synced over HTTP: the rollout worker's `ServedPolicyGenerator` samples RLM turns from the
latest published adapter ``trl-policy-v{N}``.

Skipped where vLLM is not installed; run with ``.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_async_rlm.py``.
"""

from __future__ import annotations

from .vllm_server import VLLM_TEST_MARKS

pytestmark = VLLM_TEST_MARKS

MAX_STEPS = 2
MAX_STALENESS = 1


def answered_reward(completions, **kwargs):
    """1 for a root that answered, else 0 (the worker also gives unanswered roots 0)."""
    return [float(bool(text)) for text in completions]


def test_async_rlm_trains_on_turns_sampled_from_the_served_adapter(tmp_path, vllm_server):
    from datasets import Dataset
    from peft import LoraConfig

    from trl_ext.trainers.async_rlm import AsyncStepwiseRLMConfig, AsyncStepwiseRLMTrainer

    args = AsyncStepwiseRLMConfig(
        output_dir=str(tmp_path / "run"),
        loss_type="ipo",
        max_steps=MAX_STEPS,
        max_staleness=MAX_STALENESS,
        per_device_train_batch_size=4,
        token_budget=0,
        queue_maxsize=16,
        num_generations=2,
        max_inflight_tasks=4,
        max_completion_length=12,
        max_turns=2,
        max_depth=0,
        max_prompt_tokens=400,
        # A short system prompt: the built-in one is long in the tiny tokenizer's tokens (max_model_len 512).
        rlm_system_prompt="Answer with Python in a repl block. Context: {context_description}.{recursion_note}",
        learning_rate=1e-2,
        vllm_server_base_url=vllm_server.url,
        use_cpu=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
    )
    trainer = AsyncStepwiseRLMTrainer(
        vllm_server.model,
        answered_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"count to {i}" for i in range(8)]}),
        peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
    )
    trainer.train()
    generator = trainer.rollout_worker.generator
    history = [entry for entry in trainer.state.log_history if "loss" in entry]

    assert trainer.state.global_step == MAX_STEPS and len(history) == MAX_STEPS
    assert (
        generator.lora_name == "trl-policy" and max(generator.versions_used) >= 1
    )  # asked for a synced adapter (v1: the sync before step 1)
    assert f"trl-policy-v{trainer.model_version}" in vllm_server.served_models()
    for entry in history:
        assert entry["rlm/turns_mean"] >= 1.0 and entry["sample/staleness_max"] <= MAX_STALENESS, entry
        # p_old is vLLM's log-probs of the version that sampled: the trainer's policy scores the same tokens alike.
        assert abs(entry["ipo/ratio_mean"] - 1.0) < 0.5, entry
