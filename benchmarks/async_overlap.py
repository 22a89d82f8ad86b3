"""Overlap of generation and training: `AsyncStepwiseRLMTrainer` vs the synchronous `StepwiseRLMTrainer`.

Both trainers run the quickstart's toy RLM task (`trl_ext.quickstart.toy_task`: 3 parts per context) played by the
scripted teacher (`ToyTeacher`, every root delegating, so every tree is a root and 3 children of 2 turns each: 8
trained turns), through a `ScriptedGenerator` that takes ``--latency-ms`` per generator call (a stand-in for a slow
model, REPL or judge call: it sleeps, so it costs no CPU), and train the same tiny Qwen2 on the CPU. Same batch:
``--prompts`` prompts x 4 rollouts per optimizer step (one generation per step, split into 4 accumulated
micro-batches of one group each; the async trainer counts in samples, so its micro-batch is one group's 32 turns).

Both train (a grad norm of about 1e-3 on the tiny policy): a prompt's 4 rollouts are played by 4 differently seeded
teachers (`teacher_generator`), so their tokens and rewards differ and the advantages are not 0; and the IPO loss runs
with ``ipo_threshold=1.0`` and no ratio band (``ipo_ratio_band=None``), since the scripted sampler reports log-prob 0
(p_old = 1) for every token: any smaller trust region would mask every token (|p - p_old| ~ 1 for the tiny policy),
and the band every token of a negative advantage. The ratio p / p_old is then about 0.003, which keeps the gradients
small. Before both changes every advantage was 0 and every token masked (grad norm 0:
nothing trained), and a group's 4 identical rollouts shared their prefix tree in the async trainer's packing, so
numbers from before are not comparable. The table reports each trainer's median grad norm and IPO masked ratio, so a
run that trains nothing shows it.

- **sync**: generation (rollouts, rewards, rows: timed around ``_generate_and_score_completions``) then training,
  one after the other;
- **async, max_staleness 1 and 2**: the RLM rollout worker generates in a thread of the trainer process while the
  trainer trains (no-op weight transfer, no vLLM). Generation per step: the worker's engine runs (one run = one
  step's samples; the worker logs no timing of its own, so this benchmark's worker subclass logs
  ``rollout/run_s``); training per step: TRL's ``perf/fwd_bwd_s + perf/optimizer_s``.

A step is timed from the end of the previous optimizer step to the end of this one (TRL's ``perf/step_s``), so it
includes any wait for rollouts; the first step of every run is a warm-up and is not counted. Runs alternate in one
process (the order reversed every round), so that machine noise hits all alike. Prints a table and, as the other
benchmarks do, writes it into the ``async_overlap`` section of benchmarks/RESULTS.md unless ``--no-write`` (it prints
where it wrote).

    python benchmarks/async_overlap.py [--rounds 3] [--steps 6] [--latency-ms 200] [--no-write]

The smallest run (tests/test_benchmarks_async.py's, about a minute): ``--rounds 1 --steps 2 --prompts 1 --latency-ms 10
--hidden 32 --layers 1 --no-write``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _results import RESULTS, machine, write_section  # noqa: E402
from _timing import GenerationTimer  # noqa: E402
from transformers import AutoModelForCausalLM, TrainerCallback  # noqa: E402

from trl_ext.quickstart.toy_task import (  # noqa: E402
    TOY_FIRST_USER_PROMPT,
    TOY_OUTPUT_CHARS,
    TOY_SYSTEM_PROMPT,
    TOY_USER_PROMPT,
    ToyTeacher,
    make_toy_dataset,
    parts_reward,
)
from trl_ext.rlm import ScriptedGenerator  # noqa: E402
from trl_ext.rlm.method import StepwiseRLM  # noqa: E402
from trl_ext.rlm.scaffold import ScaffoldArguments  # noqa: E402
from trl_ext.testing import build_tiny_model_and_tokenizer  # noqa: E402
from trl_ext.trainers.async_rlm import AsyncStepwiseRLMConfig, AsyncStepwiseRLMTrainer  # noqa: E402
from trl_ext.trainers.async_worker import RolloutWorker  # noqa: E402
from trl_ext.trainers.stepwise_rlm import StepwiseRLMConfig, StepwiseRLMTrainer  # noqa: E402

NUM_GENERATIONS = 4
MICRO_BATCHES = 4  # gradient accumulation: one group per micro-batch
PARTS = 3  # every context has 3 parts: a delegating root starts 3 children
TURNS_PER_TREE = 2 * (1 + PARTS)  # root and children: look at the context, then answer
GENERATOR_CALLS_PER_STEP = 4  # the engine's waves: roots' turns 1 and 2, children's turns 1 and 2
TOY_SCAFFOLD = ScaffoldArguments.arguments_for(
    max_turns=2,
    max_depth=1,
    max_children=4,
    max_total_children=4,
    system_prompt=TOY_SYSTEM_PROMPT,
    first_user_prompt=TOY_FIRST_USER_PROMPT,
    user_prompt=TOY_USER_PROMPT,
)


# ----------------------------------------------------------------------------------------------------- the task
def teacher_generator(tokenizer: Any, latency_s: float) -> ScriptedGenerator:
    """The scripted teacher as the policy's sampler: every root delegates one child per part; children compute,
    take the shortcut or read. Each ``generate`` call takes ``latency_s``.

    A `ToyTeacher` draws a node's strategy from what it sees, and a prompt's rollouts all see the same, so one teacher
    would play them alike: the same tokens, the same reward, advantages 0 and no gradient. So the k-th request with a
    given prompt text goes to teacher ``k mod NUM_GENERATIONS`` (seeds 0-3): the rollouts of a group differ in their
    children's strategies, hence in their tokens and rewards."""
    teachers = [
        ToyTeacher(delegate_fraction=1.0, compute_fraction=0.5, shortcut_fraction=0.25, seed=seed)
        for seed in range(NUM_GENERATIONS)
    ]
    requests: dict[str, int] = {}
    lock = threading.Lock()

    def respond(prompt_text: str) -> str:
        with lock:
            variant = requests.get(prompt_text, 0)
            requests[prompt_text] = variant + 1
        blocks = prompt_text.split("<|im_start|>")[1:]  # the last one is the generation prompt, not a message
        messages = [
            {"role": block.split("\n", 1)[0], "content": block.split("\n", 1)[1].rsplit("<|im_end|>", 1)[0]}
            for block in blocks
            if "<|im_end|>" in block
        ]
        return teachers[variant % NUM_GENERATIONS]({"messages": messages})

    return ScriptedGenerator(respond, tokenizer, latency_s=latency_s)


