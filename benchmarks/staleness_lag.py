"""Staleness at a real lag: IPO vs PPO-clip vs no trust region when every sample is k policy versions old.

Why: in `async_staleness.py` the in-process sampler was slower than the trainer, so samples were at most ~0.7
versions old on average and no trust region had anything to act on. Here a callback sleeps ``--sleep`` seconds after
each optimizer step, so the sampler (a `LocalPolicy`, an in-process copy that receives every weight sync) always
runs ahead up to TRL's ``max_staleness`` = k: the trained samples' lag is k (measured, column *lag*).

The task is the judge-credit miniature's (`trl_ext.quickstart.copy_task`: copy 5 digits), small enough for 5 lags
x 3 losses x 2 learning rates x 3 seeds on two cores, with the dense reward (per-digit accuracy): after the
chat-form cold start the exact match of two seeds' policies is 0.00–0.02, too rare a reward for the policy to move.
Per seed (one process, ``--threads`` torch threads): the miniature's cold-start SFT on chat-form rows
(`_monitors_runs.async_sft_policy`), its held-out per-digit accuracy and exact match (256 prompts never trained on,
greedy), then every arm from that SFT policy: `ExtAsyncGRPOTrainer` with LoRA
(r 8), ``--prompts`` prompts x 8 rollouts a step at temperature 0.7, each sample trained once, no KL term, a constant
learning rate, ``--steps`` steps, the default monitors (warn only); then the held-out figures again.

Losses (``--losses``):

- ``ipo``: the IPO loss as it ships (|p − p_old| ≤ 0.3, ratio band δ = 0.2, ratio cap 8);
- ``dapo``: TRL's PPO-clip (ε = 0.2, token-level ratios);
- ``none``: no trust region: the IPO loss with ``ipo_threshold=1.0`` (no token is ever masked) and no ratio band,
  the importance ratio still capped at 8 (truncated importance sampling, no clipping);
- ``ipo_eps0.1`` and ``region_eps0.1``: IPO with a tighter probability region (ε = 0.1, prime-rl's default), with
  and without the ratio band: which threshold suits which lag (run at k = 2 and 8, the fast learning rate).

Reported per arm: held-out per-digit accuracy before / after (and the gain), the exact match after, the training
reward of the last quarter of the steps, the trust region's share of tokens by lag (IPO: ``ipo/masked_ratio/lag_j``; PPO-clip:
``clip_ratio/region_mean/lag_j``; none: ``ipo/capped_ratio``, the tokens whose ratio hit the cap), the measured lag,
and collapse events: a run *dead* from the step after which every step trained nothing (grad norm 0), and the
default monitors' alerts. The table, verdicts and a plot (benchmarks/images/staleness_lag.png) go into
benchmarks/RESULTS.md; docs/async.md quotes them.

    python benchmarks/staleness_lag.py --seeds 0 1 2 --jobs 3 --workdir W
    python benchmarks/staleness_lag.py --seeds 0 1 2 --jobs 3 --workdir W --ks 2 8 --lrs 6e-3 \
        --losses ipo_eps0.1 region_eps0.1 --no-write                  # the thresholds
    python benchmarks/staleness_lag.py --workdir W --render --losses ipo dapo none ipo_eps0.1 region_eps0.1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _results import machine, quiet_run, write_section  # noqa: E402
from ipo_collapse import dead_at  # noqa: E402

SECTION = "staleness_lag"
DEFAULT_LOSSES = ["ipo", "dapo", "none"]
THRESHOLD_ARMS = ("ipo", "ipo_eps0.1", "region_eps0.1", "none")  # ε 0.3 + band, 0.1 + band, 0.1 alone, 1.0 alone
LOSSES: dict[str, dict[str, Any]] = {
    "ipo": {"loss_type": "ipo"},
    "dapo": {"loss_type": "dapo"},
    "none": {"loss_type": "ipo", "ipo_threshold": 1.0, "ipo_ratio_band": None},
    # the threshold question: a tighter probability region, with and without the ratio band
    "ipo_eps0.1": {"loss_type": "ipo", "ipo_threshold": 0.1},
    "region_eps0.1": {"loss_type": "ipo", "ipo_threshold": 0.1, "ipo_ratio_band": None},
}
LOSS_LABELS = {
    "ipo": "IPO (default)",
    "dapo": "PPO-clip (dapo)",
    "none": "no trust region (ratio cap 8)",
    "ipo_eps0.1": "IPO, ε = 0.1",
    "region_eps0.1": "IPO region alone, ε = 0.1",
}
REGION = {"dapo": "clip_ratio/region_mean", "none": "ipo/capped_ratio"}  # the others: "ipo/masked_ratio"


# ----------------------------------------------------------------------------------------------------- one arm
def held_out(model: Any, tokenizer: Any, eval_set: Any, digits: int) -> dict[str, float]:
    """Greedy held-out per-digit accuracy and exact match of a policy cold-started on chat-form rows (the prompts in
    its chat template)."""
    from trl_ext.quickstart.judge_credit import evaluate_copy

    chat = eval_set.map(
        lambda row: {
            "prompt": tokenizer.apply_chat_template(
                [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
            )
        }
    )
    result = evaluate_copy(model, tokenizer, chat, digits)
    return {"digit_acc": result["digit_acc"], "exact_match": result["exact_match"]}


def run_arm(js: Any, sft: tuple, sft_dir: Path, eval_set: Any, loss: str, k: int, lr: float, args: Any) -> dict:
    """One asynchronous run from the SFT policy at lag ``k``; its per-step log, alerts and held-out figures."""
    from peft import LoraConfig
    from transformers import TrainerCallback

    from trl_ext.callbacks import default_monitors
    from trl_ext.quickstart.copy_task import copy_digit_accuracy_reward
    from trl_ext.quickstart.settings import cpu_run_kwargs
    from trl_ext.quickstart.training import quiet_progress
    from trl_ext.rlm.generators import SamplingSettings
    from trl_ext.trainers import ExtAsyncGRPOConfig, ExtAsyncGRPOTrainer, LocalPolicy

    _, tokenizer, rl_set = sft
    steps: list[dict] = []
    sleep_s = args.sleep

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                steps.append({"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, float)}})

    class Lag(TrainerCallback):
        """Sleeps after each optimizer step: the sampler runs ahead until TRL's max_staleness holds it."""

        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(sleep_s)

    with tempfile.TemporaryDirectory() as output:
        config = ExtAsyncGRPOConfig(
            **cpu_run_kwargs(Path(output), js.seed, progress=False),
            dtype="float32",
            gradient_checkpointing=False,
            max_steps=args.steps,
            learning_rate=lr,
            lr_scheduler_type="constant",
            per_device_train_batch_size=args.prompts * js.num_generations,
            token_budget=0,  # a fixed count of samples per optimizer step
            num_generations=js.num_generations,
            max_inflight_tasks=js.num_generations,  # one group per worker run
            max_staleness=k,
            queue_maxsize=0,  # unbounded: the worker's staleness gate bounds how far ahead it samples
            max_completion_length=js.digits + 2,
            temperature=js.temperature,
            heartbeat_stale_after_s=600.0,
            **LOSSES[loss],
        )
        monitors = default_monitors(action="warn", stop_on_collapse=False, args=config)
        policy = LocalPolicy(str(sft_dir), tokenizer, settings=SamplingSettings.from_trl(config))
        trainer = ExtAsyncGRPOTrainer(
            str(sft_dir),
            [copy_digit_accuracy_reward],
            args=config,
            train_dataset=rl_set,
            processing_class=tokenizer,
            generator=policy,
            peft_config=LoraConfig(
                r=js.lora_r, lora_alpha=js.lora_alpha, lora_dropout=0.0, target_modules="all-linear"
            ),
            callbacks=[*monitors, Record(), Lag()],
        )
        quiet_progress(trainer)
        tick = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - tick
        trained = trainer.accelerator.unwrap_model(trainer.model)
        trained.set_attn_implementation("sdpa")  # TRL's async trainer loads it with its tree kernel: no generate
        scores = held_out(trained, tokenizer, eval_set, js.digits)
    alerts = sorted({(a["rule"], a["step"]) for m in monitors for a in m.alerts}, key=lambda x: x[1])
    return {
        "loss": loss,
        "k": k,
        "lr": lr,
        "steps": steps,
        "alerts": alerts,
        "after": scores["digit_acc"],
        "after_exact": scores["exact_match"],
        "seconds": seconds,
    }


