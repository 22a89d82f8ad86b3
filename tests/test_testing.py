"""`trl_ext.testing`: the tiny models for vLLM say what vLLM needs and reload from disk unchanged."""

from __future__ import annotations

import pytest
import torch

from trl_ext.testing import (
    build_tiny_model_and_tokenizer,
    build_tiny_vlm_and_processor,
    check_vllm_compatible,
    save_tiny_model,
)


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


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_a_tiny_vision_language_model_is_seeded_and_expands_its_images(family):
    from PIL import Image

    model, processor = build_tiny_vlm_and_processor(0, family)
    again, _ = build_tiny_vlm_and_processor(0, family)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    text = processor.apply_chat_template(
        [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]],
        add_generation_prompt=True,
        tokenize=False,
    )
    inputs = processor(text=text, images=[Image.new("RGB", (56, 40), (200, 30, 30))], return_tensors="pt")
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    patches = int(inputs["image_grid_thw"].prod())  # 56×40 pixels: a 4×2 grid of 14-pixel patches
    assert patches == 8 and inputs["pixel_values"].shape[0] == patches
    assert int((inputs["input_ids"] == image_token).sum()) == patches // 4  # one token per 2×2 merged patches
    assert (
        model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False).shape[1]
        == inputs["input_ids"].shape[1] + 3
    )
    with pytest.raises(ValueError, match="family='llava'"):
        build_tiny_vlm_and_processor(0, "llava")
