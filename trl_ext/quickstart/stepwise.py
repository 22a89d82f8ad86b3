"""`trl-ext quickstart`: the whole stepwise-RLM pipeline in miniature, offline, on the CPU, in a few minutes.

The built-in toy task (`trl_ext.toy_task`): look one key up in a few ``key=value`` pairs held in the REPL's
``context``; reward = exact match. The run, in order:

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

`--method judge-credit` and `--method rlmt` run `JudgeCreditTrainer` (against a scripted span judge on 127.0.0.1)
and `RLMTTrainer` (scored by the tiny reward model) in miniature: they show the trainers, monitors and outputs
working end to end; they are not expected to learn anything in a few steps.

Nothing here prints: progress goes through ``log`` (the CLI passes ``print``) and tqdm bars (``progress=True``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trl_ext.hub import PLOT_FILE, RUN_INFO_FILE

logger = logging.getLogger(__name__)

METHODS = ("stepwise-rlm", "judge-credit", "rlmt")
ADAPTER_DIR = "adapter"
SFT_MODEL_DIR = "sft_model"

_METHOD_TRAINERS = {
    "stepwise-rlm": "StepwiseRLMTrainer",
    "judge-credit": "JudgeCreditTrainer",
    "rlmt": "RLMTTrainer",
}


# ----------------------------------------------------------------------------------------------------------------
# Settings and results
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuickstartSettings:
    """Every knob of a quickstart run. `default` is what the README's numbers come from; `fast` is for CI.

    Data: ``num_sft_examples`` held out for cold-start SFT (a few dozen: SPEC §1.4), ``num_rl_examples`` for RL
    (>= 10x the SFT set, so `split_cold_start` does not warn), ``num_eval_examples`` held-out tasks evaluated
    ``eval_samples`` times each.
    Policy: a Qwen2-architecture model with ``hidden_size`` and ``num_hidden_layers`` (``trl_ext.testing``).
    Teacher: fractions of its *compute* and *shortcut* strategies (`trl_ext.toy_task.ToyTeacher`).
    SFT: epochs, learning rate, batch size (full fine-tuning: the model starts from random weights).
    RL: optimizer steps, learning rate, ``rl_beta`` (KL to the SFT policy: it keeps the lookup program intact while
    the strategy shifts), prompts per generation × ``num_generations`` rollouts, ``num_iterations`` optimizer steps
    per generation (the later ones are off-policy, where the IPO mask acts), ``rl_micro_batches`` the generation
    batch is split into (gradient accumulation: the same optimizer step, a quarter of the activation memory), LoRA
    rank/alpha, ``max_completion_length`` tokens per action, ``max_turns`` per rollout (the task takes two: look at
    the context, then answer; a third turn only repeats a longer prompt after a failed one), sampling
    ``temperature``.
    """

    seed: int = 0
    num_sft_examples: int = 48
    num_rl_examples: int = 480
    num_eval_examples: int = 48
    eval_samples: int = 4
    hidden_size: int = 64
    num_hidden_layers: int = 4
    compute_fraction: float = 0.45
    shortcut_fraction: float = 0.2
    sft_epochs: float = 60.0
    sft_learning_rate: float = 3e-3
    sft_batch_size: int = 8
    rl_steps: int = 40
    rl_learning_rate: float = 1e-3
    rl_beta: float = 0.2
    prompts_per_step: int = 8
    num_generations: int = 8
    num_iterations: int = 4
    rl_micro_batches: int = 4
    lora_r: int = 16
    lora_alpha: int = 32
    max_completion_length: int = 64
    max_turns: int = 2
    temperature: float = 1.0

    @classmethod
    def default(cls, seed: int = 0) -> QuickstartSettings:
        return cls(seed=seed)

    @classmethod
    def fast(cls, seed: int = 0) -> QuickstartSettings:
        """Every stage, scaled down to well under a minute on two cores (for CI; it does not learn visibly)."""
        return cls(
            seed=seed,
            num_eval_examples=8,
            eval_samples=2,
            sft_epochs=15.0,
            rl_steps=4,
            prompts_per_step=2,
            num_generations=4,
        )

    def validate(self) -> None:
        for name in (
            "num_sft_examples",
            "num_rl_examples",
            "num_eval_examples",
            "eval_samples",
            "rl_steps",
            "prompts_per_step",
            "num_iterations",
            "rl_micro_batches",
            "max_turns",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations must be >= 2 (group advantages need a group), got {self.num_generations}."
            )
        rollouts = self.prompts_per_step * self.num_generations
        if rollouts % self.rl_micro_batches:
            raise ValueError(
                f"rl_micro_batches={self.rl_micro_batches} must divide the {rollouts} rollouts of a generation batch "
                "(prompts_per_step x num_generations)."
            )
        if not self.sft_epochs > 0:
            raise ValueError(f"sft_epochs must be > 0, got {self.sft_epochs!r}.")


@dataclass
class EvalResult:
    """Held-out evaluation of one policy: RLM rollouts of every eval task, ``samples`` times each."""

    reward: float
    rollouts: int
    final_answer_rate: float
    turns_mean: float
    children_mean: float
    strategies: dict[str, float]
    trees_file: str | None = None


@dataclass
class QuickstartResult:
    """What a quickstart run produced; `to_dict` is what ``trl_ext_run.json`` holds (with the settings)."""

    method: str
    output_dir: Path
    seed: int
    fast: bool
    wall_time_s: float
    train_steps: int
    adapter_dir: Path
    plot_file: Path | None
    reward_first: float | None
    reward_last: float | None
    train_rewards: list[float]
    masked_ratio_mean: float | None
    masked_ratio_max: float | None
    alerts: dict[str, int]
    alert_log: list[dict[str, Any]]
    before: EvalResult | None = None
    after: EvalResult | None = None
    stage_times_s: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("output_dir", "adapter_dir", "plot_file"):
            data[key] = None if data[key] is None else str(data[key])
        return data


class QuickstartError(RuntimeError):
    """A quickstart run cannot start or finish (e.g. the output directory is not writable)."""


# ----------------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------------
def run_quickstart(
    output_dir: str | os.PathLike[str] = "trl-ext-quickstart",
    *,
    method: str = "stepwise-rlm",
    fast: bool = False,
    seed: int = 0,
    settings: QuickstartSettings | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> QuickstartResult:
    """Run the quickstart (see the module docstring) and return its numbers.

    Args:
        output_dir: created if needed; must be writable. Files already there with the same names are replaced.
        method: ``"stepwise-rlm"`` (the full pipeline), ``"judge-credit"`` or ``"rlmt"`` (miniature runs).
        fast: the scaled-down `QuickstartSettings.fast` (CI); ignored when ``settings`` is given.
        seed: seeds data, teacher, model, SFT, RL and evaluation; ignored when ``settings`` is given.
        settings: every knob explicitly.
        progress: show tqdm progress bars.
        log: receives one line per stage (default: the module logger at INFO).
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r}: choose one of {', '.join(METHODS)}.")
    if settings is None:
        settings = QuickstartSettings.fast(seed) if fast else QuickstartSettings.default(seed)
    settings.validate()
    output = prepare_output_dir(output_dir)
    say = log if log is not None else logger.info
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.perf_counter()
    with _library_progress_bars(progress):
        if method == "stepwise-rlm":
            result = _run_stepwise(output, settings, fast, progress, say)
        elif method == "judge-credit":
            result = _run_judge_credit(output, settings, fast, progress, say)
        else:
            result = _run_rlmt(output, settings, fast, progress, say)
    result.wall_time_s = time.perf_counter() - started
    write_run_info(output, result, settings)
    return result


