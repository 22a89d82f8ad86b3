"""End to end: the tiny model with a LoRA adapter runs real RLM rollouts (transformers) and trains stepwise."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig

from trl_ext.rlm import RLMEngine, RLMScaffoldConfig, RLMTask, ScriptedGenerator
from trl_ext.testing import build_tiny_model_and_tokenizer
from trl_ext.trainers.stepwise_rlm import StepwiseRLMConfig, StepwiseRLMTrainer

from ..utils import cpu_config_kwargs

SHORT_PROMPTS = dict(
    rlm_system_prompt="REPL. context: {context_description}.{recursion_note}",
    rlm_first_user_prompt="Task: {task}",
    rlm_user_prompt="Task: {task} ({turns_left} left)",
)
TEACHER = {1: "```repl\nprint(context)\n```", 2: "FINAL(yes)"}


def cold_start(model, tokenizer, config: RLMScaffoldConfig) -> None:
    """A few steps of plain SFT on scripted two-turn traces (half answer yes, half no): the policy then follows
    the format, and its answers vary, so group advantages are non-zero."""
    traces = []
    for answer in ("yes", "no"):
        script = {**TEACHER, 2: f"FINAL({answer})"}
        generator = ScriptedGenerator(lambda prompt, s=script: s[prompt.count("<|im_start|>assistant")], tokenizer)
        trees = RLMEngine(generator, tokenizer, config).run([RLMTask("is it?", context="ab")])
        traces += [(t.prompt_ids, t.action_ids) for t in trees[0].root.turns]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(60):
        loss = 0.0
        for prompt_ids, action_ids in traces:
            ids = torch.tensor([prompt_ids + action_ids])
            logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(action_ids))
        optimizer.zero_grad()
        (loss / len(traces)).backward()
        optimizer.step()


def cold_started_trainer(output_dir, reward, rows: int, callbacks=None, **settings) -> StepwiseRLMTrainer:
    """`StepwiseRLMTrainer` of the tiny model after `cold_start`, with a LoRA adapter, on ``rows`` copies of the
    task "is it?" (context "ab"), its config (IPO, one level, 3 turns, short prompts) with ``settings`` on top."""
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    base = dict(loss_type="ipo", max_turns=3, max_depth=0, max_completion_length=16, **SHORT_PROMPTS)
    config = StepwiseRLMConfig(**cpu_config_kwargs(str(output_dir), **{**base, **settings}))
    cold_start(model, tokenizer, config.scaffold_config())
    return StepwiseRLMTrainer(
        model,
        reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["is it?"] * rows, "context": ["ab"] * rows}),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        callbacks=callbacks,
    )


@pytest.mark.slow
def test_tiny_model_trains_stepwise_with_lora(tmp_path):
    def yes_reward(completions, **kwargs):
        return [1.0 if text.strip() == "yes" else 0.0 for text in completions]

    trainer = cold_started_trainer(tmp_path, yes_reward, 8, num_iterations=2, max_steps=4, learning_rate=5e-2)
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    trainer.train()

    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    first = trainer.state.log_history[0]
    for key in ("rlm/turns_mean", "rlm/rows_per_root", "rlm/final_answer_rate", "repl/error_rate", "ipo/masked_ratio"):
        assert key in first, key
    assert 0.0 < first["rlm/final_answer_rate"] <= 1.0
    assert 0.0 < first["reward"] < 1.0, "the cold-started policy should answer yes only sometimes"
    changed = [n for n, p in trainer.model.named_parameters() if "lora_" in n and not torch.equal(p, lora_before[n])]
    assert changed, "no LoRA weight changed"
    assert list((tmp_path / "rlm_trees").glob("train-v*.jsonl"))


def _seeded_run(output_dir) -> tuple[list[str], list[dict]]:
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    settings = dict(
        loss_type="ipo", max_turns=3, max_depth=0, max_completion_length=16, max_steps=2, seed=3, **SHORT_PROMPTS
    )
    config = StepwiseRLMConfig(**cpu_config_kwargs(str(output_dir), **settings))
    cold_start(model, tokenizer, config.scaffold_config())

    def yes_reward(completions, **kwargs):
        return [1.0 if text.strip() == "yes" else 0.0 for text in completions]

    dataset = Dataset.from_dict({"prompt": ["is it?"] * 8, "context": ["ab"] * 8})
    trainer = StepwiseRLMTrainer(model, yes_reward, args=config, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    trees = [p.read_text() for p in sorted((output_dir / "rlm_trees").glob("train-v*.jsonl"))]
    timing = ("time", "runtime", "per_second", "latency", "_s")
    logs = [{k: v for k, v in entry.items() if not any(t in k for t in timing)} for entry in trainer.state.log_history]
    return trees, logs


@pytest.mark.slow
def test_same_seed_gives_the_same_rollouts_and_metrics(tmp_path):
    """Library-level determinism: the REPL cells of a wave finish in a different order each run, yet two runs of
    the plain `StepwiseRLMTrainer` with one seed sample the same trees and log the same metrics."""
    first_trees, first_logs = _seeded_run(tmp_path / "a")
    second_trees, second_logs = _seeded_run(tmp_path / "b")
    assert first_trees and first_trees == second_trees
    assert len(first_logs) >= 2 and first_logs == second_logs
