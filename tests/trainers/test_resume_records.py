"""After a resume, the per-step records the trainers write are replaced, not duplicated: the judge audit log
(judge credit; the stepwise rollout trees are checked after a real kill in test_resume.py). Resuming from an earlier
checkpoint of a finished run redoes the same steps as a run killed after that checkpoint, in process."""

from __future__ import annotations

from pathlib import Path

import pytest

from trl_ext.jsonl import read_jsonl, written_after
from trl_ext.quickstart.scripted_server import ScriptedChatServer
from trl_ext.testing import build_tiny_model_and_tokenizer
from trl_ext.trainers.judge_credit import JudgeCreditConfig, JudgeCreditTrainer

from ..utils import cpu_config_kwargs, digit_reward, toy_dataset
from .test_judge_trainer import SpanPickingJudge, judge_kwargs, lora


def test_written_after_keeps_the_evaluation_that_preceded_the_checkpoint():
    # Step g+1's batch is generated at global step g; evaluation at step S runs before checkpoint-S is saved.
    assert [written_after("train", step, 2) for step in range(4)] == [False, False, True, True]
    assert [written_after("eval", step, 2) for step in range(4)] == [False, False, False, True]
    assert written_after("train", 0, 0)  # a new run in a used output_dir redoes everything it trained


@pytest.mark.slow
def test_judge_audit_log_of_redone_steps_is_replaced(tmp_path):
    judge = SpanPickingJudge()

    def run(resume=None) -> JudgeCreditTrainer:
        model, tokenizer = build_tiny_model_and_tokenizer(0)
        config = JudgeCreditConfig(
            **cpu_config_kwargs(str(tmp_path), max_steps=3, save_strategy="steps", save_steps=1),
            **judge_kwargs(server),
        )
        trainer = JudgeCreditTrainer(
            model,
            digit_reward,
            args=config,
            train_dataset=toy_dataset(),
            processing_class=tokenizer,
            peft_config=lora(),
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    with ScriptedChatServer(judge) as server:
        trainer = run()
        path = Path(trainer.judge_audit_path)
        before = read_jsonl(path)
        assert [record["step"] for record in before] == [0] * 4 + [1] * 4 + [2] * 4
        run(resume=str(tmp_path / "checkpoint-1"))
    after = read_jsonl(path)
    assert [record["step"] for record in after] == [0] * 4 + [1] * 4 + [2] * 4  # redone, not appended twice
    assert after[:4] == before[:4]  # the step before the checkpoint is untouched
    assert [r["completion_hash"] for r in after] == [r["completion_hash"] for r in before]  # the same rollouts
