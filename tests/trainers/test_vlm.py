"""`ExtGRPOTrainer` as a drop-in for TRL's vision-language GRPO: tiny Qwen2-VL and Qwen2.5-VL models built offline
(`trl_ext.testing.build_tiny_vlm_and_processor`) train with the same losses as `trl.GRPOTrainer`, rows with several
images included; the row hook and the padding handle every image layout TRL builds."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from PIL import Image
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from trl_ext.testing import build_tiny_model_and_tokenizer, build_tiny_vlm_and_processor
from trl_ext.trainers import ExtGRPOConfig, ExtGRPOTrainer
from trl_ext.trainers.trl_seam import BatchScope

from ..utils import cpu_config_kwargs

pytestmark = pytest.mark.slow

COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)]
SIZES = [(40, 30), (28, 28), (56, 40), (30, 50)]  # 1 to 4 merged patches each


def digit_reward(completions, **kwargs):
    texts = [completion[0]["content"] for completion in completions]  # conversational completions
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in texts]


def image_dataset() -> Dataset:
    """Four prompts, with one, two, one and two images of different sizes (several images a row)."""
    images = [[Image.new("RGB", SIZES[i], COLOURS[i])] for i in range(4)]
    for i in (1, 3):
        images[i].append(Image.new("RGB", SIZES[(i + 1) % 4], COLOURS[(i + 2) % 4]))
    prompts = [
        [{"role": "user", "content": [{"type": "image"}] * len(row) + [{"type": "text", "text": "What colour?"}]}]
        for row in images
    ]
    return Dataset.from_dict({"prompt": prompts, "images": images})


def train(trainer_class, config_class, family: str, tmp_path, **overrides):
    model, processor = build_tiny_vlm_and_processor(0, family)
    settings = dict(max_steps=2, per_device_train_batch_size=8, num_generations=4, num_iterations=2, beta=0.0)
    settings.update(overrides)
    config = config_class(**cpu_config_kwargs(str(tmp_path), **settings))
    trainer = trainer_class(
        model, digit_reward, args=config, train_dataset=image_dataset(), processing_class=processor
    )
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_vision_language_grpo_has_trl_s_losses(family, tmp_path):
    """Same seed, same model: ExtGRPOTrainer(dapo) logs GRPOTrainer's losses and rewards, step by step; IPO's first,
    on-policy pass (ratio 1) gives the same loss too."""
    reference = train(GRPOTrainer, GRPOConfig, family, tmp_path / "trl", loss_type="dapo")
    ours = train(ExtGRPOTrainer, ExtGRPOConfig, family, tmp_path / "ext", loss_type="dapo")
    assert len(ours) == len(reference) == 2
    for mine, theirs in zip(ours, reference):  # step 2 reuses step 1's batch (num_iterations=2): no reward logged
        for key in ("loss", "reward", "entropy", "clip_ratio/region_mean"):
            assert (key in mine) == (key in theirs)
            if key in theirs:
                assert mine[key] == pytest.approx(theirs[key], abs=1e-6), key
    assert any(abs(entry["loss"]) > 1e-4 for entry in reference)  # a loss that says something
    ipo = train(ExtGRPOTrainer, ExtGRPOConfig, family, tmp_path / "ipo", loss_type="ipo")
    assert ipo[0]["loss"] == pytest.approx(reference[0]["loss"], abs=1e-6)
    assert all("ipo/masked_ratio" in entry and torch.isfinite(torch.tensor(entry["loss"])) for entry in ipo)


class DropLastRow(ExtGRPOTrainer):
    """A row-changing hook that drops each batch's last row, indexing every value by row (image fields included):
    the batch must then be padded back to a multiple of ``steps_per_generation``."""

    def process_scored_batch(self, batch, inputs):
        keep = len(batch["prompt_ids"]) - 1
        return {key: value if _unrowed(value) else value[:keep] for key, value in batch.items()}


def _unrowed(value) -> bool:
    return value is None or (isinstance(value, torch.Tensor) and value.dim() == 0)


def test_padding_rows_of_an_image_batch_is_exact(tmp_path):
    """8 rows with 1 or 2 images each, the hook keeps 7, two micro-batches: one padding row, a copy of row 0 with
    its images and no loss. The loss of the padded batch equals the loss of the 7 rows."""
    model, processor = build_tiny_vlm_and_processor(0, "qwen2_vl")
    config = ExtGRPOConfig(
        **cpu_config_kwargs(str(tmp_path), per_device_train_batch_size=4, steps_per_generation=2, beta=0.0)
    )
    trainer = DropLastRow(model, digit_reward, args=config, train_dataset=image_dataset(), processing_class=processor)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); the losses below are compared as they are
    rows = [row for row in image_dataset() for _ in range(4)][:8]  # two prompts × 4 generations
    batch = trainer._generate_and_score_completions(rows)
    assert batch["is_padding_row"].tolist() == [False] * 7 + [True]
    split = split_pixel_values_by_grid(batch)  # what TRL does before shuffling: must still match row by row
    assert len(split["pixel_values"]) == len(split["image_grid_thw"]) == len(split["num_images"]) == 8
    assert torch.equal(split["pixel_values"][7], split["pixel_values"][0])
    assert torch.equal(split["image_grid_thw"][7], split["image_grid_thw"][0])
    assert split["num_images"][7] == split["num_images"][0]
    assert batch["completion_mask"][7].sum() == 0 and batch["advantages"][7].abs().sum() == 0
    assert set(split["num_images"]) == {1, 2}

    kept = unsplit_pixel_values_by_grid({key: v if _unrowed(v) else v[:7] for key, v in split.items()})
    with torch.no_grad():
        padded_loss = trainer.compute_loss(trainer.model, batch)
        kept_loss = trainer.compute_loss(trainer.model, kept)
    assert float(padded_loss) == pytest.approx(float(kept_loss), rel=1e-5, abs=1e-7)


# Image layouts TRL builds for other families (`split_pixel_values_by_grid`), as TRL's scored batch holds them.
LAYOUTS = {
    # Qwen-VL: pixel_values flat over every patch of every image, image_grid_thw one row per image
    "grid (Qwen2-VL, Qwen2.5-VL)": lambda images: {
        "pixel_values": torch.randn(sum(4 * n for n in images), 12),
        "image_grid_thw": torch.tensor([[1, 2, 2]] * sum(images)),
    },
    # LLaVA-NeXT style: one pixel_values row per image, image_sizes one row per image
    "flat per image + image_sizes (LLaVA)": lambda images: {
        "pixel_values": torch.randn(sum(images), 3, 8, 8),
        "image_sizes": torch.tensor([[8, 8]] * sum(images)),
    },
    # Idefics / SmolVLM style: already one padded row per sample
    "per sample (Idefics, SmolVLM)": lambda images: {
        "pixel_values": torch.randn(len(images), max(images), 3, 8, 8),
        "pixel_attention_mask": torch.ones(len(images), max(images), 8, 8, dtype=torch.bool),
    },
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_image_layout_goes_through_the_hook_and_the_padding(layout, tmp_path):
    """A text-only trainer given TRL's scored-batch layout of each family: the hook drops a row, the padding adds a
    copy of row 0, and TRL's own split of the result still gives every row its own images."""
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    config = ExtGRPOConfig(**cpu_config_kwargs(str(tmp_path), per_device_train_batch_size=4, steps_per_generation=2))
    trainer = DropLastRow(
        model,
        lambda completions, **kw: [0.0] * len(completions),
        args=config,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": ["x"] * 8}),
    )
    trainer.model.train()
    images = [1, 2, 1, 3, 2, 1, 1, 2]
    batch = {
        "prompt_ids": torch.arange(8).unsqueeze(1).repeat(1, 3),
        "prompt_mask": torch.ones(8, 3, dtype=torch.long),
        "completion_ids": torch.ones(8, 4, dtype=torch.long),
        "completion_mask": torch.ones(8, 4, dtype=torch.long),
        "advantages": torch.linspace(-1, 1, 8),
        "num_items_in_batch": torch.tensor(32),
        **LAYOUTS[layout](images),
        "num_images": images,
    }
    original = split_pixel_values_by_grid(batch)
    scope = BatchScope(inputs=[{}] * 8, rewards_per_func=torch.zeros(8, 1))
    out = trainer._run_scored_batch_hook(dict(batch), scope)
    assert out["is_padding_row"].tolist() == [False] * 7 + [True]
    assert out["num_images"] == images[:7] + images[:1]
    split = split_pixel_values_by_grid(out)
    for key in ("pixel_values", "image_grid_thw", "image_sizes", "pixel_attention_mask"):
        if key not in batch:
            continue
        assert type(out[key]) is torch.Tensor  # joined back, as TRL keeps them
        for row in range(7):
            assert torch.equal(split[key][row], original[key][row])
        assert torch.equal(split[key][7], original[key][0])