@contextlib.contextmanager
def _library_progress_bars(enabled: bool) -> Iterator[None]:
    """Without ``progress``, also silence the bars transformers and datasets draw themselves (saving shards, mapping
    datasets); restored afterwards."""
    if enabled:
        yield
        return
    import datasets
    from transformers.utils import logging as hf_logging

    transformers_on = hf_logging.is_progress_bar_enabled()
    datasets_on = datasets.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if transformers_on:
            hf_logging.enable_progress_bar()
        if datasets_on:
            datasets.enable_progress_bars()


def prepare_output_dir(output_dir: str | os.PathLike[str]) -> Path:
    """Create ``output_dir`` if needed and check that files can be written in it; raise `QuickstartError` if not."""
    path = Path(output_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise QuickstartError(f"--output-dir {path} exists and is not a directory; pass a directory path.")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".trl-ext-write-test"
        probe.write_text("ok", encoding="utf-8")
        probe.unlink()
    except OSError as error:
        raise QuickstartError(
            f"--output-dir {path} is not writable ({error.strerror or error}); pass a directory you can write to, "
            "e.g. --output-dir ./trl-ext-quickstart."
        ) from None
    return path


def write_run_info(output_dir: Path, result: QuickstartResult, settings: QuickstartSettings) -> Path:
    """``trl_ext_run.json``: method, trainer, base model, settings, metrics and alerts (read by ``trl-ext push``)."""
    info = {
        "source": "trl-ext quickstart",
        "method": result.method,
        "trainer": _METHOD_TRAINERS[result.method],
        "base_model": result.extra.get("base_model"),
        "settings": asdict(settings),
        "config": result.extra.get("config", {}),
        "sandbox": result.extra.get("sandbox"),
        "metrics": _final_metrics(result),
        "alerts": result.alerts,
        "alert_log": result.alert_log,
        "result": result.to_dict(),
    }
    path = output_dir / RUN_INFO_FILE
    path.write_text(json.dumps(info, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def _final_metrics(result: QuickstartResult) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    if result.before is not None and result.after is not None:
        metrics["eval/reward_sft_only"] = round(result.before.reward, 4)
        metrics["eval/reward_after_rl"] = round(result.after.reward, 4)
        metrics["eval/rollouts"] = result.after.rollouts
    if result.reward_first is not None:
        metrics["train/reward_first"] = round(result.reward_first, 4)
    if result.reward_last is not None:
        metrics["train/reward_last"] = round(result.reward_last, 4)
    if result.masked_ratio_mean is not None:
        metrics["train/ipo_masked_ratio_mean"] = round(result.masked_ratio_mean, 4)
    metrics["train/steps"] = result.train_steps
    return metrics


# ----------------------------------------------------------------------------------------------------------------
# The stepwise RLM pipeline
# ----------------------------------------------------------------------------------------------------------------
def _run_stepwise(
    output: Path, settings: QuickstartSettings, fast: bool, progress: bool, say: Callable[[str], None]
) -> QuickstartResult:
    from peft import LoraConfig

    from trl_ext.callbacks import default_monitors
    from trl_ext.judge import AsyncChatClient
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
        f"[2/6] scripted teacher (OpenAI-compatible server on 127.0.0.1): {len(traces)} traces, {report.kept} kept (dropped: "
        f"{dropped}) -> {len(sft_rows)} SFT rows (one per turn)"
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
    _quiet_progress(trainer)
    trainer.train()
    adapter_dir = _save_adapter_and_state(trainer, output)
    times["rl"] = time.perf_counter() - tick

    # 6. evaluation after RL, plot ------------------------------------------------------------------------------
    tick = time.perf_counter()
    policy = trainer.accelerator.unwrap_model(trainer.model)
    after = evaluate_policy(
        policy, tokenizer, eval_set, settings, output / "eval" / "after_rl.jsonl", progress, "eval after RL"
    )
    plot_file = _plot(output, say)
    times["eval_after"] = time.perf_counter() - tick
    say(f"[6/6] held-out reward after RL: {after.reward:.3f} (SFT-only: {before.reward:.3f})")

    history = trainer.state.log_history
    result = _result_from_history("stepwise-rlm", output, settings, fast, history, monitors, adapter_dir, plot_file)
    result.before, result.after = before, after
    result.stage_times_s = {key: round(value, 1) for key, value in times.items()}
    result.extra = {
        "base_model": str(sft_dir),
        "config": _config_summary(config),
        "sft_rows": len(sft_rows),
        "teacher_traces_kept": report.kept,
        "rollout_trees_dir": str(output / "rlm_trees"),
        "task": "toy key lookup (trl_ext.toy_task), exact-match reward",
        "eval_samples": settings.eval_samples,
        "sandbox": trainer.sandbox_info,
    }
    return result


def toy_scaffold_config(settings: QuickstartSettings) -> Any:
    """The RLM scaffold of the toy task: short prompts, no sub-calls needed (``max_depth=0``)."""
    from trl_ext.rlm import RLMScaffoldConfig

    from .toy_task import TOY_FIRST_USER_PROMPT, TOY_SYSTEM_PROMPT, TOY_USER_PROMPT

    return RLMScaffoldConfig(
        max_turns=settings.max_turns,
        max_depth=0,
        system_prompt=TOY_SYSTEM_PROMPT,
        first_user_prompt=TOY_FIRST_USER_PROMPT,
        user_prompt=TOY_USER_PROMPT,
    )


def toy_rl_config_kwargs(settings: QuickstartSettings, output: Path, progress: bool) -> dict[str, Any]:
    """`StepwiseRLMConfig` keyword arguments of the quickstart's RL stage (CPU, IPO, the toy scaffold)."""
    from .toy_task import TOY_FIRST_USER_PROMPT, TOY_SYSTEM_PROMPT, TOY_USER_PROMPT

    return dict(
        **_cpu_run_kwargs(output, settings, progress),
        activation_checkpointing=False,  # a tiny model on the CPU: recomputing activations only costs time
        loss_type="ipo",
        learning_rate=settings.rl_learning_rate,
        lr_scheduler_type="constant",
        beta=settings.rl_beta,  # KL to the SFT policy (the adapter disabled): keeps the lookup program intact
        max_steps=settings.rl_steps,
        # one optimizer step per pass over the generation batch (split into rl_micro_batches accumulated
        # micro-batches), num_iterations passes per generation: the later ones are off-policy (IPO acts)
        per_device_train_batch_size=settings.prompts_per_step * settings.num_generations // settings.rl_micro_batches,
        gradient_accumulation_steps=settings.rl_micro_batches,
        num_generations=settings.num_generations,
        num_iterations=settings.num_iterations,
        max_completion_length=settings.max_completion_length,
        temperature=settings.temperature,
        max_turns=settings.max_turns,
        max_depth=0,
        rlm_system_prompt=TOY_SYSTEM_PROMPT,
        rlm_first_user_prompt=TOY_FIRST_USER_PROMPT,
        rlm_user_prompt=TOY_USER_PROMPT,
    )


def held_out_eval_set(num_examples: int, seed: int, exclude: Sequence[str]) -> Any:
    """``num_examples`` toy tasks whose contexts are not in ``exclude`` (the SFT and RL data)."""
    from .toy_task import make_toy_dataset

    seen = set(exclude)
    candidates = make_toy_dataset(2 * num_examples + 16, seed=seed + 10_007)
    keep = [i for i, context in enumerate(candidates["context"]) if context not in seen][:num_examples]
    return candidates.select(keep)


def _cold_start_sft(model: Any, tokenizer: Any, rows: Any, settings: QuickstartSettings, folder: Path, progress: bool):
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
    _quiet_progress(trainer)
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.eval()
    return model


def evaluate_policy(
    model: Any,
    tokenizer: Any,
    eval_set: Any,
    settings: QuickstartSettings,
    trees_file: Path | None = None,
    progress: bool = False,
    description: str = "eval",
    chunk_size: int = 64,
) -> EvalResult:
    """Held-out reward of ``model`` on the toy task: ``settings.eval_samples`` RLM rollouts per task, exact match.

    Sampling uses the RL temperature and is seeded (``settings.seed``) and order-independent, so the SFT-only and
    the RL policy are evaluated on the same draws of the random number generator.
    """
    import torch

    from trl_ext.rlm import CanonicalOrderGenerator, RLMEngine, RLMTask, TransformersGenerator

    from .toy_task import classify_strategy, exact_match_reward

    tasks = [
        RLMTask(prompt=row["prompt"], context=row["context"]) for row in eval_set for _ in range(settings.eval_samples)
    ]
    answers = [row["answer"] for row in eval_set for _ in range(settings.eval_samples)]
    generator = CanonicalOrderGenerator(
        TransformersGenerator(
            model, tokenizer, max_new_tokens=settings.max_completion_length, temperature=settings.temperature
        )
    )
    engine = RLMEngine(generator, tokenizer, toy_scaffold_config(settings))
    was_training = model.training
    model.eval()
    trees = []
    bar = _progress_bar(len(tasks), description, progress)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(settings.seed + 1)
            for start in range(0, len(tasks), chunk_size):
                chunk = tasks[start : start + chunk_size]
                trees.extend(engine.run(chunk))
                bar.update(len(chunk))
    finally:
        bar.close()
        model.train(was_training)
    rewards = exact_match_reward([tree.final_answer or "" for tree in trees], answers)
    rewards = [r if tree.final_answer is not None else 0.0 for r, tree in zip(rewards, trees)]
    strategies = Counter(classify_strategy(tree) for tree in trees)
    if trees_file is not None:
        trees_file.parent.mkdir(parents=True, exist_ok=True)
        with trees_file.open("w", encoding="utf-8") as handle:
            for tree, answer, reward in zip(trees, answers, rewards):
                record = {"answer": answer, "reward": reward, "tree": tree.to_dict(tokenizer)}
                handle.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    return EvalResult(
        reward=sum(rewards) / len(rewards),
        rollouts=len(trees),
        final_answer_rate=sum(tree.final_answer is not None for tree in trees) / len(trees),
        turns_mean=statistics.fmean(len(tree.root.turns) for tree in trees),
        children_mean=statistics.fmean(len(tree.nodes) - 1 for tree in trees),
        strategies={name: count / len(trees) for name, count in sorted(strategies.items())},
        trees_file=None if trees_file is None else str(trees_file),
    )


def _quiet_progress(trainer: Any) -> None:
    """Keep the trainer's progress bar but not its printing of every log dict, with or without bars (the logs still
    reach the trainer state, the monitors and the plot)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    class BarOnlyProgress(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            return None

    if any(type(cb) is ProgressCallback for cb in trainer.callback_handler.callbacks):
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(BarOnlyProgress())
    if any(type(cb) is PrinterCallback for cb in trainer.callback_handler.callbacks):  # disable_tqdm=True
        trainer.remove_callback(PrinterCallback)


def _progress_bar(total: int, description: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, unit="rollout", disable=not enabled, leave=False)


# ----------------------------------------------------------------------------------------------------------------
# Miniature runs of the other trainers
# ----------------------------------------------------------------------------------------------------------------
_ARITHMETIC = [(a, b) for a in range(1, 10) for b in range(1, 10)]


def _arithmetic_dataset(num: int, seed: int) -> Any:
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    pairs = [rng.choice(_ARITHMETIC) for _ in range(num)]
    return Dataset.from_dict(
        {"prompt": [f"What is {a} + {b}?" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]}
    )


_NUMBER = re.compile(r"-?\d+")


def last_number_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """1.0 when the last number in the completion equals ``answer``; 0.1 for any number; else 0 (a toy verifier)."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion if isinstance(completion, str) else str(completion[-1].get("content", ""))
        numbers = _NUMBER.findall(text)
        rewards.append(1.0 if numbers and numbers[-1] == expected else 0.1 if numbers else 0.0)
    return rewards


class ScriptedSpanJudge:
    """The miniature judge: marks the completion's first line ``key_progress`` when the answer is right and
    ``original_error`` when it is wrong (confidence 0.8), quoting it. A `ScriptedChatServer` script."""

    _TRACE = re.compile(r"<<<(DATA-[0-9a-f]{16}) TRACE\n(.*?)\n\1>>>", re.DOTALL)
    _MARK = re.compile(r"⟦(\d+)⟧")

    def __call__(self, request: dict[str, Any]) -> str:
        text = "\n".join(str(m.get("content") or "") for m in request.get("messages", []) if m.get("role") == "user")
        match = self._TRACE.search(text)
        if match is None:
            return json.dumps({"spans": []})
        marked = match.group(2)
        parts = self._MARK.split(marked)
        segments = [(int(parts[i]), parts[i + 1]) for i in range(1, len(parts), 2)]
        visible = [(start, body) for start, body in segments if body.strip()]
        if not visible:
            return json.dumps({"spans": []})
        start, body = visible[0]
        following = [s for s, _ in segments if s > start]
        end = following[0] if following else start + 1
        correct = "verdict: correct" in text.lower() or "verifier verdict: 1" in text.lower()
        label = "key_progress" if correct else "original_error"
        span = {"start": start, "end": end, "label": label, "confidence": 0.8, "quote": body.strip()}
        return json.dumps({"spans": [span]})


def _run_judge_credit(
    output: Path, settings: QuickstartSettings, fast: bool, progress: bool, say: Callable[[str], None]
) -> QuickstartResult:
    from peft import LoraConfig

    from trl_ext.callbacks import default_monitors
    from trl_ext.testing import build_tiny_model_and_tokenizer
    from trl_ext.trainers import JudgeCreditConfig, JudgeCreditTrainer

    from .scripted_server import ScriptedChatServer

    model, tokenizer = build_tiny_model_and_tokenizer(settings.seed, initializer_range=0.5)
    dataset = _arithmetic_dataset(64, settings.seed)
    judge = ScriptedSpanJudge()
    say("[1/2] scripted span judge on 127.0.0.1 (OpenAI-compatible); tiny policy, arithmetic prompts")
    with ScriptedChatServer(judge, model="scripted-span-judge") as server:
        config = JudgeCreditConfig(
            **_miniature_run_kwargs(output, settings, fast, progress),
            max_completion_length=16,
            judge_base_url=server.base_url,
            judge_model="scripted-span-judge",
            judge_tools=[],
            judge_max_retries=0,
            judge_timeout=10.0,
            judge_lambda=0.25,
            marker_every=4,
        )
        monitors = default_monitors()
        say(f"[2/2] JudgeCreditTrainer: {config.max_steps} steps, IPO loss, λ = 0.25, LoRA, default monitors")
        trainer = JudgeCreditTrainer(
            model,
            last_number_reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=LoraConfig(**_MINIATURE_LORA),
            callbacks=monitors,
        )
        _quiet_progress(trainer)
        trainer.train()  # inside the `with`: the judge server must be up
    result = _save_miniature_run("judge-credit", trainer, monitors, output, settings, fast, say)
    history = trainer.state.log_history
    result.extra = {
        "base_model": "trl_ext.testing.build_tiny_model_and_tokenizer (in memory, not on disk)",
        "config": _config_summary(config),
        "judge_share_mean": _mean(history, "judge/share"),
        "judge_failure_ratio_mean": _mean(history, "judge/failure_ratio"),
        "judge_requests": len(server.requests),
        "audit_log": str(output / "judge_audit.jsonl"),
    }
    return result


def _run_rlmt(
    output: Path, settings: QuickstartSettings, fast: bool, progress: bool, say: Callable[[str], None]
) -> QuickstartResult:
    from datasets import Dataset
    from peft import LoraConfig

    from trl_ext.callbacks import default_monitors
    from trl_ext.rewards import RewardModelScorer
    from trl_ext.testing import build_tiny_model_and_tokenizer, build_tiny_reward_model
    from trl_ext.trainers import RLMTConfig, RLMTTrainer

    policy, tokenizer = build_tiny_model_and_tokenizer(settings.seed, initializer_range=0.5)
    reward_model, rm_tokenizer = build_tiny_reward_model(settings.seed + 1, initializer_range=0.5)
    scorer = RewardModelScorer(reward_model, rm_tokenizer, format="instruct", strict=False)
    prompts = ["Say hello.", "Name a colour.", "Count to five.", "What is 2 + 3?", "Say yes or no.", "Greet me."]
    dataset = Dataset.from_dict({"prompt": [prompts[i % len(prompts)] for i in range(48)]})
    say("[1/2] tiny policy and tiny reward model (scores the response only; lenient format for the untrained policy)")
    config = RLMTConfig(
        **_miniature_run_kwargs(output, settings, fast, progress),
        max_completion_length=24,
        loss_type="ipo",
        strict_format=False,
    )
    monitors = default_monitors()
    say(
        f"[2/2] RLMTTrainer: {config.max_steps} steps, instruct format, IPO loss, LoRA, β = {config.beta}, "
        "default monitors"
    )
    trainer = RLMTTrainer(
        policy,
        scorer,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(**_MINIATURE_LORA),
        callbacks=monitors,
    )
    _quiet_progress(trainer)
    trainer.train()
    result = _save_miniature_run("rlmt", trainer, monitors, output, settings, fast, say)
    history = trainer.state.log_history
    result.extra = {
        "base_model": "trl_ext.testing.build_tiny_model_and_tokenizer (in memory, not on disk)",
        "reward_model": "trl_ext.testing.build_tiny_reward_model (in memory)",
        "config": _config_summary(config),
        "malformed_ratio_mean": _mean(history, "reward_model/malformed_ratio"),
    }
    return result


# ----------------------------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------------------------
_MINIATURE_LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}


def _cpu_run_kwargs(output: Path, settings: QuickstartSettings, progress: bool) -> dict[str, Any]:
    """Config fields every quickstart trainer shares: the CPU, no tracker, the seed, a log line per step, no
    checkpoints (the adapter is saved at the end), bars only with ``progress``."""
    return dict(
        output_dir=str(output),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=settings.seed,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=not progress,
    )


def _miniature_run_kwargs(output: Path, settings: QuickstartSettings, fast: bool, progress: bool) -> dict[str, Any]:
    """The judge-credit and RLMT miniatures' shared settings: at most 8 steps (2 with ``fast``), 2 prompts x 4
    completions per step, each batch used twice."""
    return dict(
        **_cpu_run_kwargs(output, settings, progress),
        max_steps=min(2 if fast else settings.rl_steps, 8),
        learning_rate=5e-3,
        per_device_train_batch_size=8,
        num_generations=4,
        num_iterations=2,
    )


def _save_adapter_and_state(trainer: Any, output: Path) -> Path:
    """Save the trained run: ``trainer_state.json`` (the log history the plot reads) and the adapter."""
    trainer.save_state()
    adapter_dir = output / ADAPTER_DIR
    trainer.save_model(str(adapter_dir))
    return adapter_dir


def _save_miniature_run(
    method: str,
    trainer: Any,
    monitors: Sequence[Any],
    output: Path,
    settings: QuickstartSettings,
    fast: bool,
    say: Callable[[str], None],
) -> QuickstartResult:
    """Save a trained miniature run, draw its plot and read its result from the log history."""
    adapter_dir = _save_adapter_and_state(trainer, output)
    plot_file = _plot(output, say)
    return _result_from_history(
        method, output, settings, fast, trainer.state.log_history, monitors, adapter_dir, plot_file
    )


def _plot(output: Path, say: Callable[[str], None]) -> Path | None:
    from trl_ext.callbacks import plot_run

    try:
        return Path(plot_run(output, out=output / PLOT_FILE))
    except ImportError as error:  # matplotlib is an optional extra
        say(f"(no plot: {error})")
        return None


def _mean(history: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [h[key] for h in history if isinstance(h.get(key), (int, float)) and math.isfinite(h[key])]
    return statistics.fmean(values) if values else None


def _result_from_history(
    method: str,
    output: Path,
    settings: QuickstartSettings,
    fast: bool,
    history: Sequence[dict[str, Any]],
    monitors: Sequence[Any],
    adapter_dir: Path,
    plot_file: Path | None,
) -> QuickstartResult:
    rewards = [h["reward"] for h in history if isinstance(h.get("reward"), (int, float))]
    masked = [h["ipo/masked_ratio"] for h in history if isinstance(h.get("ipo/masked_ratio"), (int, float))]
    alerts: Counter[str] = Counter()
    alert_log: list[dict[str, Any]] = []
    for monitor in monitors:
        alerts.update(monitor.alert_counts)
        alert_log.extend({"monitor": type(monitor).__name__, **record} for record in monitor.alerts)
    steps = max((int(h.get("step", 0)) for h in history), default=0)
    return QuickstartResult(
        method=method,
        output_dir=output,
        seed=settings.seed,
        fast=fast,
        wall_time_s=0.0,
        train_steps=steps,
        adapter_dir=adapter_dir,
        plot_file=plot_file,
        reward_first=rewards[0] if rewards else None,
        reward_last=rewards[-1] if rewards else None,
        train_rewards=rewards,
        masked_ratio_mean=statistics.fmean(masked) if masked else None,
        masked_ratio_max=max(masked) if masked else None,
        alerts=dict(sorted(alerts.items())),
        alert_log=sorted(alert_log, key=lambda record: record.get("step", 0)),
    )


def _config_summary(config: Any) -> dict[str, Any]:
    from trl_ext.recipes import config_summary

    return config_summary(config)


__all__ = [
    "METHODS",
    "EvalResult",
    "QuickstartError",
    "QuickstartResult",
    "QuickstartSettings",
    "evaluate_policy",
    "prepare_output_dir",
    "run_quickstart",
]