def roots_per_micro_batch(prompts: int) -> int:
    """Roots per micro-batch when a step of ``prompts`` x `NUM_GENERATIONS` roots is split into `MICRO_BATCHES`."""
    if prompts * NUM_GENERATIONS % MICRO_BATCHES:
        raise ValueError(f"prompts x {NUM_GENERATIONS} rollouts must split into {MICRO_BATCHES} micro-batches.")
    return prompts * NUM_GENERATIONS // MICRO_BATCHES


def common_config(output_dir: str, steps: int) -> dict[str, Any]:
    """The fields both trainers share: the toy scaffold, the CPU, no checkpoints, ``steps`` optimizer steps."""
    return dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        gradient_checkpointing=False,
        learning_rate=1e-4,
        loss_type="ipo",
        ipo_threshold=1.0,  # the scripted sampler's p_old is 1: a smaller threshold masks every token (no gradient)
        ipo_ratio_band=None,  # ... and every ratio is ~0.003: the band would stop every negative-advantage token
        max_steps=steps,
        num_generations=NUM_GENERATIONS,
        gradient_accumulation_steps=MICRO_BATCHES,
        max_completion_length=64,
        repl_max_output_chars=TOY_OUTPUT_CHARS,
        **TOY_SCAFFOLD,
    )


