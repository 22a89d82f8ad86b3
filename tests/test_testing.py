"""`trl_ext.testing`: the tiny models for vLLM say what vLLM needs and reload from disk unchanged."""

from __future__ import annotations

import pytest
import torch

from trl_ext.testing import build_tiny_model_and_tokenizer, check_vllm_compatible, save_tiny_model


def test_a_vllm_tiny_model_has_a_head_size_vllm_accepts_and_reloads_from_disk(tmp_path):
    from transformers import AutoModelForCausalLM

    model, tokenizer = build_tiny_model_and_tokenizer(0, vllm=True)
    assert model.config.hidden_size // model.config.num_attention_heads == 32
    check_vllm_compatible(model.config)
    directory = save_tiny_model(model, tokenizer, tmp_path / "tiny")
    reloaded = AutoModelForCausalLM.from_pretrained(directory)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)


def test_the_default_tiny_model_is_refused_with_the_reason():
    model, _ = build_tiny_model_and_tokenizer(0)  # 4 heads of 8
    with pytest.raises(ValueError, match=r"head_dim=8 \(hidden_size=32 / num_attention_heads=4\).*vllm=True"):
        check_vllm_compatible(model.config)
    with pytest.raises(ValueError, match="head_dim=16"):
        build_tiny_model_and_tokenizer(0, vllm=True, num_attention_heads=2, num_key_value_heads=1)
