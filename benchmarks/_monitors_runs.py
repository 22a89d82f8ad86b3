"""The monitors' evaluation (`monitors_eval.py`): one run of each workload, healthy or with a pathology injected
(`_monitors_workloads`), and the cold starts they share."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

from _monitors_workloads import (
    HEALTHY,
    Pathology,
    judge_script,
    onset_for,
    outcome_reward,
    result_of,
    sick_reward,
    surviving,
)

from trl_ext.callbacks import default_monitors
from trl_ext.quickstart.copy_task import copy_digit_accuracy_reward, copy_task_splits
from trl_ext.quickstart.judge_credit import (
    JUDGE_MODEL,
    JudgeCreditSettings,
    build_policy,
    scripted_judge_kwargs,
    sft_copy_policy,
    train_rl,
)
from trl_ext.quickstart.scripted_server import ScriptedChatServer
from trl_ext.quickstart.training import fresh_copy, quiet_progress

KL_BETA = 0.04  # judge credit: a KL term, so that kl_spike has a metric
ASYNC_MAX_STALENESS = 1


# ----------------------------------------------------------------------------------------------------------------
# Judge credit
# ----------------------------------------------------------------------------------------------------------------
def run(
    js: JudgeCreditSettings,
    sft: tuple[Any, Any, Any],
    steps: int,
    onset_step: int,
    pathology: Pathology | None,
    logs_dir: str | None = None,
) -> dict[str, Any]:
    """One judge-credit RL run from the seed's SFT policy (``pathology`` None: healthy); its record (`result_of`)."""
    model, tokenizer, rl_set = sft
    sick = pathology or HEALTHY
    onset = onset_for(sick, onset_step)
    monitors = default_monitors(action="warn", stop_on_collapse=False)
    overrides = {"max_steps": steps, "beta": KL_BETA, **sick.config}
    if sick.learning_rate_x != 1.0:
        overrides["learning_rate"] = js.rl_learning_rate * sick.learning_rate_x
    judge_lambda = js.judge_lambda if sick.judge_lambda is None else sick.judge_lambda
    started = time.perf_counter()
    with (
        tempfile.TemporaryDirectory() as output,
        ScriptedChatServer(judge_script(js, sick, onset), model=JUDGE_MODEL) as server,
    ):
        with surviving(onset):
            train_rl(
                fresh_copy(model),
                tokenizer,
                rl_set,
                js,
                judge_lambda,
                Path(output),
                server.base_url,
                monitors=[*monitors, onset],
                reward_funcs=[outcome_reward(onset, sick.reward), copy_digit_accuracy_reward],
                config_overrides=overrides,
            )
    return result_of("judge-credit", js.seed, sick, onset, monitors, started, logs_dir)


def sft_policy(seed: int, cache_dir: str | None) -> tuple[JudgeCreditSettings, tuple[Any, Any, Any]]:
    """The seed's settings and its policy after the miniature's cold-start SFT (saved in and read from
    ``cache_dir/seed<seed>`` when given), its tokenizer and its RL prompts."""
    from transformers import AutoModelForCausalLM

    js = JudgeCreditSettings.default(seed)
    cached = Path(cache_dir) / f"seed{seed}" if cache_dir else None
    sft_rows, rl_set, _ = copy_task_splits(
        js.seed, js.num_sft_examples, js.num_rl_examples, js.num_eval_examples, js.digits
    )
    model, tokenizer = build_policy(js)
    if cached is not None and (cached / "config.json").exists():
        return js, (AutoModelForCausalLM.from_pretrained(cached).eval(), tokenizer, rl_set)
    with tempfile.TemporaryDirectory() as folder:
        model = sft_copy_policy(model, tokenizer, sft_rows, js, Path(folder), progress=False)
    if cached is not None:
        model.save_pretrained(cached)
    return js, (model, tokenizer, rl_set)


