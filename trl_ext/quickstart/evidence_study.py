"""The study of `benchmarks/evidence_rewards.py` on the evidence-selection miniature (`trl_ext.quickstart.
evidence_task`: the task, the two rewards, the scripted rubric judge, the behaviour counts): per seed a tiny policy
after a brief cold-start SFT on teacher answers, then one RL run per reward (``f1``, ``rubric``) from it, and the
held-out answers scored with both rewards before and after. Knobs: `EvidenceSettings`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .evidence_task import (
    JUDGE_MODEL,
    MONITORS,
    ScriptedRubricJudge,
    classify_quote,
    evidence_splits,
    f1_reward,
    quote_metrics,
    rubric_reward,
)

__all__ = ["EvidenceSettings", "evidence_study"]


@dataclass(frozen=True)
class EvidenceSettings:
    """Every knob of the study. Task: ``num_entries`` per context, ``right_weights`` of 1, 2, 3 right entries;
    ``num_sft_examples`` (teacher answers), ``num_rl_examples``, ``num_eval_examples`` (held out, disjoint).
    Policy: the tiny Qwen2 model of `trl_ext.testing` (``hidden_size``, ``num_hidden_layers``). SFT: full fine-tuning
    (``sft_epochs``, ``sft_learning_rate``). RL: ``rl_steps`` optimizer steps of ``prompts_per_step`` x
    ``num_generations`` rollouts, each generation used ``num_iterations`` times, IPO loss, LoRA, constant learning
    rate, sampling ``temperature``."""

    seed: int = 0
    num_entries: int = 4
    right_weights: tuple[float, ...] = (0.25, 0.5, 0.25)
    num_sft_examples: int = 384
    num_rl_examples: int = 1024
    num_eval_examples: int = 256
    hidden_size: int = 64
    num_hidden_layers: int = 2
    sft_epochs: float = 24.0
    sft_learning_rate: float = 3e-3
    sft_batch_size: int = 16
    rl_steps: int = 100
    rl_learning_rate: float = 3e-3
    prompts_per_step: int = 8
    num_generations: int = 8
    num_iterations: int = 2
    max_completion_length: int = 24
    lora_r: int = 8
    lora_alpha: int = 16
    temperature: float = 1.0


def build_policy(es: EvidenceSettings) -> tuple[Any, Any]:
    from trl_ext.testing import build_tiny_model_and_tokenizer

    return build_tiny_model_and_tokenizer(
        es.seed,
        hidden_size=es.hidden_size,
        intermediate_size=2 * es.hidden_size,
        num_hidden_layers=es.num_hidden_layers,
    )


def sft_policy(model: Any, tokenizer: Any, rows: Any, es: EvidenceSettings, folder: Path) -> Any:
    from .training import cold_start_sft

    return cold_start_sft(
        model,
        tokenizer,
        rows,
        folder,
        epochs=es.sft_epochs,
        learning_rate=es.sft_learning_rate,
        batch_size=es.sft_batch_size,
        seed=es.seed,
        progress=False,
        scheduler="constant",
        max_length=96,
    )


def generate_answers(model: Any, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
    """Greedy answers (stripped), deterministic."""
    import torch

    was_training = model.training
    model.eval()
    answers: list[str] = []
    with torch.no_grad():
        for i in range(0, len(prompts), 128):
            batch = tokenizer(list(prompts[i : i + 128]), return_tensors="pt", padding=True)
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
            answers.extend(
                t.strip()
                for t in tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
            )
    if was_training:
        model.train()
    return answers


def evaluate(model: Any, tokenizer: Any, dataset: Any, es: EvidenceSettings, judge: Any) -> dict[str, Any]:
    """Held-out evaluation (greedy): both rewards' means, the behaviour rates, and the per-answer records."""
    rows = list(dataset)
    answers = generate_answers(model, tokenizer, [r["prompt"] for r in rows], es.max_completion_length)
    f1 = f1_reward()(
        prompts=[r["prompt"] for r in rows],
        completions=answers,
        evidence=[r["evidence"] for r in rows],
        context=[r["context"] for r in rows],
    )
    verdicts = judge.score([r["prompt"] for r in rows], [r["answer"] for r in rows], answers)
    rubric = [v.reward for v in verdicts]
    records = [
        {"behaviour": classify_quote(a, r["entries"], r["right"]), "num_right": len(r["right"]), "f1": f, "rubric": g}
        for a, r, f, g in zip(answers, rows, f1, rubric, strict=True)
    ]
    return {
        "f1": sum(f1) / len(f1),
        "rubric": sum(rubric) / len(rubric),
        **quote_metrics(answers, rows),
        "judge_not_ok": sum(not v.ok for v in verdicts),
        "records": records,
        "samples": [{"prompt": r["prompt"], "answer": a} for r, a in list(zip(rows, answers))[:6]],
    }


