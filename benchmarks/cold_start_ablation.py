"""Cold start in miniature: SFT on a small holdout vs SFT on the whole RL set vs no SFT, then the same RL.

The RLM blog's lesson (docs/cold_start.md): SFT on a small held-out part of the RL data works; SFT on the whole RL
set caused entropy collapse, KL spikes and reward collapse; without SFT a small model never earns a reward. Here on
the judge-credit miniature's copy task (`trl_ext.quickstart.copy_task`: copy 5 digits, exact-match reward), whose RL
stage costs seconds, so every arm runs on 3 seeds:

- ``holdout``: the miniature as it ships: SFT on 96 teacher answers of prompts that RL never sees;
- ``large``: the same SFT on 512 prompts that RL never sees either: as much SFT as ``full``, without the RL prompts
  (it tells the effect of training on the RL prompts from the effect of more SFT);
- ``full``: the same SFT (same epochs and learning rate) on the 512 RL prompts themselves, the RL set's teacher
  answers, then RL on those very prompts;
- ``none``: RL from the untrained tiny model.

RL (each arm, same seed): `ExtGRPOTrainer`, IPO loss, LoRA r 8, 8 prompts x 8 rollouts a step at temperature 0.7,
each generation batch used twice, constant learning rate 3e-3, a KL term (β = 0.04, so that the KL is logged and
`EntropyMonitor`'s ``kl_spike`` rule can speak), ``--steps`` steps, the default monitors (warn only).

Reported per seed and arm: held-out exact match after SFT and after RL (256 prompts never trained on, greedy),
the training reward, the entropy and the KL of the first and last tenth of the steps, the share of groups with no
learning signal (TRL's ``frac_reward_zero_std``), and the monitors' alerts; a plot of the reward, entropy and KL
curves (benchmarks/images/cold_start.png). The section goes into benchmarks/RESULTS.md; docs/cold_start.md and
docs/quickstart.md quote it.

    python benchmarks/cold_start_ablation.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _results import machine, quiet_run, write_section  # noqa: E402

SECTION = "cold_start"
ARMS = ("holdout", "large", "full", "none")
ARM_LABELS = {
    "holdout": "SFT on a small holdout (96, disjoint from RL)",
    "large": "SFT on 512 other prompts (disjoint from RL)",
    "full": "SFT on the whole RL set (512)",
    "none": "no SFT",
}
KL_BETA = 0.04


def run_arm(arm: str, seed: int, steps: int, workdir: Path) -> dict[str, Any]:
    """One arm on one seed: its SFT (or none), held-out before and after RL, and the RL run's per-step log."""
    from peft import LoraConfig
    from transformers import TrainerCallback

    from trl_ext.callbacks import default_monitors
    from trl_ext.quickstart.copy_task import copy_exact_match_reward, copy_task_splits
    from trl_ext.quickstart.judge_credit import JudgeCreditSettings, build_policy, evaluate_copy, sft_copy_policy
    from trl_ext.quickstart.settings import cpu_run_kwargs
    from trl_ext.quickstart.training import quiet_progress
    from trl_ext.trainers import ExtGRPOConfig, ExtGRPOTrainer

    js = JudgeCreditSettings.default(seed)
    sft_rows, rl_set, eval_set = copy_task_splits(
        seed, js.num_sft_examples, js.num_rl_examples, js.num_eval_examples, js.digits
    )
    model, tokenizer = build_policy(js)
    tick = time.perf_counter()
    if arm != "none":
        rows = {"holdout": sft_rows, "large": other_prompts(seed, rl_set, eval_set, len(rl_set), js.digits)}.get(
            arm, rl_set.map(lambda row: {"completion": row["answer"]})
        )
        model = sft_copy_policy(model, tokenizer, rows, js, workdir / f"sft-{arm}-{seed}", progress=False)
    sft_seconds = time.perf_counter() - tick
    before = evaluate_copy(model, tokenizer, eval_set, js.digits)["exact_match"]
    steps_log: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                steps_log.append(
                    {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, float)}}
                )

    monitors = default_monitors(action="warn", stop_on_collapse=False)
    with tempfile.TemporaryDirectory() as output:
        config = ExtGRPOConfig(
            **cpu_run_kwargs(Path(output), seed, progress=False),
            max_steps=steps,
            learning_rate=js.rl_learning_rate,
            lr_scheduler_type="constant",
            per_device_train_batch_size=js.prompts_per_step * js.num_generations,
            num_generations=js.num_generations,
            num_iterations=js.num_iterations,
            max_completion_length=js.digits + 2,
            temperature=js.temperature,
            loss_type="ipo",
            beta=KL_BETA,
        )
        trainer = ExtGRPOTrainer(
            model,
            [copy_exact_match_reward],
            args=config,
            train_dataset=rl_set,
            processing_class=tokenizer,
            peft_config=LoraConfig(
                r=js.lora_r, lora_alpha=js.lora_alpha, lora_dropout=0.0, target_modules="all-linear"
            ),
            callbacks=[*monitors, Record()],
        )
        quiet_progress(trainer)
        tick = time.perf_counter()
        trainer.train()
        rl_seconds = time.perf_counter() - tick
        after = evaluate_copy(trainer.accelerator.unwrap_model(trainer.model), tokenizer, eval_set, js.digits)
    alerts = sorted({(a["rule"], a["step"]) for m in monitors for a in m.alerts}, key=lambda x: x[1])
    return {
        "arm": arm,
        "seed": seed,
        "before": before,
        "after": after["exact_match"],
        "steps": steps_log,
        "alerts": alerts,
        "sft_seconds": sft_seconds,
        "rl_seconds": rl_seconds,
    }