class StepClock(TrainerCallback):
    """Seconds from the end of one optimizer step to the end of the next (TRL's ``perf/step_s``: waits included);
    ``generation`` and ``training`` per step when the trainer is a `GenerationTimer` (set ``clock.trainer``)."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.generation: list[float] = []
        self.trainer: Any = None
        self._last: float | None = None
        self._generation_before = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now, generated = time.perf_counter(), getattr(self.trainer, "generation_s", 0.0)
        self.steps.append(now - self._last)
        self.generation.append(generated - self._generation_before)
        self._last, self._generation_before = now, generated


# ----------------------------------------------------------------------------------------------------- sync
class TimedStepwise(GenerationTimer, StepwiseRLMTrainer):
    """`StepwiseRLMTrainer` timing its generation (rollouts, rewards, row building)."""


def run_sync(
    model_dir: str, dataset: Any, prompts: int, steps: int, latency_s: float, output_dir: str
) -> dict[str, list[float]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    _, tokenizer = build_tiny_model_and_tokenizer(0)
    config = StepwiseRLMConfig(
        **common_config(output_dir, steps),
        per_device_train_batch_size=roots_per_micro_batch(prompts),
        steps_per_generation=MICRO_BATCHES,  # one generation of prompts x 4 roots per optimizer step
        save_rollout_trees=False,
    )
    clock = StepClock()
    trainer = TimedStepwise(
        model,
        parts_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        generator=teacher_generator(tokenizer, latency_s),
        callbacks=[clock],
    )
    clock.trainer = trainer
    trainer.train()
    steps_s, generation_s = clock.steps[1:], clock.generation[1:]
    return {
        "step": steps_s,
        "generation": generation_s,
        "training": [step - gen for step, gen in zip(steps_s, generation_s, strict=True)],
        **learning(trainer.state.log_history),
    }


# ----------------------------------------------------------------------------------------------------- async
class NoWeightTransfer:
    """TRL's weight-transfer protocol doing nothing: the scripted sampler has no weights to receive."""

    def init_weight_transfer(self) -> None: ...
    def pause(self) -> None: ...
    def send_weights(self, iterator) -> None: ...
    def resume(self) -> None: ...
    def destroy(self) -> None: ...


class TimedRLMRolloutWorker(RolloutWorker):
    """`RolloutWorker` (of `StepwiseRLM`) logging the seconds of every engine run (sampling, REPLs, rewards,
    samples) as ``rollout/run_s`` and keeping them in ``run_seconds``; the library's worker logs no timing of its own."""

    run_seconds: list[float]

    def rollout(self, rows):
        start = time.perf_counter()
        samples = super().rollout(rows)
        elapsed = time.perf_counter() - start
        self.run_seconds = [*getattr(self, "run_seconds", []), elapsed]
        self.push_metrics({"rollout/run_s": elapsed})
        return samples


def run_async(
    model_dir: str, dataset: Any, prompts: int, steps: int, latency_s: float, staleness: int, output_dir: str
) -> dict[str, list[float]]:
    _, tokenizer = build_tiny_model_and_tokenizer(0)
    samples_per_step = prompts * NUM_GENERATIONS * TURNS_PER_TREE
    config = AsyncStepwiseRLMConfig(
        **common_config(output_dir, steps),
        per_device_train_batch_size=roots_per_micro_batch(prompts) * TURNS_PER_TREE,  # samples: one per turn
        token_budget=0,  # a fixed count of samples per micro-batch, as the sync trainer's rows
        max_staleness=staleness,
        max_inflight_tasks=prompts * NUM_GENERATIONS,  # one engine run = one optimizer step's trees
        queue_maxsize=samples_per_step,  # one step queued (plus the run in flight): bounds how far ahead
    )
    worker = TimedRLMRolloutWorker(
        dataset=dataset,
        reward_funcs=[parts_reward],
        tokenizer=tokenizer,
        generator=teacher_generator(tokenizer, latency_s),
        method=StepwiseRLM(
            config.scaffold_config(),
            tokenizer,
            weighted=config.rlm_loss_normalization == "subtree",
            seed=config.seed,
        ),
        num_generations=NUM_GENERATIONS,
        groups_per_run=prompts,
        scale_rewards=config.scale_rewards,
        queue_maxsize=config.queue_maxsize,
    )
    clock = StepClock()
    trainer = AsyncStepwiseRLMTrainer(
        model_dir,
        parts_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_worker=worker,
        weight_transfer=NoWeightTransfer(),
        callbacks=[clock],
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "perf/fwd_bwd_s" in entry]
    if len(logged) != steps:
        raise RuntimeError(f"expected one log entry per step ({steps}), got {len(logged)}: set logging_steps=1.")
    timed = logged[1:]  # the first step is a warm-up
    return {
        "step": clock.steps[1:],
        "generation": worker.run_seconds[1:steps],  # run 0 went on while nothing trained; later ones after the end
        "training": [entry["perf/fwd_bwd_s"] + entry["perf/optimizer_s"] for entry in timed],
        "wait": [entry["perf/rollout_wait_s"] for entry in timed],
        "dropped": [entry.get("sample/dropped_stale_total") or 0.0 for entry in logged],
        "staleness": [entry.get("sample/staleness_mean") or 0.0 for entry in timed],
        **learning(trainer.state.log_history),
    }


