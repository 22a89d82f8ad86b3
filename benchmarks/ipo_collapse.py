"""Does the policy stay alive? IPO with and without its ratio band, and PPO-clip, on the quickstart's RLM task at a
learning rate high enough to kill it (issue 43).

The quickstart's RL stage (`StepwiseRLMTrainer`, LoRA, 4 prompts x 8 rollouts, 4 optimizer steps per generation
batch, so three off-policy passes, children weighted 1/k_g) from the seed's cold-start SFT policy, with a constant
learning rate (``--lr``, default 3e-3) and no KL term (``beta=0``, as the asynchronous trainers), one arm after the
other from the same SFT model:

- ``ipo``: the IPO loss as it ships (probability-difference region ε = 0.3 and the ratio band δ = 0.2);
- ``ipo_region``: the probability-difference region alone (``ipo_ratio_band=None``, prime-rl's IPO);
- ``dapo``: TRL's PPO-clip.

``--lrs`` runs the arms at each learning rate (one cold start per seed). ``--async`` runs the same arms on the
asynchronous trainer with real lag instead: `AsyncStepwiseRLMTrainer` sampling from a `LocalPolicy` (an in-process
copy that receives every weight sync), each sample trained once, a callback sleeping ``--sleep`` seconds after each
optimizer step so the sampler runs ahead by up to ``max_staleness`` versions (``--staleness``, one run per value),
the settings of benchmarks/async_staleness.py otherwise.

A run is *dead* from the first step after which every step trains nothing (grad norm 0: every group's rewards
agree, the final answers gone) to the end. The table gives, per run, the training reward and the final-answer rate of
each generation batch, where it died, and when the monitors (`default_monitors`, warn only) and the
no-learning-signal warning spoke. It goes into ``benchmarks/RESULTS.md``; docs/ipo_loss.md quotes it.

    python benchmarks/ipo_collapse.py --seeds 0 1 2 --steps 16
    python benchmarks/ipo_collapse.py --seeds 0 1 2 --steps 16 --lrs 1e-3 1e-2 --section ipo_collapse_lr
    python benchmarks/ipo_collapse.py --async --seeds 0 1 2 --steps 20 --staleness 0 4 --sleep 6 --arms ipo dapo
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _results import machine, write_section  # noqa: E402

SECTION = "ipo_collapse"
ARMS: dict[str, dict] = {"ipo": {}, "ipo_region": {"ipo_ratio_band": None}, "dapo": {"loss_type": "dapo"}}
ARM_LABELS = {
    "ipo": "IPO, region + ratio band (default)",
    "ipo_region": "IPO, probability region alone",
    "dapo": "PPO-clip (dapo)",
}


def run_arm(start, settings, arm: str, workdir: Path, args: argparse.Namespace, staleness: int | None) -> dict:
    """One RL run of ``arm`` from the cold start (synchronous, or asynchronous at ``staleness`` with real lag); its
    per-step log and what warned."""
    from peft import LoraConfig
    from transformers import TrainerCallback

    from trl_ext.callbacks import default_monitors
    from trl_ext.quickstart.settings import toy_rl_config_kwargs
    from trl_ext.quickstart.toy_task import parts_reward
    from trl_ext.quickstart.training import fresh_copy, quiet_progress
    from trl_ext.rlm.generators import SamplingSettings
    from trl_ext.trainers import AsyncStepwiseRLMTrainer, LocalPolicy, StepwiseRLMConfig, StepwiseRLMTrainer

    overrides = dict(ARMS[arm])
    settings = dataclasses.replace(settings, loss_type=overrides.pop("loss_type", settings.loss_type))
    output = workdir / (arm if staleness is None else f"{arm}-k{staleness}")
    steps: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                steps.append({"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, float)}})

    class Lag(TrainerCallback):
        """Sleeps ``--sleep`` seconds after each optimizer step: the sampler runs ahead, so samples arrive up to k
        versions old."""

        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(sleep_s)

    sleep_s = args.sleep
    warnings: list[int] = []

    class CountWarning(logging.Handler):
        def emit(self, record):
            warnings.append(trainer.state.global_step)

    handler = CountWarning(logging.WARNING)
    logging.getLogger("trl_ext.trainers.learning_signal").addHandler(handler)
    monitors = default_monitors(action="warn", stop_on_collapse=False)
    lora = LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=0.0, target_modules="all-linear")
    if staleness is None:
        config = StepwiseRLMConfig(**{**toy_rl_config_kwargs(settings, output, False), **overrides})
        trainer = StepwiseRLMTrainer(
            fresh_copy(start.model), parts_reward, args=config, train_dataset=start.rl_split,
            processing_class=start.tokenizer, peft_config=lora, callbacks=[*monitors, Record()],
        )  # fmt: skip
    else:
        from async_staleness import async_config

        config = async_config(settings, output, staleness, settings.loss_type, args.steps, args.micro_batch)
        for key, value in overrides.items():
            setattr(config, key, value)
        policy = LocalPolicy(str(start.sft_dir), start.tokenizer, settings=SamplingSettings.from_trl(config))
        trainer = AsyncStepwiseRLMTrainer(
            str(start.sft_dir), parts_reward, args=config, train_dataset=start.rl_split,
            processing_class=start.tokenizer, generator=policy, weight_transfer=policy, peft_config=lora,
            callbacks=[*monitors, Record(), Lag()],
        )  # fmt: skip
    quiet_progress(trainer)
    tick = time.perf_counter()
    try:
        trainer.train()
    finally:
        logging.getLogger("trl_ext.trainers.learning_signal").removeHandler(handler)
    alerts = sorted({(a["rule"], a["step"]) for m in monitors for a in m.alerts}, key=lambda x: x[1])
    return {"arm": arm, "steps": steps, "alerts": alerts, "no_signal_warnings": warnings,
            "seconds": time.perf_counter() - tick}  # fmt: skip


def dead_at(steps: list[dict]) -> int | None:
    """The first step from which every step to the end had grad norm 0 (None: alive at the end)."""
    dead = None
    for entry in steps:
        if entry.get("grad_norm", 1.0) == 0.0:
            dead = entry["step"] if dead is None else dead
        else:
            dead = None
    return dead


def per_generation(steps: list[dict], key: str, every: int, average: bool) -> list[float]:
    """``key`` per generation batch (sync: its first step's value, every step of a batch sees the same samples) or,
    with ``average``, the mean of each block of ``every`` steps (async: each step has samples of its own)."""
    if not average:
        return [entry[key] for entry in steps[::every] if key in entry]
    blocks = [[entry[key] for entry in steps[i : i + every] if key in entry] for i in range(0, len(steps), every)]
    return [sum(block) / len(block) for block in blocks if block]


def run_seed(seed: int, args: argparse.Namespace, workdir: Path) -> list[dict]:
    from trl_ext.quickstart import QuickstartSettings
    from trl_ext.quickstart.stepwise import cold_start

    base = dataclasses.replace(
        QuickstartSettings.default(seed), rl_steps=args.steps, rl_lr_scheduler="constant", rl_beta=0.0
    )
    (workdir / f"seed{seed}").mkdir(parents=True, exist_ok=True)
    start = cold_start(workdir / f"seed{seed}", base, progress=False, say=lambda *a: None)
    results = []
    for lr in args.lrs:
        settings = dataclasses.replace(base, rl_learning_rate=lr)
        for staleness in args.staleness if args.use_async else [None]:
            for arm in args.arms:
                result = run_arm(start, settings, arm, workdir / f"seed{seed}" / f"lr{lr:g}", args, staleness)
                result.update(seed=seed, lr=lr, staleness=staleness, num_iterations=settings.num_iterations)
                print(json.dumps({"seed": seed, "lr": lr, "staleness": staleness, "arm": arm,
                                  "dead_at": dead_at(result["steps"]),
                                  "seconds": round(result["seconds"])}), flush=True)  # fmt: skip
                results.append(result)
    return results


def command(args: argparse.Namespace) -> str:
    parts = ["python benchmarks/ipo_collapse.py"] + (["--async"] if args.use_async else [])
    parts += [f"--seeds {' '.join(map(str, args.seeds))}", f"--steps {args.steps}"]
    parts += [f"--lrs {' '.join(f'{lr:g}' for lr in args.lrs)}"]
    if args.use_async:
        parts += [f"--staleness {' '.join(map(str, args.staleness))}", f"--sleep {args.sleep:g}"]
    if args.arms != list(ARMS):
        parts += [f"--arms {' '.join(args.arms)}"]
    if args.section != (f"{SECTION}_async" if args.use_async else SECTION):
        parts += [f"--section {args.section}"]
    return " ".join(parts)


def setup_text(args: argparse.Namespace) -> str:
    lrs = " and ".join(f"{lr:g}" for lr in args.lrs)
    if not args.use_async:
        return (
            "The quickstart's RL stage (`StepwiseRLMTrainer`, LoRA, 4 prompts x 8 rollouts, 4 optimizer steps per "
            "generation batch: three off-policy passes; children 1/k_g) from each seed's cold-start SFT policy, "
            f"constant learning rate {lrs}, no KL term (`beta=0`, as the asynchronous trainers). Reward and "
            "final-answer rate: of each generation batch."
        )
    return (
        "`AsyncStepwiseRLMTrainer` from each seed's cold-start SFT policy, sampling from a `LocalPolicy`, "
        f"constant learning rate {lrs}, no KL term, each sample trained once, a callback sleeping {args.sleep:g} s "
        "after each optimizer step so the sampler runs ahead up to `max_staleness` (k) versions; the settings of "
        "benchmarks/async_staleness.py otherwise. Reward and final-answer rate: means over blocks of 4 steps. "
        "*Lag*: the mean version lag of the trained samples (`sample/staleness_mean`)."
    )


def render(results: list[dict], args: argparse.Namespace, seconds: float) -> str:
    every_async = 4
    lines = [
        f"`{command(args)}` ({machine()}, {seconds / 60:.0f} min in all, on a machine shared with other jobs). "
        + setup_text(args)
        + " *Dead from*: the first step after which every step trained nothing (grad norm 0) to the end. *First "
        "alert*: the first monitor alert (`default_monitors`, warn only) and its step; *no-signal warning*: the step "
        "of `LearningSignalWatch`'s warning (5 steps without a non-zero advantage).",
        "",
        "| lr | k | seed | loss | reward | final-answer rate | dead from step | first alert | no-signal warning "
        "| band / region masked (mean) | lag |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        steps = result["steps"]
        every = every_async if args.use_async else result["num_iterations"]
        rewards = " ".join(f"{v:.2f}" for v in per_generation(steps, "reward", every, args.use_async))
        answers = " ".join(f"{v:.2f}" for v in per_generation(steps, "rlm/final_answer_rate", every, args.use_async))
        dead = dead_at(steps)
        alert = f"{result['alerts'][0][0]} @ {result['alerts'][0][1]}" if result["alerts"] else "none"
        warned = ", ".join(map(str, result["no_signal_warnings"])) or "none"
        band = [e["ipo/band_ratio"] for e in steps if "ipo/band_ratio" in e]
        masked = [e["ipo/masked_ratio"] for e in steps if "ipo/masked_ratio" in e]
        trust = f"{sum(band) / len(band):.1%} / {sum(masked) / len(masked):.1%}" if masked else "—"
        lags = [e["sample/staleness_mean"] for e in steps if "sample/staleness_mean" in e]
        lag = f"{sum(lags) / len(lags):.2f}" if lags else "—"
        k = "sync" if result["staleness"] is None else result["staleness"]
        lines.append(
            f"| {result['lr']:g} | {k} | {result['seed']} | {ARM_LABELS[result['arm']]} | {rewards} | {answers} | "
            f"{'**' + str(dead) + '**' if dead is not None else 'alive'} | {alert} | {warned} | {trust} | {lag} |"
        )
    lines.append("")
    for lr in args.lrs:
        for staleness in args.staleness if args.use_async else [None]:
            for arm in args.arms:
                mine = [r for r in results if r["arm"] == arm and r["lr"] == lr and r["staleness"] == staleness]
                if not mine:
                    continue
                died = sum(dead_at(r["steps"]) is not None for r in mine)
                every = every_async if args.use_async else mine[0]["num_iterations"]
                last = [per_generation(r["steps"], "reward", every, args.use_async)[-1] for r in mine]
                where = f"lr {lr:g}" + ("" if staleness is None else f", k = {staleness}")
                span = "4 steps'" if args.use_async else "generation's"
                lines.append(
                    f"- **{where}, {ARM_LABELS[arm]}**: dead in {died} of {len(mine)} runs; last "
                    f"{span} reward {min(last):.2f} to {max(last):.2f}."
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-3], help="constant learning rates, each a run")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--async", dest="use_async", action="store_true", help="the asynchronous trainer, real lag")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 4], help="--async: max_staleness values")
    parser.add_argument("--sleep", type=float, default=6.0, help="--async: seconds slept after each optimizer step")
    parser.add_argument("--micro-batch", type=int, default=40, help="--async: turn samples per micro-batch (x4)")
    parser.add_argument("--section", default=None, help="the RESULTS.md section to write (default: by mode)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="print the table, leave RESULTS.md alone")
    args = parser.parse_args()
    args.section = args.section or (f"{SECTION}_async" if args.use_async else SECTION)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    tick = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ipo-collapse-") as folder:
        results = [result for seed in args.seeds for result in run_seed(seed, args, Path(folder))]
    table = render(results, args, time.perf_counter() - tick)
    print(table)
    if not args.no_write:
        mode = "asynchronous with real lag" if args.use_async else "lr grid"
        arms = "" if args.arms == list(ARMS) else ": " + ", ".join(ARM_LABELS[arm] for arm in args.arms)
        title = {SECTION: "IPO collapse: does the policy keep answering? (issue 43)"}.get(
            args.section, f"IPO collapse, {mode}{arms} (issue 43)"
        )
        write_section(args.section, f"## {title}\n\n" + table)


if __name__ == "__main__":
    main()
