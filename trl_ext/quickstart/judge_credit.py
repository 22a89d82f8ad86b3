"""The judge-credit miniature (``--method judge-credit``): `JudgeCreditTrainer` learning a digit-copy task whose
outcome reward is sparse and whose judge points at the digit that went wrong (the task, its rewards and the scripted
judge: `trl_ext.quickstart.copy_task`).

**The run** (`run_judge_credit`): seeded train / held-out splits (disjoint); a brief cold-start SFT of a tiny
Qwen2-architecture model so that it copies many digits right but fewer whole answers; the held-out exact match and
per-digit accuracy of that policy (greedy); `JudgeCreditTrainer` (LoRA, IPO loss, λ = ``judge_lambda``), per-digit
accuracy logged as a second reward function with weight 0 (``rewards/copy_digit_accuracy_reward/mean``, never trained
on); the held-out figures again; and, in the default run, the same RL stage from the same SFT model with the judge's
credit off (``judge_lambda=0``: the judge still runs and is audited, the advantages are outcome-only).
`judge_credit_ablation` runs that comparison over seeds and λ (``benchmarks/judge_credit_ablation.py``). Knobs:
`JudgeCreditSettings`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from .copy_task import (
    ScriptedSpanJudge,
    copy_digit_accuracy_reward,
    copy_exact_match_reward,
    copy_task_splits,
    digit_accuracy,
)
from .report import QuickstartResult, history_mean
from .settings import QuickstartSettings, ScaledSettings, check_counts, cpu_run_kwargs
from .training import cold_start_sft, fresh_copy, quiet_progress, save_miniature_run

JUDGE_MODEL = "scripted-digit-judge"


# ----------------------------------------------------------------------------------------------------------------
# Knobs
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class JudgeCreditSettings(ScaledSettings):
    """Every knob of the judge-credit miniature; `default` and `fast` (CI) take the seed of the quickstart's settings.

    Task: ``digits`` per answer; ``num_sft_examples`` for cold-start SFT, ``num_rl_examples`` RL prompts,
    ``num_eval_examples`` held-out prompts (all three disjoint).
    Policy: the tiny Qwen2 model of `trl_ext.testing` with ``hidden_size`` and ``num_hidden_layers``.
    SFT: full fine-tuning for ``sft_epochs`` at ``sft_learning_rate`` (brief on purpose: held-out per-digit accuracy
    0.5-0.9 and exact match 0.05-0.5 after it, depending on the seed).
    RL: ``rl_steps`` optimizer steps of ``prompts_per_step`` prompts x ``num_generations`` rollouts, each generation
    used ``num_iterations`` times (the later passes off-policy, where the IPO mask acts); LoRA ``lora_r`` /
    ``lora_alpha``; sampling ``temperature``.
    Judge: ``judge_lambda`` of the trained run (1.0: on seeds 0-2 it beat outcome-only on held-out exact match every
    time, 0.25 tied once; benchmarks/RESULTS.md), ``marker_every`` (1: every digit has its marker), the scripted
    judge's confidences (`ScriptedSpanJudge`): ``judge_error_confidence`` is low on purpose, because a wrong digit's
    negative credit also raises the end-of-sequence token, which the judge never sees (with confidence 1 the policy
    learned to answer nothing within 20 steps), and ``compare_outcome_only``: also train the outcome-only run
    (λ = 0, the judge in shadow mode) from the same SFT model and report both.
    """

    seed: int = 0
    digits: int = 5
    num_sft_examples: int = 96
    num_rl_examples: int = 512
    num_eval_examples: int = 256
    hidden_size: int = 32
    num_hidden_layers: int = 2
    sft_epochs: float = 24.0
    sft_learning_rate: float = 3e-3
    sft_batch_size: int = 8
    rl_steps: int = 100
    rl_learning_rate: float = 3e-3
    prompts_per_step: int = 8
    num_generations: int = 8
    num_iterations: int = 2
    lora_r: int = 8
    lora_alpha: int = 16
    temperature: float = 0.7
    judge_lambda: float = 1.0
    marker_every: int = 1
    judge_progress_confidence: float = 1.0
    judge_error_confidence: float = 0.1
    judge_overrun_confidence: float = 1.0
    judge_later_errors: bool = True
    compare_outcome_only: bool = True

    # `fast`: every stage scaled down to a few seconds (CI: 2 RL steps, no outcome-only run; it does not learn)
    FAST: ClassVar[dict[str, Any]] = {
        "num_rl_examples": 64,
        "num_eval_examples": 32,
        "sft_epochs": 8.0,
        "rl_steps": 2,
        "prompts_per_step": 2,
        "num_generations": 4,
        "compare_outcome_only": False,
    }

    @classmethod
    def from_quickstart(cls, settings: QuickstartSettings, fast: bool) -> JudgeCreditSettings:
        return cls.fast(settings.seed) if fast else cls.default(settings.seed)

    def validate(self) -> None:
        check_counts(self, ("digits", "num_sft_examples", "num_rl_examples", "num_eval_examples", "rl_steps"))
        if not self.judge_lambda >= 0:
            raise ValueError(f"judge_lambda must be >= 0, got {self.judge_lambda!r}.")


def judge_for(js: JudgeCreditSettings) -> ScriptedSpanJudge:
    return ScriptedSpanJudge(
        js.judge_progress_confidence, js.judge_error_confidence, js.judge_overrun_confidence, js.judge_later_errors
    )


# ----------------------------------------------------------------------------------------------------------------
# Policy, SFT, evaluation
# ----------------------------------------------------------------------------------------------------------------
def build_policy(js: JudgeCreditSettings) -> tuple[Any, Any]:
    from trl_ext.testing import build_tiny_model_and_tokenizer

    return build_tiny_model_and_tokenizer(
        js.seed,
        hidden_size=js.hidden_size,
        intermediate_size=2 * js.hidden_size,
        num_hidden_layers=js.num_hidden_layers,
    )


def sft_copy_policy(
    model: Any, tokenizer: Any, rows: Any, js: JudgeCreditSettings, folder: Path, progress: bool
) -> Any:
    """Brief cold-start SFT on the copy task (constant learning rate, short rows); the model in eval mode."""
    return cold_start_sft(
        model,
        tokenizer,
        rows,
        folder,
        epochs=js.sft_epochs,
        learning_rate=js.sft_learning_rate,
        batch_size=js.sft_batch_size,
        seed=js.seed,
        progress=progress,
        scheduler="constant",
        max_length=64,
    )


def evaluate_copy(model: Any, tokenizer: Any, dataset: Any, digits: int, batch_size: int = 128) -> dict[str, Any]:
    """Greedy held-out evaluation: exact match and per-digit accuracy over ``dataset`` (deterministic)."""
    import torch

    was_training = model.training
    model.eval()
    completions: list[str] = []
    prompts, answers = list(dataset["prompt"]), list(dataset["answer"])
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            batch = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True)
            out = model.generate(**batch, max_new_tokens=digits + 2, do_sample=False)
            new = out[:, batch["input_ids"].shape[1] :]
            completions.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    if was_training:
        model.train()
    exact = copy_exact_match_reward(completions, answers)
    return {
        "exact_match": sum(exact) / len(exact),
        "digit_acc": sum(digit_accuracy(c, a) for c, a in zip(completions, answers)) / len(answers),
        "examples": len(answers),
        "samples": [{"answer": a, "completion": c} for a, c in list(zip(answers, completions))[:8]],
    }


# ----------------------------------------------------------------------------------------------------------------
# RL
# ----------------------------------------------------------------------------------------------------------------
def scripted_judge_kwargs(js: JudgeCreditSettings, base_url: str, judge_lambda: float) -> dict[str, Any]:
    """The judge fields of a judge-credit config (`JudgeCreditConfig`, `AsyncJudgeCreditConfig`) that asks the
    miniature's scripted judge at ``base_url``: one request per rollout, no tools, no retries, verdicts on the
    exact-match reward, credit capped by ``judge_lambda``."""
    return dict(
        judge_base_url=base_url,
        judge_model=JUDGE_MODEL,
        judge_tools=[],
        judge_max_tool_rounds=0,
        judge_max_retries=0,
        judge_timeout=10.0,
        judge_lambda=judge_lambda,
        judge_verdict_reward="copy_exact_match_reward",
        marker_every=js.marker_every,
    )


def _rl_config(
    output: Path, js: JudgeCreditSettings, judge_lambda: float, base_url: str, progress: bool, **overrides: Any
) -> Any:
    from trl_ext.trainers import JudgeCreditConfig

    rollouts = js.prompts_per_step * js.num_generations
    kwargs = dict(
        **cpu_run_kwargs(output, js.seed, progress),
        max_steps=js.rl_steps,
        learning_rate=js.rl_learning_rate,
        lr_scheduler_type="constant",
        per_device_train_batch_size=rollouts,
        num_generations=js.num_generations,
        num_iterations=js.num_iterations,
        max_completion_length=js.digits + 2,
        temperature=js.temperature,
        **scripted_judge_kwargs(js, base_url, judge_lambda),
        reward_weights=[1.0, 0.0],  # per-digit accuracy is logged (rewards/...), never trained on
    )
    return JudgeCreditConfig(**{**kwargs, **overrides})


def train_rl(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    js: JudgeCreditSettings,
    judge_lambda: float,
    output: Path,
    base_url: str,
    progress: bool = False,
    monitors: list[Any] | None = None,
    *,
    reward_funcs: list[Any] | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> Any:
    """`JudgeCreditTrainer` on ``dataset`` from ``model`` (changed in place: LoRA is injected), judge at ``base_url``.

    ``monitors`` are passed as ``callbacks``; ``reward_funcs`` replace the outcome reward and the logged per-digit
    accuracy (in that order; the first keeps the name ``copy_exact_match_reward``, the judge's verdict reward);
    ``config_overrides`` replace fields of the `JudgeCreditConfig` (benchmarks/monitors_eval.py uses both to inject
    pathologies into this run).
    """
    from peft import LoraConfig

    from trl_ext.trainers import JudgeCreditTrainer

    config = _rl_config(output, js, judge_lambda, base_url, progress, **(config_overrides or {}))
    trainer = JudgeCreditTrainer(
        model,
        reward_funcs or [copy_exact_match_reward, copy_digit_accuracy_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=js.lora_r, lora_alpha=js.lora_alpha, lora_dropout=0.0, target_modules="all-linear"),
        callbacks=monitors or [],
    )
    quiet_progress(trainer)
    trainer.train()
    return trainer


def _policy(trainer: Any) -> Any:
    return trainer.accelerator.unwrap_model(trainer.model)


def _heldout(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    return {
        "exact_match_before": before["exact_match"],
        "exact_match_after": after["exact_match"],
        "digit_acc_before": before["digit_acc"],
        "digit_acc_after": after["digit_acc"],
    }


# ----------------------------------------------------------------------------------------------------------------
# The quickstart pipeline
# ----------------------------------------------------------------------------------------------------------------
def run_judge_credit(
    output: Path, settings: QuickstartSettings, fast: bool, progress: bool, say: Callable[[str], None]
) -> QuickstartResult:
    """The judge-credit miniature in ``output`` (module docstring); ``say`` gets one line per stage."""
    from trl_ext.callbacks import default_monitors
    from trl_ext.run_info import config_summary

    from .scripted_server import ScriptedChatServer

    js = JudgeCreditSettings.from_quickstart(settings, fast)
    js.validate()
    times: dict[str, float] = {}
    stages = 5 if js.compare_outcome_only else 4

    tick = time.perf_counter()
    sft_rows, rl_set, held_out = copy_task_splits(
        js.seed, js.num_sft_examples, js.num_rl_examples, js.num_eval_examples, js.digits
    )
    model, tokenizer = build_policy(js)
    say(
        f"[1/{stages}] copy task ({js.digits} digits, exact-match reward): cold-start SFT of a tiny Qwen2 model on "
        f"{len(sft_rows)} examples ({js.sft_epochs:g} epochs); {len(rl_set)} RL prompts, {len(held_out)} held out"
    )
    model = sft_copy_policy(model, tokenizer, sft_rows, js, output / "sft", progress)
    times["sft"] = time.perf_counter() - tick

    tick = time.perf_counter()
    before = evaluate_copy(model, tokenizer, held_out, js.digits)
    times["eval_before"] = time.perf_counter() - tick
    say(
        f"[2/{stages}] held-out (greedy) after SFT: exact match {before['exact_match']:.3f}, "
        f"per-digit accuracy {before['digit_acc']:.3f}"
    )
    baseline_model = fresh_copy(model) if js.compare_outcome_only else None

    judge = judge_for(js)
    with ScriptedChatServer(judge, model=JUDGE_MODEL) as server:
        tick = time.perf_counter()
        monitors = default_monitors()
        say(
            f"[3/{stages}] JudgeCreditTrainer: {js.rl_steps} steps, {js.prompts_per_step} prompts x "
            f"{js.num_generations} rollouts, IPO loss, LoRA, λ = {js.judge_lambda:g}; scripted digit judge on "
            "127.0.0.1 (OpenAI-compatible)"
        )
        trainer = train_rl(model, tokenizer, rl_set, js, js.judge_lambda, output, server.base_url, progress, monitors)
        times["rl"] = time.perf_counter() - tick
        judge_requests = len(server.requests)
        tick = time.perf_counter()
        after = evaluate_copy(_policy(trainer), tokenizer, held_out, js.digits)
        times["eval_after"] = time.perf_counter() - tick
        say(
            f"[4/{stages}] held-out after RL with judge credit: exact match {before['exact_match']:.3f} -> "
            f"{after['exact_match']:.3f}, per-digit accuracy {before['digit_acc']:.3f} -> {after['digit_acc']:.3f}"
        )
        outcome_only = None
        if baseline_model is not None:
            tick = time.perf_counter()
            baseline = train_rl(
                baseline_model, tokenizer, rl_set, js, 0.0, output / "outcome_only", server.base_url, progress
            )
            baseline_after = evaluate_copy(_policy(baseline), tokenizer, held_out, js.digits)
            times["outcome_only"] = time.perf_counter() - tick
            outcome_only = _heldout(before, baseline_after)
            say(
                f"[5/{stages}] the same RL, outcome-only (λ = 0): exact match {before['exact_match']:.3f} -> "
                f"{baseline_after['exact_match']:.3f}, per-digit accuracy {before['digit_acc']:.3f} -> "
                f"{baseline_after['digit_acc']:.3f}"
            )

    result = save_miniature_run("judge-credit", trainer, monitors, output, settings, fast, say)
    history = trainer.state.log_history
    result.stage_times_s = {key: round(value, 1) for key, value in times.items()}
    result.extra = {
        "base_model": "trl_ext.testing.build_tiny_model_and_tokenizer after cold-start SFT (in memory, not on disk)",
        "task": f"copy {js.digits} digits (trl_ext.quickstart.judge_credit), exact-match reward",
        "config": config_summary(trainer.args),
        "judge_credit_settings": asdict(js),
        "heldout": _heldout(before, after),
        "heldout_outcome_only": outcome_only,
        "heldout_samples_after": after["samples"],
        "judge_share_mean": history_mean(history, "judge/share"),
        "judge_failure_ratio_mean": history_mean(history, "judge/failure_ratio"),
        "judge_requests": judge_requests,
        "audit_log": str(output / "judge_audit.jsonl"),
    }
    return result


# ----------------------------------------------------------------------------------------------------------------
# The ablation (benchmarks/judge_credit_ablation.py)
# ----------------------------------------------------------------------------------------------------------------
def judge_credit_ablation(
    seeds: Iterable[int] = (0, 1, 2),
    lambdas: Iterable[float] = (0.0, 0.25),
    output_root: str | Path = "judge-credit-ablation",
    settings: JudgeCreditSettings | None = None,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Judge credit against outcome-only: per seed one SFT model, then one RL run per λ from a copy of it (λ = 0:
    outcome-only; same seed, data and SFT start), each evaluated on the held-out set. One row per (seed, λ):
    ``seed``, ``judge_lambda``, the held-out ``exact_match_before/after`` and ``digit_acc_before/after``,
    ``rl_wall_s`` (RL and evaluation), ``sft_wall_s``, ``torch_threads``, ``judge_share_mean``."""
    import torch

    from .scripted_server import ScriptedChatServer

    base = settings or JudgeCreditSettings.default()
    root = Path(output_root)
    rows: list[dict[str, Any]] = []
    say = log or (lambda line: None)
    with ScriptedChatServer(judge_for(base), model=JUDGE_MODEL) as server:
        for seed in seeds:
            js = replace(base, seed=seed)
            js.validate()
            tick = time.perf_counter()
            sft_rows, rl_set, held_out = copy_task_splits(
                seed, js.num_sft_examples, js.num_rl_examples, js.num_eval_examples, js.digits
            )
            model, tokenizer = build_policy(js)
            model = sft_copy_policy(model, tokenizer, sft_rows, js, root / f"seed{seed}" / "sft", progress=False)
            before = evaluate_copy(model, tokenizer, held_out, js.digits)
            sft_wall = time.perf_counter() - tick
            for lam in lambdas:
                tick = time.perf_counter()
                output = root / f"seed{seed}" / f"lambda{lam:g}"
                trainer = train_rl(fresh_copy(model), tokenizer, rl_set, js, lam, output, server.base_url)
                after = evaluate_copy(_policy(trainer), tokenizer, held_out, js.digits)
                row = {
                    "seed": seed,
                    "judge_lambda": lam,
                    **_heldout(before, after),
                    "rl_wall_s": time.perf_counter() - tick,
                    "sft_wall_s": sft_wall,
                    "torch_threads": torch.get_num_threads(),
                    "judge_share_mean": history_mean(trainer.state.log_history, "judge/share"),
                    "reward_mean": history_mean(trainer.state.log_history, "reward"),
                    "train_digit_acc": [
                        h["rewards/copy_digit_accuracy_reward/mean"]
                        for h in trainer.state.log_history
                        if "rewards/copy_digit_accuracy_reward/mean" in h
                    ],
                    "length_last": [h for h in trainer.state.log_history if "completions/mean_length" in h][-1][
                        "completions/mean_length"
                    ],
                }
                rows.append(row)
                say(
                    f"seed {seed} λ={lam:g}: exact {row['exact_match_before']:.3f} -> {row['exact_match_after']:.3f}, "
                    f"digits {row['digit_acc_before']:.3f} -> {row['digit_acc_after']:.3f} ({row['rl_wall_s']:.0f} s)"
                )
    return rows