# ----------------------------------------------------------------------------------------------------------------
# Async judge credit
# ----------------------------------------------------------------------------------------------------------------
def async_config(js: JudgeCreditSettings, output: Path, base_url: str, steps: int, sick: Pathology) -> Any:
    """`AsyncJudgeCreditConfig` of the async workload: the judge-credit miniature's batch, learning rate, LoRA and
    judge, each sample trained once, ``max_staleness`` `ASYNC_MAX_STALENESS`, one group per worker run."""
    from trl_ext.quickstart.settings import cpu_run_kwargs
    from trl_ext.trainers import AsyncJudgeCreditConfig

    kwargs = dict(
        **cpu_run_kwargs(output, js.seed, progress=False),
        dtype="float32",
        gradient_checkpointing=False,
        max_steps=steps,
        learning_rate=js.rl_learning_rate * sick.learning_rate_x,
        lr_scheduler_type="constant",
        per_device_train_batch_size=js.prompts_per_step * js.num_generations,
        token_budget=0,  # a fixed count of samples per optimizer step
        num_generations=js.num_generations,
        max_inflight_tasks=js.num_generations,  # one group per worker run
        max_staleness=ASYNC_MAX_STALENESS,
        queue_maxsize=0,  # unbounded: the worker's staleness gate bounds how far ahead it samples
        max_completion_length=js.digits + 2,
        temperature=js.temperature,
        **scripted_judge_kwargs(js, base_url, js.judge_lambda if sick.judge_lambda is None else sick.judge_lambda),
        heartbeat_stale_after_s=600.0,
    )
    return AsyncJudgeCreditConfig(**{**kwargs, **sick.config})


def as_chat(rows: Any) -> Any:
    """The copy task's SFT rows as one user and one assistant message each: the asynchronous rollout worker applies
    the chat template to every prompt, so its policy is cold-started on the same template."""
    return rows.map(
        lambda row: {
            "prompt": [{"role": "user", "content": row["prompt"]}],
            "completion": [{"role": "assistant", "content": row["completion"]}],
        }
    )


def async_sft_policy(seed: int, folder: Path) -> tuple[JudgeCreditSettings, tuple[Any, Any, Any], Path]:
    """The seed's judge-credit settings, its policy after the miniature's cold-start SFT on the chat-form rows
    (`as_chat`), its tokenizer and RL prompts, and the folder it is saved in (the asynchronous trainer and
    `LocalPolicy` load it from a path; reused when ``folder`` holds it)."""
    from transformers import AutoModelForCausalLM

    js = JudgeCreditSettings.default(seed)
    sft_rows, rl_set, _ = copy_task_splits(
        js.seed, js.num_sft_examples, js.num_rl_examples, js.num_eval_examples, js.digits
    )
    model, tokenizer = build_policy(js)
    if (folder / "config.json").exists():
        return js, (AutoModelForCausalLM.from_pretrained(folder).eval(), tokenizer, rl_set), folder
    with tempfile.TemporaryDirectory() as scratch:
        model = sft_copy_policy(model, tokenizer, as_chat(sft_rows), js, Path(scratch), progress=False)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return js, (model, tokenizer, rl_set), folder


