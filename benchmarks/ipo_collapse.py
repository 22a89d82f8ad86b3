"""Does the policy stay alive? IPO with and without its ratio band, and PPO-clip, on the quickstart's RLM task at a
learning rate high enough to kill it (issue 43).

The quickstart's RL stage (`StepwiseRLMTrainer`, LoRA, 4 prompts x 8 rollouts, 4 optimizer steps per generation
batch, so three off-policy passes, children weighted 1/k_g) from the seed's cold-start SFT policy, with a constant
learning rate (``--lr``, default 3e-3) and no KL term (``beta=0``, as the asynchronous trainers), one arm after the
other from the same SFT model:

- ``ipo``: the IPO loss as it ships (probability-difference region ε = 0.3 and the ratio band δ = 0.2);
- ``ipo_region``: the probability-difference region alone (``ipo_ratio_band=None``, prime-rl's IPO);
- ``dapo``: TRL's PPO-clip.

A run is *dead* from the first step after which every step trains nothing (grad norm 0: every group's rewards
agree, the final answers gone) to the end. The table gives, per run, the training reward and the final-answer rate of
each generation batch, where it died, and when the monitors (`default_monitors`, warn only) and the
no-learning-signal warning spoke. It goes into ``benchmarks/RESULTS.md``; docs/ipo_loss.md quotes it.

    python benchmarks/ipo_collapse.py --seeds 0 1 2 --steps 16
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


def run_arm(start, settings, arm: str, workdir: Path) -> dict:
    """One RL run of ``arm`` from the cold start; its per-step log and what warned."""
    from peft import LoraConfig
    from transformers import TrainerCallback

    from trl_ext.callbacks import default_monitors
    from trl_ext.quickstart.settings import toy_rl_config_kwargs
    from trl_ext.quickstart.toy_task import parts_reward
    from trl_ext.quickstart.training import fresh_copy, quiet_progress
    from trl_ext.trainers import StepwiseRLMConfig, StepwiseRLMTrainer

    overrides = dict(ARMS[arm])
    settings = dataclasses.replace(settings, loss_type=overrides.pop("loss_type", settings.loss_type))
    config = StepwiseRLMConfig(**{**toy_rl_config_kwargs(settings, workdir / arm, False), **overrides})
    steps: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                steps.append({"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, float)}})

    warnings: list[int] = []

    class CountWarning(logging.Handler):
        def emit(self, record):
            warnings.append(trainer.state.global_step)

    handler = CountWarning(logging.WARNING)
    logging.getLogger("trl_ext.trainers.learning_signal").addHandler(handler)
    monitors = default_monitors(action="warn", stop_on_collapse=False)
    trainer = StepwiseRLMTrainer(
        fresh_copy(start.model),
        parts_reward,
        args=config,
        train_dataset=start.rl_split,
        processing_class=start.tokenizer,
        peft_config=LoraConfig(
            r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=0.0, target_modules="all-linear"
        ),
        callbacks=[*monitors, Record()],
    )
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


def per_generation(steps: list[dict], key: str, every: int) -> list[float]:
    return [entry[key] for entry in steps[::every] if key in entry]


def run_seed(seed: int, args: argparse.Namespace, workdir: Path) -> list[dict]:
    from trl_ext.quickstart import QuickstartSettings
    from trl_ext.quickstart.stepwise import cold_start

    settings = dataclasses.replace(
        QuickstartSettings.default(seed), rl_learning_rate=args.lr, rl_steps=args.steps, rl_lr_scheduler="constant",
        rl_beta=0.0,
    )  # fmt: skip
    (workdir / f"seed{seed}").mkdir(parents=True, exist_ok=True)
    start = cold_start(workdir / f"seed{seed}", settings, progress=False, say=lambda *a: None)
    results = []
    for arm in args.arms:
        result = run_arm(start, settings, arm, workdir / f"seed{seed}")
        result.update(seed=seed, num_iterations=settings.num_iterations)
        print(json.dumps({"seed": seed, "arm": arm, "dead_at": dead_at(result["steps"]),
                          "seconds": round(result["seconds"])}), flush=True)  # fmt: skip
        results.append(result)
    return results


def render(results: list[dict], args: argparse.Namespace, seconds: float) -> str:
    lines = [
        f"`python benchmarks/ipo_collapse.py --seeds {' '.join(map(str, args.seeds))} --steps {args.steps} "
        f"--lr {args.lr:g}` ({machine()}, {seconds / 60:.0f} min in all, on a machine shared with other jobs). "
        "The quickstart's RL stage (`StepwiseRLMTrainer`, LoRA, 4 prompts x 8 rollouts, 4 optimizer steps per "
        "generation batch: three off-policy passes; children 1/k_g) from each seed's cold-start SFT policy, constant "
        f"learning rate {args.lr:g}, no KL term (`beta=0`, as the asynchronous trainers). Reward and final-answer "
        "rate: of each generation batch. *Dead from*: the first step after which every step trained nothing (grad "
        "norm 0) to the end. *First alert*: the first monitor alert (`default_monitors`, warn only) and its step; "
        "*no-signal warning*: the step of `LearningSignalWatch`'s warning (5 steps without a non-zero advantage).",
        "",
        "| seed | loss | reward per generation | final-answer rate per generation | dead from step | first alert "
        "| no-signal warning | band / region masked (mean) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        steps, every = result["steps"], result["num_iterations"]
        rewards = " ".join(f"{v:.2f}" for v in per_generation(steps, "reward", every))
        answers = " ".join(f"{v:.2f}" for v in per_generation(steps, "rlm/final_answer_rate", every))
        dead = dead_at(steps)
        alert = f"{result['alerts'][0][0]} @ {result['alerts'][0][1]}" if result["alerts"] else "none"
        warned = ", ".join(map(str, result["no_signal_warnings"])) or "none"
        band = [e["ipo/band_ratio"] for e in steps if "ipo/band_ratio" in e]
        masked = [e["ipo/masked_ratio"] for e in steps if "ipo/masked_ratio" in e]
        trust = f"{sum(band) / len(band):.1%} / {sum(masked) / len(masked):.1%}" if masked else "—"
        lines.append(
            f"| {result['seed']} | {ARM_LABELS[result['arm']]} | {rewards} | {answers} | "
            f"{'**' + str(dead) + '**' if dead is not None else 'alive'} | {alert} | {warned} | {trust} |"
        )
    lines.append("")
    for arm in args.arms:
        mine = [r for r in results if r["arm"] == arm]
        died = sum(dead_at(r["steps"]) is not None for r in mine)
        last = [per_generation(r["steps"], "reward", r["num_iterations"])[-1] for r in mine]
        lines.append(
            f"- **{ARM_LABELS[arm]}**: dead in {died} of {len(mine)} runs; last generation's reward "
            f"{min(last):.2f} to {max(last):.2f}."
        )
    lines.append(
        "- The quickstart ablations (*Quickstart ablations* above: lr 1e-3 cosine, with a KL term) ran IPO without "
        "the ratio band; they have not been run again with it."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="print the table, leave RESULTS.md alone")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    tick = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ipo-collapse-") as folder:
        results = [result for seed in args.seeds for result in run_seed(seed, args, Path(folder))]
    table = render(results, args, time.perf_counter() - tick)
    print(table)
    if not args.no_write:
        write_section(SECTION, "## IPO collapse: does the policy keep answering? (issue 43)\n\n" + table)


if __name__ == "__main__":
    main()