def run_seed(seed: int, args: argparse.Namespace) -> None:
    """Every arm of one seed, in this process; records appended to ``<workdir>/seed<seed>.jsonl`` (an arm already
    there is skipped, so an interrupted seed resumes)."""
    from _monitors_runs import async_sft_policy

    from trl_ext.quickstart.copy_task import copy_task_splits

    quiet_run(args.threads)
    out = args.workdir / f"seed{seed}.jsonl"
    done = {(r["loss"], r["k"], r["lr"]) for r in read_jsonl(out)}
    js, sft, sft_dir = async_sft_policy(seed, args.workdir / f"sft-seed{seed}")
    _, _, eval_set = copy_task_splits(
        js.seed, js.num_sft_examples, js.num_rl_examples, js.num_eval_examples, js.digits
    )
    before_file = args.workdir / f"sft-seed{seed}" / "held_out.json"
    if not before_file.exists():
        before_file.write_text(json.dumps(held_out(sft[0], sft[1], eval_set, js.digits)))
    before = json.loads(before_file.read_text())
    for lr in args.lrs:
        for k in args.ks:
            # At k = 0 every sample is trained by the policy that sampled it: ratio 1, no token masked or clipped,
            # and the three losses are one function (the same gradient): one run stands for them all.
            for loss in args.losses[:1] if k == 0 else args.losses:
                if (loss, k, lr) in done:
                    continue
                record = run_arm(js, sft, sft_dir, eval_set, loss, k, lr, args)
                record |= {"seed": seed, "before": before["digit_acc"], "before_exact": before["exact_match"]}
                with out.open("a") as handle:
                    handle.write(json.dumps(record) + "\n")
                print(f"seed {seed} lr {lr:g} k {k} {loss}: {record['before']:.3f} -> {record['after']:.3f} "
                      f"({record['seconds']:.0f} s)", flush=True)  # fmt: skip


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# ----------------------------------------------------------------------------------------------------- figures
def mean_of(steps: list[dict], key: str, last: float = 1.0) -> float | None:
    """Mean of ``key`` over the last ``last`` share of the steps that logged it (None: never logged)."""
    values = [s[key] for s in steps if key in s]
    values = values[int(len(values) * (1 - last)) :]
    return statistics.fmean(values) if values else None


