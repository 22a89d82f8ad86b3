"""Quickstart ablations: does each method matter, in miniature? The stepwise-RLM quickstart's RL stage run several
ways from the same SFT policy, seed by seed.

Arms (each from the seed's SFT policy, with the same RL seed, data and held-out evaluation):

- ``default``: the quickstart as it ships: IPO loss, children weighted 1/k_g (``rlm_loss_normalization="subtree"``),
  a cosine learning-rate schedule;
- ``token``: 1/k_g off: every action token of every node counts the same (``rlm_loss_normalization="token"``). On
  the delegating task the children write most of the tokens: does the root's own behaviour (delegating) still
  improve when they dominate?
- ``dapo``: PPO-clip (``loss_type="dapo"``, TRL's token-level clipped ratio) instead of the IPO masking loss, with
  the same 4 optimizer steps per generation (the later ones off-policy).
- ``constant``: a constant learning rate instead of the cosine schedule (the default until a run on another CPU's
  kernels threw its policy off in the last passes over a generation batch).

Each seed runs in a fresh process (``OMP_NUM_THREADS`` = ``--threads``): data, teacher traces, cold-start SFT and
the SFT-only evaluation once, then the arms one after the other on copies of the SFT model. The table, with the
seeds it used, goes into ``benchmarks/RESULTS.md`` and docs/quickstart.md quotes it.

    python benchmarks/quickstart_ablations.py --seeds 0 1 2 --jobs 2
    python benchmarks/quickstart_ablations.py --workdir DIR --render      # the table again from DIR's runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _results import machine, write_section  # noqa: E402

SECTION = "quickstart_ablations"
TITLE = "Quickstart ablations: 1/k_g, IPO, the learning-rate schedule and the RLM lesson in miniature"
ARMS: dict[str, dict[str, str]] = {
    "default": {},
    "token": {"rlm_loss_normalization": "token"},
    "dapo": {"loss_type": "dapo"},
    "constant": {"rl_lr_scheduler": "constant"},
}
ARM_LABELS = {
    "default": "IPO, 1/k_g, cosine learning rate (default)",
    "token": "IPO, plain token mean",
    "dapo": "PPO-clip (dapo), 1/k_g",
    "constant": "IPO, 1/k_g, constant learning rate",
}
NATIVE = "native"  # torch's own choice of vectorised CPU kernels (ATEN_CPU_CAPABILITY unset)


def record_name(seed: int, kernels: str) -> str:
    return f"seed{seed}" + ("" if kernels == NATIVE else f"-{kernels}")


def stability(output: Path) -> dict[str, float]:
    """The largest KL to the reference and gradient norm an arm's run logged (``trainer_state.json``)."""
    history = json.loads((output / "trainer_state.json").read_text())["log_history"]
    logged = [entry for entry in history if "loss" in entry]
    return {
        "kl_max": max((entry.get("kl", 0.0) for entry in logged), default=0.0),
        "grad_norm_max": max((entry.get("grad_norm", 0.0) for entry in logged), default=0.0),
    }


def worker(seed: int, arms: list[str], workdir: Path, kernels: str) -> None:
    """One seed in this process: the cold start once, then every arm; writes ``seed{S}[-kernels].json``."""
    from trl_ext.quickstart import QuickstartSettings, quickstart_run_info
    from trl_ext.quickstart.runner import prepare_output_dir
    from trl_ext.quickstart.stepwise import cold_start, reinforce
    from trl_ext.quickstart.training import fresh_copy
    from trl_ext.run_info import write_run_info

    settings = QuickstartSettings.default(seed)
    name = record_name(seed, kernels)
    root = prepare_output_dir(workdir / name)
    started = time.perf_counter()
    start = cold_start(root, settings, progress=False, say=print)
    record = {
        "seed": seed,
        "kernels": kernels,
        "threads": int(os.environ.get("OMP_NUM_THREADS", "0")),
        "cold_start_s": time.perf_counter() - started,
        "before": dataclasses.asdict(start.before),
        "arms": {},
    }
    sft_model = start.model
    for arm in arms:
        arm_settings = dataclasses.replace(settings, **ARMS[arm])
        tick = time.perf_counter()
        output = prepare_output_dir(root / arm)
        result = reinforce(
            dataclasses.replace(start, model=fresh_copy(sft_model)),
            output,
            arm_settings,
            fast=False,
            progress=False,
            say=print,
        )
        write_run_info(output, quickstart_run_info(result, arm_settings))  # monitors_eval --stepwise-logs reads it
        record["arms"][arm] = {
            "after": dataclasses.asdict(result.after),
            "rl_s": time.perf_counter() - tick,
            "masked_ratio_mean": result.trust_region_mean,
            "alerts": result.alerts,
            **stability(output),
        }
        (workdir / f"{name}.json").write_text(json.dumps(record, indent=1))