def other_prompts(seed: int, rl_set: Any, eval_set: Any, count: int, digits: int) -> Any:
    """``count`` SFT rows of the copy task whose answers are in neither the RL nor the held-out set."""
    from trl_ext.quickstart.copy_task import copy_task_splits

    taken = set(rl_set["answer"]) | set(eval_set["answer"])
    pool, _, _ = copy_task_splits(seed + 1000, count + len(taken), 1, 1, digits)
    keep = [i for i, answer in enumerate(pool["answer"]) if answer not in taken][:count]
    return pool.select(keep)


# ----------------------------------------------------------------------------------------------------- figures
def window(steps: list[dict], key: str, first: bool, share: float = 0.1) -> float | None:
    """Mean of ``key`` over the first (or last) ``share`` of the steps that logged it."""
    values = [s[key] for s in steps if key in s]
    if not values:
        return None
    size = max(1, int(len(values) * share))
    return statistics.fmean(values[:size] if first else values[-size:])


def fmt(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def table(records: list[dict]) -> str:
    lines = [
        "| seed | cold start | held-out exact match, after SFT → after RL | reward, first → last tenth "
        "| entropy, first → last tenth | KL, first → last tenth (max) | no-signal groups | alerts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(records, key=lambda r: (r["seed"], ARMS.index(r["arm"]))):
        s = r["steps"]
        kl_max = max((e["kl"] for e in s if "kl" in e), default=None)
        alerts = sorted({rule for rule, _ in r["alerts"]})
        first = {rule: min(step for name, step in r["alerts"] if name == rule) for rule in alerts}
        lines.append(
            f"| {r['seed']} | {ARM_LABELS[r['arm']]} | {r['before']:.3f} → {r['after']:.3f} "
            f"| {fmt(window(s, 'reward', True), 2)} → {fmt(window(s, 'reward', False), 2)} "
            f"| {fmt(window(s, 'entropy', True))} → {fmt(window(s, 'entropy', False))} "
            f"| {fmt(window(s, 'kl', True), 4)} → {fmt(window(s, 'kl', False), 4)} ({fmt(kl_max, 4)}) "
            f"| {fmt(window(s, 'frac_reward_zero_std', True, share=1.0), 2)} "
            f"| {', '.join(f'{rule} @ {first[rule]}' for rule in alerts) or 'none'} |"
        )
    return "\n".join(lines)


def verdicts(records: list[dict]) -> str:
    lines = []
    for arm in ARMS:
        runs = [r for r in records if r["arm"] == arm]
        if not runs:
            continue
        after = [r["after"] for r in runs]
        entropy = [window(r["steps"], "entropy", False) or 0.0 for r in runs]
        lines.append(
            f"- **{ARM_LABELS[arm]}**: held-out exact match after RL {min(after):.3f} to {max(after):.3f}; entropy "
            f"in the last tenth {min(entropy):.3f} to {max(entropy):.3f}; runs with an alert: "
            f"{sum(bool(r['alerts']) for r in runs)} of {len(runs)}"
        )
    holdout = {r["seed"]: r for r in records if r["arm"] == "holdout"}
    full = {r["seed"]: r for r in records if r["arm"] == "full"}
    seeds = sorted(holdout.keys() & full.keys())
    if seeds:
        better = sum(holdout[s]["after"] > full[s]["after"] for s in seeds)
        lower = sum(
            (window(full[s]["steps"], "entropy", False) or 0) < (window(holdout[s]["steps"], "entropy", False) or 0)
            for s in seeds
        )
        lines.append(
            f"- holdout above whole-set SFT after RL on {better} of {len(seeds)} seeds; whole-set SFT's entropy "
            f"below the holdout's in the last tenth on {lower} of {len(seeds)} seeds"
        )
    return "\n".join(lines)


def plot(records: list[dict]) -> str:
    from _plots import plot_curves

    curves: dict[str, dict[str, list]] = {}
    for title, key in (("training reward", "reward"), ("entropy", "entropy"), ("KL to the start", "kl")):
        curves[title] = {}
        for arm in ARMS:
            series = []
            for r in (r for r in records if r["arm"] == arm):
                pairs = [(e["step"], e[key]) for e in r["steps"] if key in e]
                series.append(([p[0] for p in pairs], [p[1] for p in pairs]))
            if series:
                curves[title][ARM_LABELS[arm]] = series
    path = plot_curves(curves, SECTION, "Cold start on the copy task", log_panels=("entropy",))
    return f"images/{path.name}"


def render(records: list[dict], args: argparse.Namespace, seconds: float) -> str:
    return "\n\n".join(
        [
            "## Cold start: small holdout vs the whole RL set vs no SFT (issue 46)",
            f"`python benchmarks/cold_start_ablation.py --seeds {' '.join(map(str, args.seeds))} --steps {args.steps}` "
            f"({machine(threads=False)}, {args.threads} torch thread(s); {seconds / 60:.0f} min in all, 2 cores "
            "shared with other studies). The copy task of the judge-credit miniature (5 digits, exact-match reward; "
            "96 SFT, 512 RL and 256 held-out prompts, disjoint). Cold start: full fine-tuning of the tiny Qwen2 "
            "policy, 24 epochs at 3e-3, on the 96 holdout answers, on 512 other prompts' answers, on the 512 RL prompts' "
            "answers, or none. RL: "
            f"`ExtGRPOTrainer`, IPO, LoRA r 8, 8 prompts x 8 rollouts, 2 passes per batch, lr 3e-3 constant, β = "
            f"{KL_BETA}, {args.steps} steps, default monitors (warn only). *No-signal groups*: TRL's "
            "`frac_reward_zero_std`, mean over the generation batches (the share of groups whose rollouts all got "
            "the same reward: advantage 0). "
            "Held-out: 256 prompts, greedy exact match.",
            f"![reward, entropy and KL per step by cold start]({plot(records)})",
            table(records),
            verdicts(records),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temporary dir)")
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    args = parser.parse_args()
    quiet_run(args.threads)
    started = time.perf_counter()
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:
            for arm in args.arms:
                path = workdir / f"{arm}-seed{seed}.json"
                if not path.exists():
                    path.write_text(json.dumps(run_arm(arm, seed, args.steps, workdir)))
                records.append(json.loads(path.read_text()))
                r = records[-1]
                print(f"seed {seed} {arm}: {r['before']:.3f} -> {r['after']:.3f}", flush=True)
    body = render(records, args, time.perf_counter() - started)
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
