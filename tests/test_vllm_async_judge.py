"""`AsyncJudgeCreditTrainer` against a real ``vllm serve`` (vLLM's CPU build; the session's shared server,
`tests/conftest.py`), LoRA synced over HTTP, and the scripted judge server on 127.0.0.1: the rollout worker samples
from the latest published adapter ``trl-policy-v{N}``, the judge marks spans of every rollout, and the loss trains on
``A + cap_λ(c)``.

Skipped where vLLM is not installed; run with ``.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_async_judge.py``.
"""

from __future__ import annotations

import json

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


def length_reward(completions, **kwargs):
    """Shorter is better: differs between the sampled completions, so the group advantages do too."""
    return [-len(text) / 100 for text in completions]


def test_async_judge_trains_on_served_rollouts_with_the_scripted_judge(tmp_path, vllm_server):
    from trl_ext.quickstart.scripted_server import ScriptedChatServer
    from trl_ext.trainers.async_judge import AsyncJudgeCreditConfig, AsyncJudgeCreditTrainer

    from .trainers.test_judge_trainer import SpanPickingJudge

    judge = SpanPickingJudge()
    with ScriptedChatServer(judge) as judge_server:
        args = AsyncJudgeCreditConfig(
            output_dir=str(tmp_path / "run"),
            judge_base_url=judge_server.base_url,
            judge_model="scripted-judge",
            judge_tools=[],
            judge_max_retries=0,
            judge_timeout=10.0,
            marker_every=1,  # a marker before every token: the scripted judge picks exact spans
            judge_lambda=0.25,
            **served_run_settings(vllm_server, MAX_STEPS, MAX_STALENESS),
            num_generations=2,
            max_inflight_tasks=4,
            max_completion_length=12,
        )
        trainer = AsyncJudgeCreditTrainer(
            vllm_server.model,
            length_reward,
            args=args,
            train_dataset=count_prompts(),
            peft_config=tiny_lora(),
        )
        trainer.train()
    history = trained_on_synced_adapters(trainer, vllm_server, MAX_STEPS)
    assert all(ratio == 0.0 for ratio in worker_metric(history, "judge/failure_ratio"))
    for entry in history:
        assert entry["sample/staleness_max"] <= MAX_STALENESS, entry
        # p_old is vLLM's log-probs of the version that sampled: the trainer's policy scores the same tokens alike.
        assert abs(entry["ipo/ratio_mean"] - 1.0) < 0.5, entry
    records = [json.loads(line) for line in open(trainer.judge_audit_path)]
    assert records and {r["status"] for r in records} == {"ok"}
    assert sum(len(r["spans"]) for r in records) >= 1 and judge.spans_by_text  # the judge marked real spans
