"""The stepwise-RLM quickstart (``--method stepwise-rlm``, the default): the whole pipeline in miniature on the
built-in toy task (`trl_ext.quickstart.toy_task`: look a key up in each of 2–3 parts of the REPL's ``context``, too
long to read in one turn, so that handing the parts to child RLMs pays; reward = share of parts right). The run, in
order:

1. **Data.** A seeded dataset; `split_cold_start` holds out a few dozen examples for SFT, the rest is the RL set; a
   separate seeded set (disjoint contexts) is the held-out evaluation set.
2. **Teacher traces.** A scripted teacher behind a local OpenAI-compatible server (`ScriptedChatServer` on
   127.0.0.1) plays the policy in the real scaffold (`trl_ext.sft.generate_teacher_traces`: sandboxed REPL, the
   prompts rebuilt every turn, children started by its ``rlm_query_batched`` calls); `filter_traces` keeps the traces
   that scored; `traces_to_sft_rows` makes one SFT row per turn of every node, children included.
3. **Cold-start SFT** of a tiny Qwen2-architecture model (built offline, `trl_ext.testing`) with TRL's
   `SFTTrainer`: after it the policy writes the scaffold's format but is often wrong.
4. **Held-out evaluation** of the SFT-only policy (RLM rollouts sampled at the RL temperature).
5. **RL** with `StepwiseRLMTrainer`: every turn of every node a training row, children weighted 1/k_g, the IPO
   loss, a LoRA adapter, `default_monitors()`.
6. **Held-out evaluation** of the RL policy (same tasks, same seed), then the adapter, the metrics plot
   (`plot_run`), the rollout trees and ``trl_ext_run.json`` are in the output directory.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .evaluation import EvalResult, evaluate_policy, held_out_eval_set
from .report import QuickstartResult, result_from_history
from .settings import QuickstartSettings, toy_rl_config_kwargs, toy_scaffold_config
from .training import cold_start_sft, quiet_progress, save_adapter_and_state, save_plot

SFT_MODEL_DIR = "sft_model"


@dataclass
class ColdStart:
    """Steps 1–4 done: the SFT policy, its held-out evaluation and what the RL stage needs (`cold_start`)."""

    model: Any
    tokenizer: Any
    sft_dir: Path
    rl_split: Any
    eval_set: Any
    before: EvalResult
    sft_rows: int
    teacher_traces_kept: int
    times: dict[str, float] = field(default_factory=dict)


def run_stepwise(
    output: Path, settings: QuickstartSettings, fast: bool, progress: bool, say: Callable[[str], None]
) -> QuickstartResult:
    """Steps 1–6 of the module docstring in ``output``; ``say`` gets one line per step."""
    return reinforce(cold_start(output, settings, progress, say), output, settings, fast, progress, say)


def cold_start(output: Path, settings: QuickstartSettings, progress: bool, say: Callable[[str], None]) -> ColdStart:
    """Steps 1–4 in ``output``: data, teacher traces, cold-start SFT, the SFT-only policy's held-out evaluation."""
    from trl_ext.judge import AsyncChatClient
    from trl_ext.sft import filter_traces, generate_teacher_traces, split_cold_start, traces_to_sft_rows
    from trl_ext.testing import build_tiny_model_and_tokenizer

    from .scripted_server import ScriptedChatServer
    from .toy_task import ToyTeacher, make_toy_dataset, parts_reward

    times: dict[str, float] = {}
    seed = settings.seed
    scaffold = toy_scaffold_config(settings)

    # 1. data ---------------------------------------------------------------------------------------------------
    tick = time.perf_counter()
    examples = settings.num_sft_examples + settings.num_rl_examples
    dataset = make_toy_dataset(examples, seed=seed, parts_counts=settings.parts_counts)
    sft_split, rl_split = split_cold_start(dataset, n=settings.num_sft_examples, seed=seed)
    eval_set = held_out_eval_set(settings.num_eval_examples, seed, dataset["context"], settings.parts_counts)
    say(
        f"[1/6] toy task: {len(sft_split)} examples held out for cold-start SFT, {len(rl_split)} for RL, "
        f"{len(eval_set)} held-out evaluation tasks x {settings.eval_samples} samples"
    )

    # 2. teacher traces -----------------------------------------------------------------------------------------
    teacher = ToyTeacher(settings.delegate_fraction, settings.compute_fraction, settings.shortcut_fraction, seed=seed)
    with ScriptedChatServer(teacher, model="toy-teacher") as server:
        client = AsyncChatClient(server.base_url, "toy-teacher", api_key_env=None, max_retries=0, timeout=30.0)
        traces = generate_teacher_traces(sft_split, client, scaffold_config=scaffold)
    kept, report = filter_traces(traces, reward_fn=parts_reward)
    with (output / "teacher_traces.jsonl").open("w", encoding="utf-8") as handle:
        for trace in traces:
            handle.write(json.dumps(trace.to_dict(), default=str) + "\n")
    sft_rows = traces_to_sft_rows(kept, num_rl_examples=len(rl_split))
    dropped = ", ".join(f"{n} {reason}" for reason, n in report.dropped.items() if n) or "none"
    say(
        f"[2/6] scripted teacher (OpenAI-compatible server on 127.0.0.1): {len(traces)} traces, {report.kept} kept "
        f"(dropped: {dropped}) -> {len(sft_rows)} SFT rows (one per turn of every root and child)"
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
    model = cold_start_sft(
        model,
        tokenizer,
        sft_rows,
        output / "sft",
        epochs=settings.sft_epochs,
        learning_rate=settings.sft_learning_rate,
        batch_size=settings.sft_batch_size,
        seed=seed,
        progress=progress,
    )
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
        f"(final answer in {100 * before.final_answer_rate:.0f}% of rollouts, {before.children_mean:.2f} children "
        "per root)"
    )
    times["eval_before"] = time.perf_counter() - tick
    return ColdStart(model, tokenizer, sft_dir, rl_split, eval_set, before, len(sft_rows), report.kept, times)