def run_seed(seed: int, kernels: str, arms: list[str], workdir: Path, threads: int) -> dict:
    """One seed in a fresh process with ``threads`` torch threads and ``kernels`` (an ``ATEN_CPU_CAPABILITY`` value,
    or `NATIVE`: another CPU's rounding, reproduced)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if kernels != NATIVE:
        env["ATEN_CPU_CAPABILITY"] = kernels
        # torch's compile cache is not keyed on ATEN_CPU_CAPABILITY: a kernel compiled under AVX2 and read back on
        # AVX-512 gave FlexAttention log-probs 4 nats off (tests/test_packing.py). Each kernel family its own cache.
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / f"trl-ext-inductor-{kernels}")
    name = record_name(seed, kernels)
    command = [sys.executable, __file__, "--worker", str(seed), "--kernels", kernels, "--arms", *arms]
    command += ["--workdir", str(workdir)]
    with (workdir / f"{name}.log").open("w") as log:
        code = subprocess.call(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        raise RuntimeError(f"{name} failed (exit {code}); see {workdir / f'{name}.log'}")
    return json.loads((workdir / f"{name}.json").read_text())


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def run_name(record: dict) -> str:
    """A record's run: its seed and, where not `NATIVE`, its kernels."""
    kernels = record.get("kernels", NATIVE)
    return f"{record['seed']}" + ("" if kernels == NATIVE else f" ({kernels})")


