"""What benchmarks/gpu.py trains: the model shapes and sizes, the arms and their ratios, the scripted workloads
(completions, judge, RLM trees) and the trainer of each arm. How it is measured lives in gpu.py."""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from random import Random

import torch

# Qwen3-0.6B's shape (hidden 1024, 28 layers, 16 query / 8 key-value heads of 128, vocabulary 151,936, tied).
QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)
TINY_QWEN3 = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=16384,
    tie_word_embeddings=True,
)


@dataclass(frozen=True)
class Sizes:
    """The sizes of a run: `FULL` (a GPU) or `SMOKE` (any device, seconds)."""

    model: dict  # Qwen3Config fields
    prompt_tokens: int  # GRPO: the prompt the G completions share
    completion_tokens: int  # GRPO: each completion
    group: int  # GRPO: G
    action_pad_words: int  # stepwise: words of comment added to each code action of the scripted trees
    roots_per_micro_batch: int  # stepwise: 4 micro-batches a step
    system_prompt: str | None  # stepwise: the RLM system prompt (None: the built-in one)
    warmup_steps: int
    timed_steps: int


FULL = Sizes(
    model=QWEN3_0_6B,
    prompt_tokens=2048,
    completion_tokens=256,
    group=8,
    action_pad_words=96,
    roots_per_micro_batch=4,
    system_prompt=None,
    warmup_steps=2,
    timed_steps=4,
)
SMOKE = Sizes(
    model=TINY_QWEN3,
    prompt_tokens=48,
    completion_tokens=12,
    group=4,
    action_pad_words=3,
    roots_per_micro_batch=1,
    system_prompt="Write code. The context is {context_description}.{recursion_note} At most {max_children} children.",
    warmup_steps=1,
    timed_steps=1,
)


@dataclass(frozen=True)
class Arm:
    name: str
    workload: str  # "grpo" | "stepwise"
    trainer: str  # "trl" | "ext" | "judge" | "stepwise" | "flat"
    attention: str = "sdpa"
    packed: bool = False
    lora: bool = False

    @property
    def loss(self) -> str:
        return "dapo" if self.trainer == "trl" else "ipo"


ARMS = [  # in order of importance: a run cut short by --budget-s loses the last ones
    Arm("grpo TRL dapo", "grpo", "trl"),
    Arm("grpo Ext ipo", "grpo", "ext"),
    Arm("grpo Ext ipo packed", "grpo", "ext", packed=True),
    Arm("grpo JudgeCredit ipo packed", "grpo", "judge", packed=True),
    Arm("stepwise packed", "stepwise", "stepwise", packed=True),
    Arm("stepwise rows", "stepwise", "stepwise"),
    Arm("stepwise flat", "stepwise", "flat"),
    Arm("stepwise packed LoRA", "stepwise", "stepwise", packed=True, lora=True),
    Arm("stepwise rows LoRA", "stepwise", "stepwise", lora=True),
    Arm("stepwise flat LoRA", "stepwise", "flat", lora=True),
    Arm("grpo TRL dapo flex", "grpo", "trl", attention="flex_attention"),
    Arm("grpo Ext ipo flex", "grpo", "ext", attention="flex_attention"),
    Arm("grpo Ext ipo packed flex", "grpo", "ext", attention="flex_attention", packed=True),
    Arm("stepwise packed flex", "stepwise", "stepwise", attention="flex_attention", packed=True),
    Arm("stepwise rows flex", "stepwise", "stepwise", attention="flex_attention"),
]
# (what the ratio says, numerator arm, denominator arm): training-time ratios
RATIOS = [
    ("Ext ipo / TRL dapo, SDPA rows", "grpo Ext ipo", "grpo TRL dapo"),
    ("Ext ipo / TRL dapo, flex rows", "grpo Ext ipo flex", "grpo TRL dapo flex"),
    ("GRPO packed / rows, SDPA", "grpo Ext ipo packed", "grpo Ext ipo"),
    ("GRPO packed / rows, flex", "grpo Ext ipo packed flex", "grpo Ext ipo flex"),
    ("JudgeCredit / Ext, packed SDPA", "grpo JudgeCredit ipo packed", "grpo Ext ipo packed"),
    ("stepwise packed / flat", "stepwise packed", "stepwise flat"),
    ("stepwise rows / flat", "stepwise rows", "stepwise flat"),
    ("stepwise packed / rows", "stepwise packed", "stepwise rows"),
    ("stepwise packed / flat, LoRA", "stepwise packed LoRA", "stepwise flat LoRA"),
    ("stepwise rows / flat, LoRA", "stepwise rows LoRA", "stepwise flat LoRA"),
    ("stepwise packed / rows, flex", "stepwise packed flex", "stepwise rows flex"),
    ("stepwise packed LoRA / full", "stepwise packed LoRA", "stepwise packed"),
]


# ----------------------------------------------------------------------------------------------------------------
# Workloads: scripted completions, rewards, judge
# ----------------------------------------------------------------------------------------------------------------
def scripted_rollout(sizes: Sizes, vocab: int):
    """A TRL ``rollout_func``: each prompt gets ``sizes.prompt_tokens`` random ids (the same for the G copies of
    one prompt, so they share it) and a completion of ``sizes.completion_tokens`` random ids, none special."""

    def rollout(prompts: list, trainer) -> dict:
        step = trainer.state.global_step
        prompt_ids, completion_ids = [], []
        for index, prompt in enumerate(prompts):
            seed = zlib.crc32(str(prompt).encode())
            prompt_ids.append([Random(seed).randrange(3, vocab) for _ in range(sizes.prompt_tokens)])
            draw = Random(seed * 1_000_003 + step * 1_009 + index)
            completion_ids.append([draw.randrange(3, vocab) for _ in range(sizes.completion_tokens)])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout


def spread_reward(completion_ids, **kwargs) -> list[float]:
    """A deterministic reward that differs between the completions of a group (non-zero advantages)."""
    return [(sum(ids) % 97) / 96 for ids in completion_ids]


def every_segment_judge(request: dict) -> str:
    """Scripted span judge: a span on every marked segment of the trace (the text from one marker to the next,
    quoted), labels in turn, so every rollout gets credit."""
    from trl_ext.quickstart.copy_task import ScriptedSpanJudge

    marked = ScriptedSpanJudge.blocks(request).get("TRACE", "")
    user = "\n".join(str(m.get("content") or "") for m in request["messages"] if m.get("role") == "user")
    total = int(re.search(r"The trace has (\d+) tokens", user).group(1))
    segments = ScriptedSpanJudge.marked_segments(marked)
    ends = [start for start, _ in segments[1:]] + [total]
    labels = ["key_progress", "original_error", "dependent_error"]
    spans = [
        {"start": start, "end": end, "label": labels[i % 3], "confidence": 1.0, "quote": body.strip()}
        for i, ((start, body), end) in enumerate(zip(segments, ends))
        if body.strip()
    ]
    return json.dumps({"spans": spans})


def padded_generator(tokenizer, pad_words: int):
    """`trl_ext.testing.VariantGenerator`'s scripted trees, each code action lengthened by a comment line."""
    from trl_ext.testing import VariantGenerator

    words = "read the context then split it and ask a child for each part".split()
    comment = "# " + " ".join(words[i % len(words)] for i in range(pad_words)) + "\n"

    class Padded(VariantGenerator):
        def _respond(self, prompt: str) -> str:
            action = super()._respond(prompt)
            return action.replace("```repl\n", "```repl\n" + comment, 1)

    return Padded(tokenizer)


def build_model(sizes: Sizes, attention: str, device: str, dtype: torch.dtype, seed: int = 0):
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from trl_ext.testing import EOS_TOKEN_ID, PAD_TOKEN_ID

    config = Qwen3Config(
        **sizes.model,
        pad_token_id=PAD_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        bos_token_id=None,
        attn_implementation=attention,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID)
    return model


def make_trainer(
    arm: Arm, sizes: Sizes, model, tokenizer, output_dir: str, device: str, judge_url: str, *, mixins=(), callbacks=()
):
    """The arm's trainer of ``model``: its trainer class with ``mixins`` put before it, and ``callbacks``."""
    from datasets import Dataset
    from peft import LoraConfig
    from stepwise import FlatRows
    from trl import GRPOConfig, GRPOTrainer

    from trl_ext import ExtGRPOConfig, ExtGRPOTrainer
    from trl_ext.trainers import JudgeCreditConfig, JudgeCreditTrainer
    from trl_ext.trainers.stepwise_rlm import StepwiseRLMConfig, StepwiseRLMTrainer

    cpu = device == "cpu"
    steps = sizes.warmup_steps + sizes.timed_steps
    common = dict(
        output_dir=output_dir,
        use_cpu=cpu,
        bf16=not cpu,
        report_to="none",
        max_steps=steps,
        learning_rate=1e-6,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    if arm.trainer != "trl":
        common["prefix_sharing"] = "on" if arm.packed else "off"
    peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear") if arm.lora else None
    if arm.workload == "grpo":
        grpo = dict(
            common,
            loss_type=arm.loss,
            per_device_train_batch_size=sizes.group,
            num_generations=sizes.group,
            max_completion_length=sizes.completion_tokens,
        )
        dataset = Dataset.from_dict({"prompt": [f"prompt {i}" for i in range(steps)]})
        trainer_cls, config_cls = {
            "trl": (GRPOTrainer, GRPOConfig),
            "ext": (ExtGRPOTrainer, ExtGRPOConfig),
            "judge": (JudgeCreditTrainer, JudgeCreditConfig),
        }[arm.trainer]
        if arm.trainer == "judge":
            grpo.update(
                judge_base_url=judge_url,
                judge_model="scripted-judge",
                judge_tools=[],
                judge_max_tool_rounds=0,
                judge_max_retries=0,
                judge_lambda=0.25,
                marker_every=16,
            )
        timed = type("Timed", (*mixins, trainer_cls), {})
        return timed(
            model,
            spread_reward,
            args=config_cls(**grpo),
            train_dataset=dataset,
            processing_class=tokenizer,
            rollout_func=scripted_rollout(sizes, len(tokenizer)),
            peft_config=peft,
            callbacks=list(callbacks),
        )
    from trl_ext.testing import yes_reward

    config = StepwiseRLMConfig(
        **common,
        per_device_train_batch_size=sizes.roots_per_micro_batch,
        steps_per_generation=4,
        gradient_accumulation_steps=4,
        num_generations=4,
        max_depth=2,
        max_turns=4,
        save_rollout_trees=False,
        rlm_loss_normalization="token",
        rlm_system_prompt=sizes.system_prompt,
    )
    dataset = Dataset.from_dict({"prompt": ["root task", "small task"] * 8, "context": ["abcdefgh"] * 16})
    bases = (FlatRows, StepwiseRLMTrainer) if arm.trainer == "flat" else (StepwiseRLMTrainer,)
    timed = type("Timed", (*mixins, *bases), {})
    return timed(
        model,
        yes_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        generator=padded_generator(tokenizer, sizes.action_pad_words),
        peft_config=peft,
        callbacks=list(callbacks),
    )