def train_arm(
    model: Any, tokenizer: Any, dataset: Any, es: EvidenceSettings, arm: str, output: Path, base_url: str
) -> Any:
    """One `ExtGRPOTrainer` run (IPO, LoRA) trained on the arm's reward, the other reward and `MONITORS` logged with
    weight 0; ``model`` is changed in place (LoRA injected)."""
    from peft import LoraConfig

    from trl_ext import ExtGRPOConfig, ExtGRPOTrainer

    from .settings import cpu_run_kwargs
    from .training import quiet_progress

    f1, rubric = f1_reward(), rubric_reward(base_url)
    trained, other = (f1, rubric) if arm == "f1" else (rubric, f1)
    rollouts = es.prompts_per_step * es.num_generations
    config = ExtGRPOConfig(
        **cpu_run_kwargs(output, es.seed, False),
        loss_type="ipo",
        max_steps=es.rl_steps,
        learning_rate=es.rl_learning_rate,
        lr_scheduler_type="constant",
        per_device_train_batch_size=rollouts,
        num_generations=es.num_generations,
        num_iterations=es.num_iterations,
        max_completion_length=es.max_completion_length,
        temperature=es.temperature,
        reward_weights=[1.0, 0.0] + [0.0] * len(MONITORS),
    )
    trainer = ExtGRPOTrainer(
        model,
        [trained, other, *MONITORS],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=es.lora_r, lora_alpha=es.lora_alpha, lora_dropout=0.0, target_modules="all-linear"),
    )
    quiet_progress(trainer)
    trainer.train()
    rubric.close()
    return trainer


_CURVES = {
    "reward": "rewards/{trained}/mean",
    "f1": "rewards/char_span_f1/mean",
    "rubric": "rewards/rubric_judge/mean",
    "exact": "rewards/exact_entry_rate/mean",
    "overlong": "rewards/overlong_rate/mean",
    "quote_chars": "rewards/quote_chars/mean",
}


def _curves(history: Sequence[dict[str, Any]], trained: str) -> dict[str, list[tuple[int, float]]]:
    curves: dict[str, list[tuple[int, float]]] = {}
    for name, key in _CURVES.items():
        key = key.format(trained=trained)
        curves[name] = [(h["step"], float(h[key])) for h in history if key in h and "step" in h]
    return curves


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k not in ("records", "samples")}


def evidence_study(
    seeds: Iterable[int] = (0, 1, 2),
    arms: Sequence[str] = ("f1", "rubric"),
    output_root: str | Path = "evidence-rewards",
    settings: EvidenceSettings | None = None,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Per seed one SFT policy, then one RL run per arm from a copy of it, each evaluated on the held-out set.
    One row per (seed, arm): ``seed``, ``arm``, ``before`` and ``after`` (held-out `evaluate` summaries),
    ``records_before`` / ``records_after`` (per-answer behaviour and both rewards), ``curves`` (per step),
    ``rl_wall_s``, ``sft_wall_s``, ``judge_requests``, ``samples_after``."""
    from .scripted_server import ScriptedChatServer
    from .training import fresh_copy

    base = settings or EvidenceSettings()
    root = Path(output_root)
    say = log or (lambda line: None)
    rows: list[dict[str, Any]] = []
    with ScriptedChatServer(ScriptedRubricJudge(), model=JUDGE_MODEL) as server:
        judge = rubric_reward(server.base_url)
        for seed in seeds:
            es = replace(base, seed=seed)
            tick = time.perf_counter()
            sft_rows, rl_set, held_out = evidence_splits(
                seed, es.num_sft_examples, es.num_rl_examples, es.num_eval_examples, es.num_entries, es.right_weights
            )
            model, tokenizer = build_policy(es)
            model = sft_policy(model, tokenizer, sft_rows, es, root / f"seed{seed}" / "sft")
            before = evaluate(model, tokenizer, held_out, es, judge)
            sft_wall = time.perf_counter() - tick
            say(
                f"seed {seed} SFT: exact {before['exact']:.3f}, over-long {before['overlong']:.3f}, partial "
                f"{before['partial']:.3f}, F1 {before['f1']:.3f}, rubric {before['rubric']:.3f} ({sft_wall:.0f} s)"
            )
            for arm in arms:
                tick = time.perf_counter()
                requests_before = len(server.requests)
                trainer = train_arm(
                    fresh_copy(model), tokenizer, rl_set, es, arm, root / f"seed{seed}" / arm, server.base_url
                )
                policy = trainer.accelerator.unwrap_model(trainer.model)
                after = evaluate(policy, tokenizer, held_out, es, judge)
                trained = "char_span_f1" if arm == "f1" else "rubric_judge"
                row = {
                    "seed": seed,
                    "arm": arm,
                    "before": _summary(before),
                    "after": _summary(after),
                    "records_before": before["records"],
                    "records_after": after["records"],
                    "curves": _curves(trainer.state.log_history, trained),
                    "rl_wall_s": time.perf_counter() - tick,
                    "sft_wall_s": sft_wall,
                    "judge_requests": len(server.requests) - requests_before,
                    "samples_after": after["samples"],
                    "settings": asdict(es),
                }
                rows.append(row)
                say(
                    f"seed {seed} {arm}: exact {before['exact']:.3f} -> {after['exact']:.3f}, over-long "
                    f"{after['overlong']:.3f}, partial {after['partial']:.3f}, chars {after['quote_chars']:.1f}, "
                    f"F1 {after['f1']:.3f}, rubric {after['rubric']:.3f} ({row['rl_wall_s']:.0f} s)"
                )
        judge.close()
    return rows
