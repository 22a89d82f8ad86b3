"""Prompt length is capped and counted for every trainer: `max_prompt_length` (TRL's pipeline) and the stepwise
trainer's `max_prompt_tokens`, both defaulting to the model's positions minus `max_completion_length`."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from datasets import Dataset

from trl_ext.testing import build_tiny_model_and_tokenizer
from trl_ext.trainers import ExtGRPOConfig, ExtGRPOTrainer
from trl_ext.trainers.prompt_cap import prompt_cap
from trl_ext.trainers.stepwise_rlm import StepwiseRLMConfig

from ..utils import cpu_config_kwargs, digit_reward
from .test_stepwise_rlm import generation_inputs, make_trainer

LONG_PROMPT = "Count the words. " + " ".join(f"w{i}" for i in range(120)) + " How many?"


def positions(n: int) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(max_position_embeddings=n))


def test_prompt_cap_defaults_to_the_positions_left_by_the_completion(caplog):
    args = SimpleNamespace(max_completion_length=8)
    assert prompt_cap(None, positions(64), args) == 56
    assert prompt_cap(None, SimpleNamespace(config=SimpleNamespace()), args) is None  # the model does not say
    vlm = SimpleNamespace(config=SimpleNamespace(text_config=SimpleNamespace(max_position_embeddings=128)))
    assert prompt_cap(None, vlm, args) == 120
    with pytest.raises(ValueError, match="leaves no room for a prompt"):
        prompt_cap(None, positions(8), args)
    with caplog.at_level(logging.WARNING):
        assert prompt_cap(100, positions(64), args) == 100  # an explicit cap is kept, with a warning
    assert "more than the model's 64 positions" in caplog.text


class PromptRecordingTrainer(ExtGRPOTrainer):
    """Records the prompt ids TRL generated from (after the cap)."""

    def on_generated(self, prompts, generated, scope):
        super().on_generated(prompts, generated, scope)
        self.generated_prompt_ids = [list(ids) for ids in generated.prompt_ids]


def grpo_trainer(tmp_path, prompts, **overrides):
    model, tokenizer = build_tiny_model_and_tokenizer(0, max_position_embeddings=64)
    config = ExtGRPOConfig(**cpu_config_kwargs(str(tmp_path), max_steps=1, **overrides))
    dataset = Dataset.from_dict({"prompt": prompts})
    trainer = PromptRecordingTrainer(
        model, digit_reward, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    return trainer, tokenizer


def test_long_prompts_are_cut_from_the_left_and_counted(tmp_path, caplog):
    # One step of 2 prompts × G=4: one generation batch of 8 rows, half of them cut
    trainer, tokenizer = grpo_trainer(tmp_path, [LONG_PROMPT, "Say hi."], per_device_train_batch_size=8)
    assert trainer.max_prompt_length == 64 - 8
    full = tokenizer(LONG_PROMPT)["input_ids"]
    assert len(full) > 64  # longer than the model's positions: before the cap it was generated from as is
    with caplog.at_level(logging.WARNING):
        trainer.train()
    lengths = [len(ids) for ids in trainer.generated_prompt_ids]
    assert max(lengths) == 56
    cut = [ids for ids in trainer.generated_prompt_ids if len(ids) == 56]
    assert cut and all(ids == full[-56:] for ids in cut)  # the end of the prompt (the question) is kept
    ratios = [
        entry["prompts/truncated_ratio"] for entry in trainer.state.log_history if "prompts/truncated_ratio" in entry
    ]
    assert ratios == [pytest.approx(0.5)]
    assert "longer than max_prompt_length=56" in caplog.text


def test_an_explicit_cap_and_image_prompts(tmp_path):
    trainer, _ = grpo_trainer(tmp_path, ["Say hi."] * 4, max_prompt_length=5)
    assert trainer.max_prompt_length == 5
    trainer.model.train()
    assert trainer.limit_prompt_ids([[1, 2, 3, 4, 5, 6, 7], [8, 9]], multimodal=False) == [[3, 4, 5, 6, 7], [8, 9]]
    with pytest.raises(ValueError, match="prompt\\(s\\) with images are longer than max_prompt_length=5"):
        trainer.limit_prompt_ids([[1, 2, 3, 4, 5, 6, 7]], multimodal=True)
    assert trainer.limit_prompt_ids([[1, 2]], multimodal=True) == [[1, 2]]  # short image prompts pass
    with pytest.raises(ValueError, match="must be >= 1"):
        ExtGRPOConfig(**cpu_config_kwargs(str(tmp_path), max_prompt_length=0))


def test_stepwise_turn_prompts_stop_at_the_model_positions_and_are_counted(tmp_path):
    # The scripted trees' first turns need 1,191–1,283 tokens and later turns up to 1,433: 1,300 leave some nodes
    # without room for their second or third turn.
    trainer = make_trainer(tmp_path, model_config=dict(max_position_embeddings=1308), save_rollout_trees=False)
    assert trainer.method.scaffold.max_prompt_tokens == 1300  # None: the positions minus max_completion_length=8
    trainer.model.train()
    trainer._generate_and_score_completions(generation_inputs())
    nodes = [node for tree in trainer.last_rollout_trees for node in tree.nodes]
    too_long = [node for node in nodes if node.end_reason == "prompt_too_long"]
    assert too_long
    assert all(len(turn.prompt_ids) <= 1300 for node in nodes for turn in node.turns)
    assert trainer._metrics["train"]["rlm/prompt_too_long_total"] == [len(too_long)]


def test_stepwise_config_names_its_own_prompt_cap(tmp_path):
    with pytest.raises(ValueError, match="set max_prompt_tokens"):
        StepwiseRLMConfig(**cpu_config_kwargs(str(tmp_path), max_prompt_length=512))
    trainer = make_trainer(tmp_path, save_rollout_trees=False, max_prompt_tokens=3000)
    assert trainer.method.scaffold.max_prompt_tokens == 3000  # an explicit cap is the user's