def run_async(
    js: JudgeCreditSettings,
    sft: tuple[Any, Any, Any],
    sft_dir: Path,
    steps: int,
    onset_step: int,
    pathology: Pathology | None,
    logs_dir: str | None = None,
) -> dict[str, Any]:
    """One asynchronous judge-credit run from the seed's SFT policy saved in ``sft_dir`` (``pathology`` None:
    healthy); its record (`result_of`)."""
    from peft import LoraConfig

    from trl_ext.rlm.generators import SamplingSettings
    from trl_ext.trainers import AsyncJudgeCreditTrainer, LocalPolicy

    _, tokenizer, rl_set = sft
    sick = pathology or HEALTHY
    onset = onset_for(sick, onset_step)
    started = time.perf_counter()
    with (
        tempfile.TemporaryDirectory() as output,
        ScriptedChatServer(judge_script(js, sick, onset), model=JUDGE_MODEL) as server,
    ):
        config = async_config(js, Path(output), server.base_url, steps, sick)
        monitors = default_monitors(action="warn", stop_on_collapse=False, args=config)

        class Sampler(LocalPolicy):
            """The in-process sampler; every call ``slow_generation_s`` longer once the pathology is on."""

            def generate(self, prompts):
                if onset.on and sick.slow_generation_s:
                    time.sleep(sick.slow_generation_s)
                return super().generate(prompts)

        policy = Sampler(str(sft_dir), tokenizer, settings=SamplingSettings.from_trl(config))
        trainer = AsyncJudgeCreditTrainer(
            str(sft_dir),
            [outcome_reward(onset, sick.reward)],  # no reward_weights here: per-digit accuracy is not logged
            args=config,
            train_dataset=rl_set,
            processing_class=tokenizer,
            generator=policy,
            weight_transfer=policy,
            peft_config=LoraConfig(
                r=js.lora_r, lora_alpha=js.lora_alpha, lora_dropout=0.0, target_modules="all-linear"
            ),
            callbacks=[*monitors, onset],
        )
        if sick.ungated:  # the worker samples as far ahead as its (unbounded) queue allows
            onset.hooks.append(lambda: setattr(trainer.rollout_worker.staleness, "max_staleness", None))
        quiet_progress(trainer)
        with surviving(onset):
            trainer.train()
    return result_of("async", js.seed, sick, onset, monitors, started, logs_dir)


# ----------------------------------------------------------------------------------------------------------------
# Stepwise RLM (the default quickstart)
# ----------------------------------------------------------------------------------------------------------------
def stepwise_start(seed: int, folder: Path) -> tuple[Any, Any]:
    """The quickstart's default settings for ``seed`` and its cold start in ``folder`` (data, scripted teacher,
    cold-start SFT; the SFT-only evaluation cut to one task, which RL does not use). Reused when ``folder`` already
    holds the SFT model."""
    from transformers import AutoModelForCausalLM

    from trl_ext.quickstart import QuickstartSettings
    from trl_ext.quickstart.stepwise import SFT_MODEL_DIR, ColdStart, cold_start
    from trl_ext.quickstart.toy_task import make_toy_dataset
    from trl_ext.sft import split_cold_start
    from trl_ext.testing import build_tiny_tokenizer

    settings = QuickstartSettings.default(seed)
    sft_dir = folder / SFT_MODEL_DIR
    if (sft_dir / "config.json").exists():
        dataset = make_toy_dataset(settings.num_sft_examples + settings.num_rl_examples, seed=seed)
        _, rl_split = split_cold_start(dataset, n=settings.num_sft_examples, seed=seed)
        model = AutoModelForCausalLM.from_pretrained(sft_dir).eval()
        model.config._name_or_path = str(sft_dir)
        # Built again in code, not loaded: from a Qwen2 model's folder transformers loads a Qwen2Tokenizer, which
        # splits digits apart and gives other ids than the tokenizer the policy was trained with (every reward 0).
        tokenizer = build_tiny_tokenizer()
        return settings, ColdStart(model, tokenizer, sft_dir, rl_split, None, None, 0, 0)
    folder.mkdir(parents=True, exist_ok=True)
    brief = dataclasses.replace(settings, num_eval_examples=1, eval_samples=1)
    return settings, cold_start(folder, brief, progress=False, say=lambda line: None)


