"""The stepwise-RLM quickstart (``--method stepwise-rlm``, the default): the whole pipeline in miniature on the
built-in toy task (`trl_ext.quickstart.toy_task`: look one key up in a few ``key=value`` pairs held in the REPL's
``context``; reward = exact match). The run, in order:

1. **Data.** A seeded dataset; `split_cold_start` holds out a few dozen examples for SFT, the rest is the RL set; a
   separate seeded set (disjoint contexts) is the held-out evaluation set.
2. **Teacher traces.** A scripted teacher behind a local OpenAI-compatible server (`ScriptedChatServer` on
   127.0.0.1) plays the policy in the real scaffold (`trl_ext.sft.generate_teacher_traces`: sandboxed REPL, the
   prompts rebuilt every turn); `filter_traces` keeps the exact-match traces; `traces_to_sft_rows` makes one SFT row
   per turn.
3. **Cold-start SFT** of a tiny Qwen2-architecture model (built offline, `trl_ext.testing`) with TRL's
   `SFTTrainer`: after it the policy writes the scaffold's format but is often wrong.
4. **Held-out evaluation** of the SFT-only policy (RLM rollouts sampled at the RL temperature).
5. **RL** with `StepwiseRLMTrainer`: every turn a training row, the IPO loss, a LoRA adapter, `default_monitors()`.
6. **Held-out evaluation** of the RL policy (same tasks, same seed), then the adapter, the metrics plot
   (`plot_run`), the rollout trees and ``trl_ext_run.json`` are in the output directory.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .evaluation import evaluate_policy, held_out_eval_set
from .report import QuickstartResult, result_from_history
from .settings import QuickstartSettings, toy_rl_config_kwargs, toy_scaffold_config
from .training import quiet_progress, save_adapter_and_state, save_plot

SFT_MODEL_DIR = "sft_model"


def run_stepwise(
    output: Path, settings: QuickstartSettings, fast: bool, progress: bool, say: Callable[[str], None]
) -> QuickstartResult:
    """Steps 1–6 of the module docstring in ``output``; ``say`` gets one line per step."""
    from peft import LoraConfig

    from trl_ext.callbacks import default_monitors
    from trl_ext.judge import AsyncChatClient
    from trl_ext.recipes import config_summary
    from trl_ext.sft import filter_traces, generate_teacher_traces, split_cold_start, traces_to_sft_rows
    from trl_ext.testing import build_tiny_model_and_tokenizer
    from trl_ext.trainers import StepwiseRLMConfig, StepwiseRLMTrainer

    from .scripted_server import ScriptedChatServer
    from .toy_task import ToyTeacher, exact_match_reward, make_toy_dataset

    times: dict[str, float] = {}
    seed = settings.seed
    scaffold = toy_scaffold_config(settings)

    # 1. data ---------------------------------------------------------------------------------------------------
    tick = time.perf_counter()
    dataset = make_toy_dataset(settings.num_sft_examples + settings.num_rl_examples, seed=seed)
    sft_split, rl_split = split_cold_start(dataset, n=settings.num_sft_examples, seed=seed)
    eval_set = held_out_eval_set(settings.num_eval_examples, seed, exclude=dataset["context"])
    say(
        f"[1/6] toy task: {len(sft_split)} examples held out for cold-start SFT, {len(rl_split)} for RL, "
        f"{len(eval_set)} held-out evaluation tasks x {settings.eval_samples} samples"
    )

    # 2. teacher traces -----------------------------------------------------------------------------------------
    teacher = ToyTeacher(settings.compute_fraction, settings.shortcut_fraction, seed=seed)
    with ScriptedChatServer(teacher, model="toy-teacher") as server:
        client = AsyncChatClient(server.base_url, "toy-teacher", api_key_env=None, max_retries=0, timeout=30.0)
        traces = generate_teacher_traces(sft_split, client, scaffold_config=scaffold)
    kept, report = filter_traces(traces, reward_fn=exact_match_reward)
    with (output / "teacher_traces.jsonl").open("w", encoding="utf-8") as handle:
        for trace in traces:
            handle.write(json.dumps(trace.to_dict(), default=str) + "\n")
    sft_rows = traces_to_sft_rows(kept, num_rl_examples=len(rl_split))
    sft_rows = sft_rows.remove_columns([c for c in sft_rows.column_names if c not in ("prompt", "completion")])
    dropped = ", ".join(f"{n} {reason}" for reason, n in report.dropped.items() if n) or "none"
    say(
        f"[2/6] scripted teacher (OpenAI-compatible server on 127.0.0.1): {len(traces)} traces, {report.kept} kept "
        f"(dropped: {dropped}) -> {len(sft_rows)} SFT rows (one per turn)"
    )
    times["data_and_teacher"] = time.perf_counter() - tick

    # 3. cold-start SFT -----------------------------------------------------------------------------------------
    tick = time.perf_counter()
    model, tokenizer = build_tiny_model_and_tokenizer(
        seed,
        hidden_size=settings.hidden_size,
        intermediate_size=2 * settings.hidden_size,
        num_hidden_layers=settings.num_hidden_layers,
    )
    num_parameters = sum(p.numel() for p in model.parameters())
    say(
        f"[3/6] cold-start SFT of a tiny Qwen2 model ({num_parameters / 1e3:.0f}k parameters, "
        f"{settings.sft_epochs:g} epochs, TRL SFTTrainer)"
    )
    sft_dir = output / SFT_MODEL_DIR
    model = _cold_start_sft(model, tokenizer, sft_rows, settings, output / "sft", progress)
    model.save_pretrained(sft_dir)
    tokenizer.save_pretrained(sft_dir)
    model.config._name_or_path = str(sft_dir)  # the adapter's base model: the SFT model saved here
    times["sft"] = time.perf_counter() - tick

    # 4. evaluation of the SFT-only policy ----------------------------------------------------------------------
    tick = time.perf_counter()
    before = evaluate_policy(
        model, tokenizer, eval_set, settings, output / "eval" / "sft_only.jsonl", progress, "eval SFT-only"
    )
    say(
        f"[4/6] held-out reward of the SFT-only policy: {before.reward:.3f} "
        f"(final answer in {100 * before.final_answer_rate:.0f}% of rollouts)"
    )
    times["eval_before"] = time.perf_counter() - tick

    # 5. stepwise RLM RL ----------------------------------------------------------------------------------------
    tick = time.perf_counter()
    say(
        f"[5/6] StepwiseRLMTrainer: {settings.rl_steps} steps, IPO loss, LoRA r={settings.lora_r}, "
        f"{settings.prompts_per_step} tasks x {settings.num_generations} rollouts per generation, default monitors"
    )
    config = StepwiseRLMConfig(**toy_rl_config_kwargs(settings, output, progress))
    monitors = default_monitors()
    trainer = StepwiseRLMTrainer(
        model,
        exact_match_reward,
        args=config,
        train_dataset=rl_split,
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=0.0, target_modules="all-linear"
        ),
        callbacks=monitors,
    )
    quiet_progress(trainer)
    trainer.train()
    adapter_dir = save_adapter_and_state(trainer, output)
    times["rl"] = time.perf_counter() - tick

    # 6. evaluation after RL, plot ------------------------------------------------------------------------------
    tick = time.perf_counter()
    policy = trainer.accelerator.unwrap_model(trainer.model)
    after = evaluate_policy(
        policy, tokenizer, eval_set, settings, output / "eval" / "after_rl.jsonl", progress, "eval after RL"
    )
    plot_file = save_plot(output, say)
    times["eval_after"] = time.perf_counter() - tick
    say(f"[6/6] held-out reward after RL: {after.reward:.3f} (SFT-only: {before.reward:.3f})")

    history = trainer.state.log_history
    result = result_from_history("stepwise-rlm", output, settings, fast, history, monitors, adapter_dir, plot_file)
    result.before, result.after = before, after
    result.stage_times_s = {key: round(value, 1) for key, value in times.items()}
    result.extra = {
        "base_model": str(sft_dir),
        "config": config_summary(config),
        "sft_rows": len(sft_rows),
        "teacher_traces_kept": report.kept,
        "rollout_trees_dir": str(output / "rlm_trees"),
        "task": "toy key lookup (trl_ext.quickstart.toy_task), exact-match reward",
        "eval_samples": settings.eval_samples,
        "sandbox": trainer.sandbox_info,
    }
    return result


def _cold_start_sft(model: Any, tokenizer: Any, rows: Any, settings: QuickstartSettings, folder: Path, progress: bool):
    """Full fine-tuning of ``model`` on the teacher's SFT ``rows`` with TRL's `SFTTrainer`; the trained model in eval
    mode."""
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(folder),
        num_train_epochs=settings.sft_epochs,
        learning_rate=settings.sft_learning_rate,
        lr_scheduler_type="cosine",
        per_device_train_batch_size=settings.sft_batch_size,
        max_length=1024,
        activation_checkpointing=False,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=10,
        seed=settings.seed,
        disable_tqdm=not progress,
    )
    trainer = SFTTrainer(model, train_dataset=rows, processing_class=tokenizer, args=args)
    quiet_progress(trainer)
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.eval()
    return model
