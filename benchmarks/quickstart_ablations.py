"""Quickstart ablations: does each method matter, in miniature? The stepwise-RLM quickstart's RL stage run three
ways from the same SFT policy, seed by seed.

Arms (each from the seed's SFT policy, with the same RL seed, data and held-out evaluation):

- ``default``: the quickstart as it ships: IPO loss, children weighted 1/k_g (``rlm_loss_normalization="subtree"``);
- ``token``: 1/k_g off: every action token of every node counts the same (``rlm_loss_normalization="token"``). On
  the delegating task the children write most of the tokens: does the root's own behaviour (delegating) still
  improve when they dominate?
- ``dapo``: PPO-clip (``loss_type="dapo"``, TRL's token-level clipped ratio) instead of the IPO masking loss, with
  the same 4 optimizer steps per generation (the later ones off-policy).

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
ARMS: dict[str, dict[str, str]] = {
    "default": {},
    "token": {"rlm_loss_normalization": "token"},
    "dapo": {"loss_type": "dapo"},
}
ARM_LABELS = {
    "default": "IPO, 1/k_g (default)",
    "token": "IPO, plain token mean",
    "dapo": "PPO-clip (dapo), 1/k_g",
}


def worker(seed: int, arms: list[str], workdir: Path) -> None:
    """One seed in this process: the cold start once, then every arm; writes ``seed{S}.json``."""
    from trl_ext.quickstart import QuickstartSettings
    from trl_ext.quickstart.runner import prepare_output_dir
    from trl_ext.quickstart.stepwise import cold_start, reinforce
    from trl_ext.quickstart.training import fresh_copy

    settings = QuickstartSettings.default(seed)
    root = prepare_output_dir(workdir / f"seed{seed}")
    started = time.perf_counter()
    start = cold_start(root, settings, progress=False, say=print)
    record = {
        "seed": seed,
        "threads": int(os.environ.get("OMP_NUM_THREADS", "0")),
        "cold_start_s": time.perf_counter() - started,
        "before": dataclasses.asdict(start.before),
        "arms": {},
    }
    sft_model = start.model
    for arm in arms:
        arm_settings = dataclasses.replace(settings, **ARMS[arm])
        tick = time.perf_counter()
        result = reinforce(
            dataclasses.replace(start, model=fresh_copy(sft_model)),
            prepare_output_dir(root / arm),
            arm_settings,
            fast=False,
            progress=False,
            say=print,
        )
        record["arms"][arm] = {
            "after": dataclasses.asdict(result.after),
            "rl_s": time.perf_counter() - tick,
            "masked_ratio_mean": result.trust_region_mean,
            "alerts": result.alerts,
        }
        (workdir / f"seed{seed}.json").write_text(json.dumps(record, indent=1))


def run_seed(seed: int, arms: list[str], workdir: Path, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, __file__, "--worker", str(seed), "--arms", *arms, "--workdir", str(workdir)]
    with (workdir / f"seed{seed}.log").open("w") as log:
        code = subprocess.call(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        raise RuntimeError(f"seed {seed} failed (exit {code}); see {workdir / f'seed{seed}.log'}")
    return json.loads((workdir / f"seed{seed}.json").read_text())


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def table(records: list[dict], command: str) -> str:
    """The RESULTS.md section: one row per (seed, arm), then each arm's range of gains."""
    threads = sorted({record["threads"] for record in records})
    from trl_ext.quickstart import QuickstartSettings

    evaluation = QuickstartSettings.default()
    lines = [
        "## Quickstart ablations: 1/k_g, IPO and the RLM lesson in miniature",
        "",
        f"`{command}` ({machine(threads=False)}, {os.cpu_count()} CPUs, {'/'.join(map(str, threads))} torch "
        "thread(s) per run). Per seed: one cold start (the SFT policy and its held-out evaluation, the 'SFT only' "
        "column), then each arm's RL stage from a copy of that policy with the same RL seed. Held-out: "
        f"{evaluation.num_eval_examples} tasks x {evaluation.eval_samples} samples never seen in SFT or RL. *Root delegates*: the share of roots that called `rlm_query_batched`; "
        "*children right*: the share of children whose answer is their part's value; *child tokens*: the children's "
        "share of all action tokens after RL.",
        "",
        "| seed | arm | held-out reward, SFT only → after RL | gain | root delegates | children per root | "
        "children right | children using the lookup program | child tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    gains: dict[str, list[float]] = {}
    delegation: dict[str, list[float]] = {}
    for record in sorted(records, key=lambda r: r["seed"]):
        before = record["before"]
        for arm, result in record["arms"].items():
            after = result["after"]
            gain = after["reward"] - before["reward"]
            gains.setdefault(arm, []).append(gain)
            delegate_before = before["strategies"].get("delegate", 0.0)
            delegate_after = after["strategies"].get("delegate", 0.0)
            delegation.setdefault(arm, []).append(delegate_after - delegate_before)
            lookup = [
                None if part["child_answer_rate"] is None else part["child_strategies"].get("lookup", 0.0)
                for part in (before, after)
            ]
            lines.append(
                f"| {record['seed']} | {ARM_LABELS[arm]} | {before['reward']:.3f} → {after['reward']:.3f} | "
                f"**{gain:+.3f}** | {_pct(delegate_before)} → {_pct(delegate_after)} | "
                f"{before['children_mean']:.2f} → {after['children_mean']:.2f} | "
                f"{_pct(before['child_correct_rate'])} → {_pct(after['child_correct_rate'])} | "
                f"{_pct(lookup[0])} → {_pct(lookup[1])} | {_pct(after['child_token_share'])} |"
            )
    lines.append("")
    ordered = sorted(records, key=lambda r: r["seed"])
    for arm in [arm for arm in gains if arm != "default" and "default" in gains]:
        reward = [r["arms"][arm]["after"]["reward"] - r["arms"]["default"]["after"]["reward"] for r in ordered]
        delegate = [
            r["arms"][arm]["after"]["strategies"].get("delegate", 0.0)
            - r["arms"]["default"]["after"]["strategies"].get("delegate", 0.0)
            for r in ordered
        ]
        lines.append(
            f"- {ARM_LABELS[arm]} minus the default, seed by seed ({', '.join(str(r['seed']) for r in ordered)}): "
            f"held-out reward after RL {' / '.join(f'{v:+.3f}' for v in reward)}; roots delegating after RL "
            f"{' / '.join(f'{100 * v:+.0f}' for v in delegate)} points."
        )
    for arm, values in gains.items():
        lines.append(
            f"- **{ARM_LABELS[arm]}**: gain {min(values):+.3f} to {max(values):+.3f} (mean "
            f"{statistics.fmean(values):+.3f}); root delegation {100 * min(delegation[arm]):+.0f} to "
            f"{100 * max(delegation[arm]):+.0f} points, over seeds "
            f"{', '.join(str(r['seed']) for r in sorted(records, key=lambda r: r['seed']))}."
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads per seed's process")
    parser.add_argument("--jobs", type=int, default=1, help="seeds run at once")
    parser.add_argument("--workdir", default=None, help="keep the runs here")
    parser.add_argument("--render", action="store_true", help="no new runs: the table from --workdir's records")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="quickstart-ablations-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.worker is not None:
        worker(args.worker, args.arms, workdir)
        return
    if args.render:
        records = [json.loads((workdir / f"seed{seed}.json").read_text()) for seed in args.seeds]
    else:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            records = list(pool.map(lambda s: run_seed(s, args.arms, workdir, args.threads), args.seeds))
    command = (
        f"python benchmarks/quickstart_ablations.py --seeds {' '.join(map(str, args.seeds))} --threads {args.threads} "
        f"--jobs {args.jobs}"
    )
    body = table(records, command)
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