def run_stepwise(
    settings: Any,
    start: Any,
    steps: int,
    onset_step: int,
    pathology: Pathology | None,
    logs_dir: str | None = None,
) -> dict[str, Any]:
    """One `StepwiseRLMTrainer` run of the quickstart's RL stage from ``start``'s SFT policy, stopped after ``steps``
    of its ``rl_steps`` (``pathology`` None: healthy); its record (`result_of`)."""
    from peft import LoraConfig

    from trl_ext.quickstart.settings import toy_rl_config_kwargs
    from trl_ext.quickstart.toy_task import parts_reward
    from trl_ext.trainers import StepwiseRLMConfig, StepwiseRLMTrainer

    sick = pathology or HEALTHY
    onset = onset_for(sick, onset_step, stop_after=steps)
    monitors = default_monitors(action="warn", stop_on_collapse=False)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as output:
        kwargs = toy_rl_config_kwargs(settings, Path(output), progress=False)
        kwargs["max_steps"] = max(steps, settings.rl_steps)
        kwargs["learning_rate"] = settings.rl_learning_rate * sick.learning_rate_x
        trainer = StepwiseRLMTrainer(
            fresh_copy(start.model),
            sick_reward(parts_reward, onset, sick.reward),
            args=StepwiseRLMConfig(**{**kwargs, **sick.config}),
            train_dataset=start.rl_split,
            processing_class=start.tokenizer,
            peft_config=LoraConfig(
                r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=0.0, target_modules="all-linear"
            ),
            callbacks=[*monitors, onset],
        )
        quiet_progress(trainer)
        with surviving(onset):
            trainer.train()
    return result_of("stepwise", settings.seed, sick, onset, monitors, started, logs_dir)


# ----------------------------------------------------------------------------------------------------------------
# RLMT
# ----------------------------------------------------------------------------------------------------------------
def run_rlmt(
    seed: int, steps: int, onset_step: int, pathology: Pathology | None, logs_dir: str | None = None
) -> dict[str, Any]:
    """One run of the RLMT miniature (its policy, reward model, prompts and settings, ``steps`` steps, a KL term of
    β = `KL_BETA`) with ``seed`` (``pathology`` None: healthy); its record (`result_of`)."""
    from datasets import Dataset

    from trl_ext.quickstart import QuickstartSettings
    from trl_ext.quickstart.settings import miniature_run_kwargs
    from trl_ext.quickstart.training import train_miniature
    from trl_ext.rewards import RewardModelScorer
    from trl_ext.testing import build_tiny_model_and_tokenizer, build_tiny_reward_model
    from trl_ext.trainers import RLMTConfig, RLMTTrainer

    sick = pathology or HEALTHY
    onset = onset_for(sick, onset_step)
    settings = QuickstartSettings.default(seed)
    policy, tokenizer = build_tiny_model_and_tokenizer(seed, initializer_range=0.5)
    reward_model, rm_tokenizer = build_tiny_reward_model(seed + 1, initializer_range=0.5)
    scorer = RewardModelScorer(reward_model, rm_tokenizer, format="instruct", strict=False)
    prompts = ["Say hello.", "Name a colour.", "Count to five.", "What is 2 + 3?", "Say yes or no.", "Greet me."]
    dataset = Dataset.from_dict({"prompt": [prompts[i % len(prompts)] for i in range(48)]})
    monitors = default_monitors(action="warn", stop_on_collapse=False)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as output:
        kwargs = miniature_run_kwargs(Path(output), settings, fast=False, progress=False)
        kwargs |= {"max_steps": steps, "learning_rate": kwargs["learning_rate"] * sick.learning_rate_x}
        # β = KL_BETA, not the miniature's 0.001: unanchored, its KL drifts past 1 nat/token within 24 steps (0.5 ->
        # 1.8 on seed 0), where the miniature's own 8 steps end near 0.8
        fields = {"max_completion_length": 24, "loss_type": "ipo", "strict_format": False, "beta": KL_BETA}
        config = RLMTConfig(**{**kwargs, **fields, **sick.config})
        reward = sick_reward(scorer, onset, sick.reward, name="reward_model")
        with surviving(onset):
            train_miniature(RLMTTrainer, policy, reward, config, dataset, tokenizer, [*monitors, onset])
    return result_of("rlmt", seed, sick, onset, monitors, started, logs_dir)