def by_lag(record: dict) -> str:
    """The trust region's share of tokens per lag j (``<metric>/lag_j``, averaged over the steps), e.g. ``0: 1.2 %,
    1: 3.4 %``; the plain metric where no per-lag metric was logged."""
    metric = REGION.get(record["loss"], "ipo/masked_ratio")
    parts = []
    for lag in range(record["k"] + 1):
        value = mean_of(record["steps"], f"{metric}/lag_{lag}")
        if value is not None:
            parts.append(f"{lag}: {100 * value:.1f} %")
    if parts:
        return ", ".join(parts)
    value = mean_of(record["steps"], metric)
    return "—" if value is None else f"all: {100 * value:.1f} %"


def ipo_split(record: dict) -> str:
    """IPO's masked share split into the tokens its ratio band drops and those its probability region
    (|p − p_old| > ε) drops, means over the steps; "—" for the other losses."""
    masked, band = mean_of(record["steps"], "ipo/masked_ratio"), mean_of(record["steps"], "ipo/band_ratio")
    if record["loss"] in ("dapo", "none") or masked is None or band is None:
        return "—"
    return f"{100 * band:.1f} % / {100 * (masked - band):.1f} %"


def fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def table(records: list[dict]) -> str:
    lines = [
        "| lr | k | loss | seed | held-out digit accuracy, SFT → after | gain | exact match, SFT → after "
        "| train reward, last quarter | trust region by lag (share of tokens) | IPO: band / region "
        "| lag | dead from | alerts |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(records, key=lambda r: (r["lr"], r["k"], list(LOSSES).index(r["loss"]), r["seed"])):
        alerts = ", ".join(f"{rule} @ {step}" for rule, step in r["alerts"]) or "none"
        dead = dead_at(r["steps"])
        label = "any (ratio 1: one function)" if r["k"] == 0 else LOSS_LABELS[r["loss"]]
        lines.append(
            f"| {r['lr']:g} | {r['k']} | {label} | {r['seed']} | {r['before']:.3f} → "
            f"{r['after']:.3f} | {r['after'] - r['before']:+.3f} | {r['before_exact']:.3f} → {r['after_exact']:.3f} | {fmt(mean_of(r['steps'], 'reward', 0.25))} "
            f"| {by_lag(r)} | {ipo_split(r)} | {fmt(mean_of(r['steps'], 'sample/staleness_mean'))} "
            f"| {'alive' if dead is None else f'**{dead}**'} | {alerts} |"
        )
    return "\n".join(lines)


def summary(records: list[dict]) -> str:
    """Per (lr, k): each loss's gain range over seeds, and on how many seeds IPO beat each other loss."""
    lines = []
    for lr in sorted({r["lr"] for r in records}):
        for k in sorted({r["k"] for r in records if r["lr"] == lr}):
            arms = {
                loss: {r["seed"]: r for r in records if (r["lr"], r["k"], r["loss"]) == (lr, k, loss)}
                for loss in LOSSES
            }
            parts = []
            for loss, runs in arms.items():
                if not runs:
                    continue
                gains = [r["after"] - r["before"] for r in runs.values()]
                dead = sum(dead_at(r["steps"]) is not None for r in runs.values())
                parts.append(
                    f"{LOSS_LABELS[loss] if k else 'every loss (ratio 1)'} {min(gains):+.3f} to {max(gains):+.3f} (mean {statistics.fmean(gains):+.3f}"
                    f"{f', dead {dead}/{len(runs)}' if dead else ''})"
                )
            wins = []
            for other in ("dapo", "none"):
                seeds = sorted(arms["ipo"].keys() & arms[other].keys())
                if seeds:
                    won = sum(arms["ipo"][s]["after"] > arms[other][s]["after"] for s in seeds)
                    wins.append(f"IPO above {LOSS_LABELS[other]} on {won} of {len(seeds)} seeds")
            lines.append(f"- lr {lr:g}, k = {k}: gain " + "; ".join(parts) + (". " + "; ".join(wins) if wins else ""))
    return "\n".join(lines)


def lag_share(record: dict) -> float | None:
    """The trust region's share of the tokens at the run's own lag k (its steady state), mean over the steps."""
    return mean_of(record["steps"], f"{REGION.get(record['loss'], 'ipo/masked_ratio')}/lag_{record['k']}")


def verdicts(records: list[dict]) -> str:
    """What holds on every seed, and what does not: the trust region's share against the lag, a trust region
    against none, IPO against PPO-clip."""
    seeds = sorted({r["seed"] for r in records})
    lines = []
    for lr in sorted({r["lr"] for r in records}):
        runs = {(r["loss"], r["k"], r["seed"]): r for r in records if r["lr"] == lr}
        ks = sorted({k for _, k, _ in runs if k > 0})
        for loss in ("ipo", "dapo"):
            loss_ks = [k for k in ks if all((loss, k, s) in runs for s in seeds)]
            if not loss_ks:
                continue
            shares = {s: [lag_share(runs[loss, k, s]) or 0.0 for k in loss_ks] for s in seeds}
            rising = sum(all(b > a for a, b in zip(v, v[1:])) for v in shares.values())
            spans = ", ".join(
                f"k = {k}: {min(v[i] for v in shares.values()) * 100:.1f}–{max(v[i] for v in shares.values()) * 100:.1f} %"
                for i, k in enumerate(loss_ks)
            )
            lines.append(
                f"- lr {lr:g}, {LOSS_LABELS[loss]}: share of the lag-k tokens it acts on {spans}; rising with k on "
                f"{rising} of {len(seeds)} seeds"
            )
        for k in ks:
            pairs = [(runs.get(("ipo", k, s)), runs.get(("dapo", k, s)), runs.get(("none", k, s))) for s in seeds]
            pairs = [p for p in pairs if None not in p]
            if not pairs:
                continue
            gain = [[r["after"] - r["before"] for r in p] for p in pairs]
            both = sum(g[0] > g[2] and g[1] > g[2] for g in gain)
            worst_none = min(g[2] for g in gain)
            lines.append(
                f"- lr {lr:g}, k = {k}: IPO and PPO-clip both above no trust region on {both} of {len(pairs)} seeds "
                f"(no trust region's worst gain {worst_none:+.3f}); IPO − PPO-clip "
                f"{min(g[0] - g[1] for g in gain):+.3f} to {max(g[0] - g[1] for g in gain):+.3f}"
            )
    for lr in sorted({r["lr"] for r in records}):
        for k in sorted({r["k"] for r in records if r["k"] > 0}):
            arms = {
                loss: [r for r in records if (r["lr"], r["k"], r["loss"]) == (lr, k, loss)] for loss in THRESHOLD_ARMS
            }
            if not all(len(runs) == len(seeds) for runs in arms.values()):
                continue
            parts = []
            for loss, runs in arms.items():
                gains = [r["after"] - r["before"] for r in runs]
                shares = [lag_share(r) for r in runs]
                acts = (
                    "masks nothing"
                    if None in shares
                    else f"acts on {100 * min(shares):.1f}–{100 * max(shares):.1f} % of the lag-k tokens"
                )
                parts.append(f"{LOSS_LABELS[loss]} gain {min(gains):+.3f} to {max(gains):+.3f}, {acts}")
            lines.append(f"- thresholds, lr {lr:g}, k = {k}: " + "; ".join(parts))
    dead = [r for r in records if dead_at(r["steps"]) is not None]
    collapses = sorted({(r["lr"], r["k"], r["loss"], r["seed"]) for r in records for rule, _ in r["alerts"]
                        if rule in ("reward_collapse", "entropy_collapse")})  # fmt: skip
    lines.append(
        f"- dead runs: {len(dead)} of {len(records)}; collapse alerts (reward or entropy): "
        + (", ".join(f"lr {lr:g} k = {k} {LOSS_LABELS[loss]} seed {s}" for lr, k, loss, s in collapses) or "none")
    )
    return "\n".join(lines)


def plot(records: list[dict]) -> str | None:
    """Held-out gain and trust-region share against the lag, per loss and learning rate (mean and range over
    seeds): benchmarks/images/staleness_lag.png."""
    from _plots import plot_curves

    curves: dict[str, dict[str, list]] = {}
    for lr in sorted({r["lr"] for r in records}):
        gain: dict[str, list] = {}
        region: dict[str, list] = {}
        for loss in LOSSES:
            for seed in sorted({r["seed"] for r in records}):
                runs = sorted(
                    (r for r in records if (r["lr"], r["seed"]) == (lr, seed) and (r["loss"] == loss or r["k"] == 0)),
                    key=lambda r: r["k"],
                )  # the k = 0 run stands for every loss
                if not runs:
                    continue
                ks = [r["k"] for r in runs]
                gain.setdefault(LOSS_LABELS[loss], []).append((ks, [r["after"] - r["before"] for r in runs]))
                shares = [100 * (mean_of(r["steps"], REGION.get(loss, "ipo/masked_ratio")) or 0.0) for r in runs]
                region.setdefault(LOSS_LABELS[loss], []).append((ks, shares))
        curves[f"held-out digit accuracy gain, lr {lr:g}"] = gain
        curves[f"trust region acts on (% of tokens), lr {lr:g}"] = region
    if not any(curves.values()):
        return None
    path = plot_curves(curves, SECTION, "Staleness at a real lag k (copy task)", xlabel="lag k (policy versions)")
    return f"images/{path.name}"


def render(records: list[dict], args: argparse.Namespace, seconds: float | None) -> str:
    image = plot(records)
    took = "" if seconds is None else f"; {seconds / 60:.0f} min in all"

    def command(losses: list[str]) -> str:
        runs = [r for r in records if r["loss"] in losses and (r["k"] or losses == DEFAULT_LOSSES)]
        ks, lrs = sorted({r["k"] for r in runs}), sorted({r["lr"] for r in runs})
        return (
            f"`python benchmarks/staleness_lag.py --seeds {' '.join(map(str, args.seeds))} --ks "
            f"{' '.join(map(str, ks))} --lrs {' '.join(f'{x:g}' for x in lrs)}"
            + ("" if losses == DEFAULT_LOSSES else f" --losses {' '.join(losses)}")
            + f" --steps {args.steps} --prompts {args.prompts} --sleep {args.sleep:g} --threads {args.threads} "
            f"--jobs {args.jobs}`"
        )

    extra = [loss for loss in LOSSES if loss not in DEFAULT_LOSSES and any(r["loss"] == loss for r in records)]
    parts = [
        "## Staleness at a real lag: IPO vs PPO-clip vs no trust region (issue 46)",
        command(DEFAULT_LOSSES)
        + (f", and for the thresholds {command(extra)}" if extra else "")
        + f" ({machine(threads=False)}{took}, 2 cores shared with other studies). The judge-credit miniature's copy "
        "task (5 digits, reward: per-digit accuracy) on `ExtAsyncGRPOTrainer` from each seed's cold-start SFT policy: LoRA "
        f"r 8, {args.prompts} prompts x 8 rollouts a step at temperature 0.7, each sample trained once, no KL term, "
        f"constant learning rate, {args.steps} steps; a `LocalPolicy` samples (synced every step) and a callback "
        f"sleeps {args.sleep:g} s after each optimizer step, so the sampler runs ahead until `max_staleness` = k "
        "stops it. *Trust region by lag*: the share of tokens of each lag j that IPO masks / PPO-clip clips "
        "(`<metric>/lag_j`, mean over steps); for *no trust region*, the share whose ratio hit the cap of 8 "
        "(`ipo/capped_ratio`). *IPO: band / region*: IPO's masked share split into the tokens its ratio band (δ = "
        "0.2) drops and those its probability region (|p − p_old| > 0.3) drops, means over all steps. *Lag*: the mean version lag of the trained samples (`sample/staleness_mean`). "
        "*Dead from*: the step after which every step trained nothing (grad norm 0). *Alerts*: the default "
        "monitors (warn only). Held-out: 256 prompts never trained on, greedy per-digit accuracy and exact match.",
    ]
    if image:
        parts.append(f"![held-out gain and trust-region share against the lag]({image})")
    parts += [table(records), summary(records), verdicts(records)]
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4, 8], help="max_staleness values (lags)")
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-2], help="constant learning rates")
    parser.add_argument("--losses", nargs="+", default=DEFAULT_LOSSES, choices=list(LOSSES))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per optimizer step (8 rollouts each)")
    parser.add_argument("--sleep", type=float, default=1.0, help="seconds slept after each optimizer step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per seed's process")
    parser.add_argument("--jobs", type=int, default=1, help="seeds run at once (one process each)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temporary dir)")
    parser.add_argument("--render", action="store_true", help="only render the table from --workdir's runs")
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    parser.add_argument("--one-seed", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    if args.one_seed is not None:
        run_seed(args.one_seed, args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        args.workdir = args.workdir or Path(tmp)
        args.workdir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        if not args.render:
            forwarded = [a for a in sys.argv[1:] if a != "--no-write"]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}

            def one(seed: int) -> None:
                command = [
                    sys.executable,
                    __file__,
                    *forwarded,
                    "--workdir",
                    str(args.workdir),
                    "--one-seed",
                    str(seed),
                ]
                subprocess.run(command, env=env, check=True)

            with ThreadPoolExecutor(args.jobs) as pool:
                list(pool.map(one, args.seeds))
        records = [r for seed in args.seeds for r in read_jsonl(args.workdir / f"seed{seed}.jsonl")]
        records = [r for r in records if r["lr"] in args.lrs and r["k"] in args.ks and r["loss"] in args.losses]
        body = render(records, args, None if args.render else time.perf_counter() - started)
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
