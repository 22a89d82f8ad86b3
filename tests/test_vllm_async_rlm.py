"""`AsyncStepwiseRLMTrainer` against a real ``vllm serve`` (vLLM's CPU build; the session's shared server,
`tests/conftest.py`), LoRA synced over HTTP: the rollout worker's `ServedPolicyGenerator` samples RLM turns from the
latest published adapter ``trl-policy-v{N}``.

Skipped where vLLM is not installed; run with ``.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_async_rlm.py``.
"""

from __future__ import annotations

from .vllm_server import (
    VLLM_TEST_MARKS,
    count_prompts,
    served_run_settings,
    tiny_lora,
    trained_on_synced_adapters,
    worker_metric,
)

pytestmark = VLLM_TEST_MARKS

MAX_STEPS = 2
MAX_STALENESS = 1


def answered_reward(completions, **kwargs):
    """1 for a root that answered, else 0 (the worker also gives unanswered roots 0)."""
    return [float(bool(text)) for text in completions]


def test_async_rlm_trains_on_turns_sampled_from_the_served_adapter(tmp_path, vllm_server):
    from trl_ext.trainers.async_rlm import AsyncStepwiseRLMConfig, AsyncStepwiseRLMTrainer

    args = AsyncStepwiseRLMConfig(
        output_dir=str(tmp_path / "run"),
        **served_run_settings(vllm_server, MAX_STEPS, MAX_STALENESS),
        num_generations=2,
        max_inflight_tasks=4,
        max_completion_length=12,
        max_turns=2,
        max_depth=0,
        max_prompt_tokens=400,
        # A short system prompt: the built-in one is long in the tiny tokenizer's tokens (max_model_len 512).
        rlm_system_prompt="Answer with Python in a repl block. Context: {context_description}.{recursion_note}",
    )
    trainer = AsyncStepwiseRLMTrainer(
        vllm_server.model,
        answered_reward,
        args=args,
        train_dataset=count_prompts(),
        peft_config=tiny_lora(),
    )
    trainer.train()
    history = trained_on_synced_adapters(trainer, vllm_server, MAX_STEPS)
    assert all(turns >= 1.0 for turns in worker_metric(history, "rlm/turns_mean"))
    for entry in history:
        assert entry["sample/staleness_max"] <= MAX_STALENESS, entry
        # p_old is vLLM's log-probs of the version that sampled: the trainer's policy scores the same tokens alike.
        assert abs(entry["ipo/ratio_mean"] - 1.0) < 0.5, entry