def reinforce(
    start: ColdStart,
    output: Path,
    settings: QuickstartSettings,
    fast: bool,
    progress: bool,
    say: Callable[[str], None],
) -> QuickstartResult:
    """Steps 5–6 in ``output``: `StepwiseRLMTrainer` from ``start``'s SFT policy (trained in place: give each run its
    own `trl_ext.quickstart.training.fresh_copy` to reuse it), the held-out evaluation after RL, the adapter and the
    plot."""
    from peft import LoraConfig

    from trl_ext.callbacks import default_monitors
    from trl_ext.run_info import config_summary
    from trl_ext.trainers import StepwiseRLMConfig, StepwiseRLMTrainer

    from .toy_task import parts_reward

    times = dict(start.times)
    model, tokenizer, before = start.model, start.tokenizer, start.before

    # 5. stepwise RLM RL ----------------------------------------------------------------------------------------
    tick = time.perf_counter()
    say(
        f"[5/6] StepwiseRLMTrainer: {settings.rl_steps} steps, {settings.loss_type} loss, "
        f"{settings.rlm_loss_normalization} normalisation, LoRA r={settings.lora_r}, {settings.prompts_per_step} tasks "
        f"x {settings.num_generations} rollouts per generation, default monitors"
    )
    config = StepwiseRLMConfig(**toy_rl_config_kwargs(settings, output, progress))
    monitors = default_monitors()
    trainer = StepwiseRLMTrainer(
        model,
        parts_reward,
        args=config,
        train_dataset=start.rl_split,
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
        policy, tokenizer, start.eval_set, settings, output / "eval" / "after_rl.jsonl", progress, "eval after RL"
    )
    plot_file = save_plot(output, say)
    times["eval_after"] = time.perf_counter() - tick
    say(
        f"[6/6] held-out reward after RL: {after.reward:.3f} (SFT-only: {before.reward:.3f}); children per root "
        f"{before.children_mean:.2f} -> {after.children_mean:.2f}"
    )

    history = trainer.state.log_history
    result = result_from_history("stepwise-rlm", output, settings, fast, history, monitors, adapter_dir, plot_file)
    result.before, result.after = before, after
    result.stage_times_s = {key: round(value, 1) for key, value in times.items()}
    result.extra = {
        "base_model": str(start.sft_dir),
        "config": config_summary(config),
        "sft_rows": start.sft_rows,
        "teacher_traces_kept": start.teacher_traces_kept,
        "rollout_trees_dir": str(output / "rlm_trees"),
        "task": "toy key lookup in 2-3 parts (trl_ext.quickstart.toy_task), share of parts right",
        "eval_samples": settings.eval_samples,
        "sandbox": trainer.sandbox_info,
    }
    return result