def learning(log_history: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Whether a run trained: every step's ``grad_norm`` and IPO masked ratio (``ipo/masked_ratio``), warm-up
    included. A grad norm of 0 means the step trained nothing."""
    logged = [entry for entry in log_history if "loss" in entry and "grad_norm" in entry]
    return {
        "grad_norm": [float(entry["grad_norm"]) for entry in logged],
        "masked": [float(entry.get("ipo/masked_ratio", float("nan"))) for entry in logged],
    }


# ----------------------------------------------------------------------------------------------------- report
def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(results: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> tuple[str, str]:
    """The markdown table (medians per step, in ms; ratios of medians) and the verdict lines.

    Per trainer: step, generation, training (for the async trainer measured while they overlap, so contention
    inflates both); ``step / max(gen, train)`` (1: perfect overlap); ``(gen + train) / step``, the gain from
    overlapping alone (1 for the sync trainer); speed-up = sync step / this step, which also holds any difference
    between the two trainers' training code; rollout wait, samples dropped as stale (all steps), mean staleness;
    whether it trained: median grad norm and IPO masked ratio over all steps (a verdict line names a trainer whose
    median grad norm is 0: it trained nothing)."""
    sync = {name: median(values) for name, values in results.get("sync", {}).items()}
    rows, verdicts = [], []
    for kind, series in results.items():
        m = {name: median(values) for name, values in series.items()}
        own = m["step"] / max(m["generation"], m["training"])
        gain = (m["generation"] + m["training"]) / m["step"]
        speedup = sync.get("step", float("nan")) / m["step"]
        name = "sync `StepwiseRLMTrainer`" if kind == "sync" else f"async, max_staleness {kind.split('-')[1]}"
        extra = (
            "– | – | –"
            if kind == "sync"
            else f"{1000 * m['wait']:.0f} | {sum(series['dropped']):.0f} | {m['staleness']:.2f}"
        )
        rows.append(
            f"| {name} | {len(series['step'])} | {1000 * m['step']:.0f} | {1000 * m['generation']:.0f} | "
            f"{1000 * m['training']:.0f} | {own:.2f} | {gain:.2f} | {speedup:.2f} | {extra} | "
            f"{m['grad_norm']:.3g} | {100 * m['masked']:.0f} % |"
        )
        if not m["grad_norm"] > 0:
            verdicts.append(f"{name}: median grad norm {m['grad_norm']:.3g}: it trained nothing (timings only)")
        if kind != "sync":
            verdicts.append(
                f"{name}: step / max(gen, train) {own:.2f} [target <= 1.15: {'meets' if own <= 1.15 else 'misses'}]; "
                f"speed-up over sync {speedup:.2f}x [target >= 1.6: {'meets' if speedup >= 1.6 else 'misses'}], "
                f"of which overlap (gen + train) / step {gain:.2f}x"
            )
    if sync and len(results) > 1:
        asyncs = [
            {name: median(values) for name, values in series.items()} for k, series in results.items() if k != "sync"
        ]
        train_ratio = sync["training"] / median([m["training"] for m in asyncs])
        gen_ratio = median([m["generation"] for m in asyncs]) / sync["generation"]
        verdicts.append(
            f"sync training / async training: {train_ratio:.2f} [target <= 1.2: "
            f"{'meets' if train_ratio <= 1.2 else 'misses'}] (same samples; the sync trainer's step minus "
            "generation against TRL's tree-packed forward and backward): the part of the speed-up that is not overlap"
        )
        verdicts.append(
            f"async generation / sync generation: {gen_ratio:.2f} (the same engine runs, slowed by sharing the "
            "process (GIL) and 2 cores with training)"
        )
    table = "\n".join(
        [
            "| trainer | steps timed | step (ms) | generation (ms) | training (ms) | step / max(gen, train) "
            "| (gen + train) / step | speed-up over sync | rollout wait (ms) | dropped stale samples "
            "| staleness | grad norm | IPO masked |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    return table, "\n".join(verdicts)


def body(table: str, summary: str, args: argparse.Namespace) -> str:
    command = (
        f"python benchmarks/async_overlap.py --rounds {args.rounds} --steps {args.steps} --prompts {args.prompts} "
        f"--latency-ms {args.latency_ms:g} --hidden {args.hidden} --layers {args.layers}"
    )
    roots = args.prompts * NUM_GENERATIONS
    return (
        "## Overlap: async vs sync stepwise RLM training\n\n"
        f"`{command}` ({machine()}). The toy RLM task (3 parts per context) played by the scripted teacher "
        f"(every root delegates: {TURNS_PER_TREE} turns per tree), {args.latency_ms:g} ms per generator call "
        f"({GENERATOR_CALLS_PER_STEP} calls per step: the engine's waves); a small Qwen2 (hidden {args.hidden}, "
        f"{args.layers} layers), IPO loss; "
        f"{roots} trees ({roots * TURNS_PER_TREE} turns) per optimizer step in {MICRO_BATCHES} micro-batches. "
        "Latency and batch are chosen so that generation and training take comparable time, where overlap "
        "matters. Step = end of one optimizer step to the end of the next (rollout waits included); first step "
        "of each run not counted; medians; runs alternated in one process. Sync generation = rollouts, rewards "
        "and rows; async generation = the worker's engine run per step (same work, in a thread of the trainer "
        "process, overlapping training); training = the rest of the step (sync) or TRL's "
        "`perf/fwd_bwd_s + perf/optimizer_s` (async). The weight transfer is a no-op (no vLLM). Both train: "
        "4 differently seeded teachers play a prompt's 4 rollouts (their tokens and rewards differ: advantages "
        "not 0), and IPO runs with `ipo_threshold=1.0` and no ratio band (the scripted sampler reports p_old = 1, "
        "so a smaller trust region would mask every token, and the band every token of a negative advantage); grad norm and IPO masked ratio are medians over all steps. Ratios are of "
        "medians of separate series, so a value a little under 1 is noise. Stale samples: dropped by TRL's "
        "`max_staleness`; the worker's staleness gate starts a run only when none of its samples can go stale "
        "(one run = one step's trees, `queue_maxsize` = one step's samples), so at `max_staleness` 1 it waits for "
        "the queue to drain before the next run, and the trainer waits for that run (the rollout wait). The "
        "speed-up over sync is against the synchronous trainer of the same commit: since its shared-prefix packing "
        "runs varlen tree attention on the CPU and shares a prompt's prefix across the prompt's trees (issue 45), it "
        "trains as fast as TRL's tree-packed forward, and what the async trainer gains is the overlap.\n\n"
        f"{table}\n\n" + "\n".join(f"- {line}" for line in summary.splitlines())
    )


# ----------------------------------------------------------------------------------------------------- main
def save_model(directory: Path, hidden: int, layers: int) -> str:
    """The tiny policy both trainers start from (the async trainer loads it from disk)."""
    model, tokenizer = build_tiny_model_and_tokenizer(
        0, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def run(kind: str, model_dir: str, args: argparse.Namespace, output_dir: str) -> dict[str, list[float]]:
    """One run of ``kind`` (``"sync"``, ``"async-1"``, ``"async-2"``: max_staleness 1 or 2)."""
    dataset = make_toy_dataset(64, seed=0, min_parts=PARTS, max_parts=PARTS)
    latency_s = args.latency_ms / 1000
    if kind == "sync":
        return run_sync(model_dir, dataset, args.prompts, args.steps, latency_s, output_dir)
    staleness = int(kind.split("-")[1])
    return run_async(model_dir, dataset, args.prompts, args.steps, latency_s, staleness, output_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each runs every trainer once)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first not counted)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per optimizer step (x4 rollouts)")
    parser.add_argument("--latency-ms", type=float, default=200.0, help="latency of every generator call")
    parser.add_argument("--hidden", type=int, default=128, help="the tiny Qwen2's hidden size")
    parser.add_argument("--layers", type=int, default=4, help="the tiny Qwen2's layers")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--kinds", default="sync,async-1,async-2", help="comma-separated: sync, async-<staleness>")
    parser.add_argument("--no-write", action="store_true", help="print the table, do not write RESULTS.md")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is a warm-up).")
    torch.set_num_threads(args.threads)

    kinds = args.kinds.split(",")
    results: dict[str, dict[str, list[float]]] = {kind: {} for kind in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(Path(tmp) / "model", args.hidden, args.layers)
        for round_index in range(args.rounds):
            for kind in kinds if round_index % 2 == 0 else kinds[::-1]:
                for name, values in run(kind, model_dir, args, str(Path(tmp) / kind)).items():
                    results[kind].setdefault(name, []).extend(values)
                print(f"round {round_index + 1}, {kind}: done", flush=True)
    table, summary = report(results, args)
    print(table)
    print(summary)
    if not args.no_write:
        write_section("async_overlap", body(table, summary, args))
        print(f"\nwrote the async_overlap section of {RESULTS}")


if __name__ == "__main__":
    main()
