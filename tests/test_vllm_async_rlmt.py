"""`AsyncRLMTTrainer` against a real ``vllm serve`` (vLLM's CPU build; the session's shared server,
`tests/conftest.py`), LoRA synced over HTTP: the rollout worker samples each group in one request (``n`` = group
size) from the latest published adapter, vLLM stops at the stop string, and a tiny reward model (saved to a
directory, loaded from ``reward_model_name_or_path``) scores the responses.

Skipped where vLLM is not installed; run with ``.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_async_rlmt.py``.
"""

from __future__ import annotations

import math

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
NUM_GENERATIONS = 4
STOP = "e"  # a one-character stop string the untrained policy hits; "</response>" works the same way


def test_async_rlmt_trains_on_served_completions_scored_by_the_reward_model(tmp_path, vllm_server):
    from trl_ext.rewards.rlmt import ZERO_PROMPT_PREFIX
    from trl_ext.testing import build_tiny_reward_model
    from trl_ext.trainers.async_rlmt import AsyncRLMTConfig, AsyncRLMTTrainer

    reward_model, reward_tokenizer = build_tiny_reward_model(seed=5, initializer_range=0.5)
    reward_model.save_pretrained(tmp_path / "rm")
    reward_tokenizer.save_pretrained(tmp_path / "rm")
    args = AsyncRLMTConfig(
        output_dir=str(tmp_path / "run"),
        rlmt_format="zero",
        stop_strings=[STOP],
        reward_model_name_or_path=str(tmp_path / "rm"),
        reward_model_dtype="float32",
        strict_format=False,  # the untrained policy never writes </think>: score its text
        **served_run_settings(vllm_server, MAX_STEPS, MAX_STALENESS),
        num_generations=NUM_GENERATIONS,
        max_inflight_tasks=NUM_GENERATIONS,
        max_completion_length=16,
    )
    trainer = AsyncRLMTTrainer(
        vllm_server.model,
        args=args,
        train_dataset=count_prompts(),
        peft_config=tiny_lora(),
    )
    assert trainer.train_dataset[0]["prompt"].startswith(ZERO_PROMPT_PREFIX)
    trainer.train()
    worker = trainer.rollout_worker
    history = trained_on_synced_adapters(trainer, vllm_server, MAX_STEPS)
    tokenizer = worker.tokenizer
    completions = worker.method.last_completions
    assert len(completions) == NUM_GENERATIONS
    assert len({tuple(ids) for ids, _, _ in completions}) > 1  # n-sampling: a group's completions are distinct draws
    for ids, _, _ in completions:  # each ends at its first stop string at the latest: nothing after it
        assert STOP not in tokenizer.decode(ids[:-1], skip_special_tokens=False), tokenizer.decode(ids)
    for entry in history:
        assert entry["sample/staleness_max"] <= MAX_STALENESS, entry
        # Rewards came from the reward model: its scores of the responses, logged by the scorer.
        assert math.isfinite(entry["rewards/reward_model"]) and math.isfinite(entry["reward"]), entry
        # p_old is vLLM's log-probs of the version that sampled: the trainer's policy scores the same tokens alike.
        assert abs(entry["ipo/ratio_mean"] - 1.0) < 0.5, entry
    assert all(math.isfinite(score) for score in worker_metric(history, "reward_model/response_score_mean"))
    assert all(0.0 <= ratio <= 1.0 for ratio in worker_metric(history, "rlmt/stop_cut_ratio"))