def table(records: list[dict], command: str, title: str) -> str:
    """The RESULTS.md section: one row per (seed, kernels, arm), then each arm against the default, run by run, and
    each arm's range of gains, largest KL and alerts."""
    threads = sorted({record["threads"] for record in records})
    from trl_ext.quickstart import QuickstartSettings

    evaluation = QuickstartSettings.default()
    records = sorted(records, key=lambda r: (r["seed"], r.get("kernels", NATIVE) != NATIVE, r.get("kernels", "")))
    lines = [
        f"## {title}",
        "",
        f"`{command}` ({machine(threads=False)}, {os.cpu_count()} CPUs, {'/'.join(map(str, threads))} torch "
        "thread(s) per run). Per seed and kernels (`ATEN_CPU_CAPABILITY`; native: torch's choice for this CPU): one "
        "cold start (the SFT policy and its held-out evaluation, the 'SFT only' column), then each arm's RL stage "
        "from a copy of that policy with the same RL seed. Held-out: "
        f"{evaluation.num_eval_examples} tasks x {evaluation.eval_samples} samples never seen in SFT or RL. *Root "
        "delegates*: the share of roots that called `rlm_query_batched`; *children right*: the share of children "
        "whose answer is their part's value; *KL max*, *grad norm max*: the largest KL to the SFT policy and "
        "gradient norm (before clipping at 1.0) the run logged; *alerts*: what the default monitors raised.",
        "",
        "| seed (kernels) | arm | held-out reward, SFT only → after RL | gain | root delegates | children per root | "
        "children right | children using the lookup program | KL max | grad norm max | alerts |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for record in records:
        before = record["before"]
        for arm, result in record["arms"].items():
            after = result["after"]
            lookup = [
                None if part["child_answer_rate"] is None else part["child_strategies"].get("lookup", 0.0)
                for part in (before, after)
            ]
            alerts = ", ".join(f"{rule} x{n}" for rule, n in result["alerts"].items() if n) or "none"
            lines.append(
                f"| {run_name(record)} | {ARM_LABELS[arm]} | {before['reward']:.3f} → {after['reward']:.3f} | "
                f"**{after['reward'] - before['reward']:+.3f}** | "
                f"{_pct(before['strategies'].get('delegate', 0.0))} → {_pct(after['strategies'].get('delegate', 0.0))} | "
                f"{before['children_mean']:.2f} → {after['children_mean']:.2f} | "
                f"{_pct(before['child_correct_rate'])} → {_pct(after['child_correct_rate'])} | "
                f"{_pct(lookup[0])} → {_pct(lookup[1])} | {result['kl_max']:.3f} | {result['grad_norm_max']:.2f} | "
                f"{alerts} |"
            )
    lines.append("")
    arms = list(dict.fromkeys(arm for record in records for arm in record["arms"]))
    for arm in [arm for arm in arms if arm != "default"]:
        both = [r for r in records if arm in r["arms"] and "default" in r["arms"]]
        reward = [r["arms"][arm]["after"]["reward"] - r["arms"]["default"]["after"]["reward"] for r in both]
        if both:
            lines.append(
                f"- {ARM_LABELS[arm]} minus the default, run by run ({', '.join(run_name(r) for r in both)}): "
                f"held-out reward after RL {' / '.join(f'{v:+.3f}' for v in reward)} (mean "
                f"{statistics.fmean(reward):+.3f})."
            )
    for arm in arms:
        mine = [r["arms"][arm] | {"before": r["before"]} for r in records if arm in r["arms"]]
        runs = ", ".join(run_name(r) for r in records if arm in r["arms"])
        gains = [m["after"]["reward"] - m["before"]["reward"] for m in mine]
        delegation = [
            m["after"]["strategies"].get("delegate", 0.0) - m["before"]["strategies"].get("delegate", 0.0)
            for m in mine
        ]
        alerted = sum(any(m["alerts"].values()) for m in mine)
        lines.append(
            f"- **{ARM_LABELS[arm]}**: gain {min(gains):+.3f} to {max(gains):+.3f} (mean {statistics.fmean(gains):+.3f}); "
            f"root delegation {100 * min(delegation):+.0f} to {100 * max(delegation):+.0f} points; KL max "
            f"{min(m['kl_max'] for m in mine):.3f} to {max(m['kl_max'] for m in mine):.3f}; runs with an alert "
            f"{alerted} of {len(mine)}; over runs {runs}."
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads per seed's process")
    parser.add_argument(
        "--kernels", nargs="+", default=[NATIVE], help=f"ATEN_CPU_CAPABILITY values ({NATIVE}: torch's choice)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="seeds run at once")
    parser.add_argument("--workdir", default=None, help="keep the runs here")
    parser.add_argument("--render", action="store_true", help="no new runs: the table from --workdir's records")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    parser.add_argument("--section", default=SECTION, help="the RESULTS.md section to write (and its title)")
    parser.add_argument("--title", default=TITLE, help="the section's heading")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="quickstart-ablations-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.worker is not None:
        worker(args.worker, args.arms, workdir, args.kernels[0])
        return
    jobs = [(seed, kernels) for seed in args.seeds for kernels in args.kernels]
    if args.render:
        records = [json.loads((workdir / f"{record_name(*job)}.json").read_text()) for job in jobs]
    else:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            records = list(pool.map(lambda job: run_seed(*job, args.arms, workdir, args.threads), jobs))
    command = (
        f"python benchmarks/quickstart_ablations.py --seeds {' '.join(map(str, args.seeds))} --kernels "
        f"{' '.join(args.kernels)} --arms {' '.join(args.arms)} --threads {args.threads} --jobs {args.jobs}"
    )
    if args.section != SECTION:
        command += f" --section {args.section} --title '{args.title}'"
    body = table(records, command, args.title)
    print(body)
    if not args.no_write:
        write_section(args.section, body)


if __name__ == "__main__":
    main()
