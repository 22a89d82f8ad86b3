"""1/k_g on deliberately uneven trees: does the "subtree" loss normalisation beat a plain token mean when rollout trees
differ widely in size?

Stepwise RLM training makes every turn of every node of a rollout tree a training sample, and every child inherits
its root's advantage. With ``rlm_loss_normalization="subtree"`` (the default) node v carries ``W(v) = Π 1/k_a`` over
its ancestors a (k_a: the children a spawned), spread over its action tokens, so every root counts once and its
children together count as much as it does; with ``"token"`` every action token of every node counts the same, so a
root that spawns six children is outweighed by them, and a tree with six children outweighs one without. The quickstart
ablation (`quickstart_ablations.py`, arm ``token``) found no edge for 1/k_g on the quickstart's even trees (2–3
children). Here the trees are uneven on purpose: the toy task's contexts have 1, 2, 5 or 6 parts
(`make_toy_dataset(parts_counts=(1, 2, 5, 6))`), so a delegating root spawns 1, 2, 5 or 6 children and a reading root
none. A one-part context is one the root can read whole (its part fits in the REPL's `TOY_OUTPUT_CHARS`); from two
parts on it cannot. The scaffold's children limits are raised to 6 for this (the quickstart's 4 would refuse a
six-part delegation).

Per seed, in a fresh process with one torch thread: uneven data, the scripted teacher's traces, cold-start SFT and the
SFT-only held-out evaluation once; then each arm (``subtree``, ``token``) runs the quickstart's RL stage
(`trl_ext.quickstart.stepwise.reinforce`: IPO, LoRA, cosine learning rate) from a copy of that SFT policy with the same
RL seed and data, and the same held-out evaluation. ``--steps``, ``--prompts`` and ``--generations`` shrink the RL
stage to fit a shared CPU. The section "uneven_trees" of benchmarks/RESULTS.md and benchmarks/images/uneven_trees.png
are written from it.

    python benchmarks/uneven_trees.py --seeds 0 1 2 --steps 28 --prompts 4 --generations 8   # about 25 min, 1 thread
    python benchmarks/uneven_trees.py --seeds 0 --steps 8 --generations 6 --no-write             # a quick look, 4 min
    python benchmarks/uneven_trees.py --workdir DIR --render                 # the section and plot again from DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _results import machine, quiet_run, write_section  # noqa: E402

SECTION = "uneven_trees"
TITLE = "1/k_g on deliberately uneven trees (1, 2, 5 or 6 parts per context)"
PARTS_COUNTS = (1, 2, 5, 6)
MANY_PARTS = 5  # contexts with at least this many parts are "many"; the others (1-2) "few"
MAX_CHILDREN = max(PARTS_COUNTS)
ARMS = {"subtree": {"rlm_loss_normalization": "subtree"}, "token": {"rlm_loss_normalization": "token"}}
ARM_LABELS = {"subtree": "subtree (1/k_g, default)", "token": "token (plain token mean)"}
_ITEMS_RE = re.compile(r"a list of (\d+) items")


def reward_by_parts(trees_file: str) -> dict[str, float]:
    """Held-out reward over the evaluation's rollouts with few (1-2) and many (5-6) parts."""
    split: dict[str, list[float]] = {"few": [], "many": []}
    with open(trees_file, encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            parts = len(record["answer"].split(","))
            split["many" if parts >= MANY_PARTS else "few"].append(record["reward"])
    return {name: statistics.fmean(values) if values else float("nan") for name, values in split.items()}


def standard_error(trees_file: str) -> float | None:
    """The standard error of an evaluation's mean reward over its rollouts (None when its file is gone)."""
    if not Path(trees_file).exists():
        return None
    with open(trees_file, encoding="utf-8") as handle:
        rewards = [json.loads(line)["reward"] for line in handle]
    return statistics.stdev(rewards) / len(rewards) ** 0.5


def tree_parts(tree: Any) -> int:
    """The parts of a tree's context, read from the root's context description ("a list of 6 items (...)")."""
    match = _ITEMS_RE.search(tree.root.context_description)
    return int(match.group(1)) if match else 0


def weight_shares(trees: list) -> dict[str, float]:
    """How a batch of trees splits the loss: the children's share and the many-part trees' share of the loss weight
    under "subtree" (Σ W(v): each root 1, its children together 1) and of the action tokens (what "token" weighs)."""
    weight = {"all": 0.0, "children": 0.0, "many": 0.0}
    tokens = {"all": 0.0, "children": 0.0, "many": 0.0}
    for tree in trees:
        many = tree_parts(tree) >= MANY_PARTS
        for node, w in zip(tree.nodes, tree.weights()):
            n = sum(len(turn.action_ids) for turn in node.turns)
            if not n:
                continue  # a node without action tokens is no training sample
            weight["all"] += w
            tokens["all"] += n
            if node.depth > 0:
                weight["children"] += w
                tokens["children"] += n
            if many:
                weight["many"] += w
                tokens["many"] += n
    return {
        "children_weight_share": weight["children"] / max(weight["all"], 1e-12),
        "children_token_share": tokens["children"] / max(tokens["all"], 1e-12),
        "many_weight_share": weight["many"] / max(weight["all"], 1e-12),
        "many_token_share": tokens["many"] / max(tokens["all"], 1e-12),
    }


def training_trees(output: Path) -> dict[int, list]:
    """The RL stage's rollout trees by the optimizer step they were sampled at (``rlm_trees/train-v*.jsonl``)."""
    from trl_ext.rlm.tree import RolloutTree
    from trl_ext.rlm.tree_files import TreeFile

    by_step: dict[int, list] = {}
    for path in sorted((output / "rlm_trees").glob("*.jsonl")):
        name = TreeFile.parse(path.name)
        if name is None or name.mode != "train":
            continue
        with path.open(encoding="utf-8") as handle:
            by_step.setdefault(name.version, []).extend(RolloutTree.from_dict(json.loads(line)) for line in handle)
    return by_step


def training_curves(output: Path) -> dict[str, list]:
    """Per optimizer step: the training reward (log history) and, per generation batch, the roots' delegation rate,
    children per root and the weight shares."""
    from trl_ext.quickstart.toy_task import classify_root

    history = json.loads((output / "trainer_state.json").read_text())["log_history"]
    reward = [(entry["step"], entry["reward"]) for entry in history if "reward" in entry and "step" in entry]
    batches = []
    all_trees = []
    for step, trees in sorted(training_trees(output).items()):
        all_trees.extend(trees)
        batches.append(
            {
                "step": step,
                "delegation": sum(classify_root(t) == "delegate" for t in trees) / len(trees),
                "children_mean": statistics.fmean(len(t.nodes) - 1 for t in trees),
                "children_max": max(len(t.nodes) - 1 for t in trees),
                **weight_shares(trees),
            }
        )
    children = sorted({len(t.nodes) - 1 for t in all_trees})
    return {"reward": reward, "batches": batches, "overall": weight_shares(all_trees), "children_counts": children}


def worker(seed: int, arms: list[str], workdir: Path, overrides: dict[str, Any]) -> None:
    """One seed in this process: the uneven cold start once, then every arm; writes ``seed{S}.json``."""
    import torch

    from trl_ext.quickstart import QuickstartSettings
    from trl_ext.quickstart.runner import prepare_output_dir
    from trl_ext.quickstart.stepwise import cold_start, reinforce
    from trl_ext.quickstart.training import fresh_copy

    quiet_run(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # uneven data; the quickstart's 4 children a root would refuse a six-part delegation
    settings = dataclasses.replace(
        QuickstartSettings.default(seed), parts_counts=PARTS_COUNTS, max_children=MAX_CHILDREN, **overrides
    )
    settings.validate()
    root = prepare_output_dir(workdir / f"seed{seed}")
    started = time.perf_counter()
    start = cold_start(root, settings, False, print)
    record: dict[str, Any] = {
        "seed": seed,
        "threads": torch.get_num_threads(),
        "settings": dataclasses.asdict(settings),
        "cold_start_s": time.perf_counter() - started,
        "before": dataclasses.asdict(start.before),
        "before_by_parts": reward_by_parts(start.before.trees_file),
        "arms": {},
    }
    sft_model = start.model
    for arm in arms:
        arm_settings = dataclasses.replace(settings, **ARMS[arm])
        tick = time.perf_counter()
        output = prepare_output_dir(root / arm)
        result = reinforce(
            dataclasses.replace(start, model=fresh_copy(sft_model)), output, arm_settings, False, False, print
        )
        record["arms"][arm] = {
            "after": dataclasses.asdict(result.after),
            "after_by_parts": reward_by_parts(result.after.trees_file),
            "rl_s": time.perf_counter() - tick,
            "training": training_curves(output),
        }
        (workdir / f"seed{seed}.json").write_text(json.dumps(record, indent=1))


def run_seed(seed: int, arms: list[str], workdir: Path, overrides: dict[str, Any]) -> dict:
    """One seed in a fresh process with one torch thread (``OMP_NUM_THREADS=1``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    command = [sys.executable, __file__, "--worker", str(seed), "--arms", *arms, "--workdir", str(workdir)]
    command += ["--overrides", json.dumps(overrides)]
    tick = time.perf_counter()
    with (workdir / f"seed{seed}.log").open("w") as log:
        code = subprocess.call(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        raise RuntimeError(f"seed {seed} failed (exit {code}); see {workdir / f'seed{seed}.log'}")
    print(f"seed {seed}: {time.perf_counter() - tick:.0f} s", flush=True)
    return json.loads((workdir / f"seed{seed}.json").read_text())


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def _span(values: list[float], fmt: str = "{:+.3f}") -> str:
    return f"{fmt.format(min(values))} to {fmt.format(max(values))}"


def monitor_alerts(log: Path) -> dict[str, list[str]]:
    """Per arm, the default monitors' alerts a seed's log shows (``[trl-ext monitor] step N, rule: ...``)."""
    alerts: dict[str, list[str]] = {}
    arm = None
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        started = re.search(r"^\[5/6\] StepwiseRLMTrainer: .*?, (\w+) normalisation", line)
        if started:
            arm = started.group(1)
        alert = re.match(r"\[trl-ext monitor\] step (\d+), (\w+):", line)
        if alert and arm is not None:
            alerts.setdefault(arm, []).append(f"{alert.group(2)} at step {alert.group(1)}")
    return alerts


def verdicts(records: list[dict], workdir: Path | None = None) -> list[str]:
    both = [r for r in records if {"subtree", "token"} <= set(r["arms"])]
    if not both:
        return []

    def after(record: dict, arm: str, key: str | None = None) -> float:
        result = record["arms"][arm]
        return result["after"]["reward"] if key is None else result["after_by_parts"][key]

    lines = []
    for label, key in (("held-out reward", None), ("few parts (1-2)", "few"), ("many parts (5-6)", "many")):
        diffs = [after(r, "subtree", key) - after(r, "token", key) for r in both]
        wins, ties = sum(d > 0 for d in diffs), sum(d == 0 for d in diffs)
        lines.append(
            f"- **{label}**, subtree minus token, seed by seed ({', '.join(str(r['seed']) for r in both)}): "
            f"{' / '.join(f'{d:+.3f}' for d in diffs)} (mean {statistics.fmean(diffs):+.3f}); subtree ahead on "
            f"{wins} of {len(both)} seeds ({ties} tied)."
        )
    for arm in ("subtree", "token"):
        gains = [r["arms"][arm]["after"]["reward"] - r["before"]["reward"] for r in both]
        delegation = [r["arms"][arm]["after"]["strategies"].get("delegate", 0.0) for r in both]
        right = [r["arms"][arm]["after"]["child_correct_rate"] or 0.0 for r in both]
        lines.append(
            f"- {ARM_LABELS[arm]}: gain over SFT {_span(gains)}; after RL, held-out root delegation "
            f"{_span([100 * d for d in delegation], '{:.0f}%')}, children right {_span([100 * c for c in right], '{:.0f}%')}."
        )
    behaviour = []
    for key, name in (("delegate", "held-out root delegation"), (None, "children right")):
        values = [
            (
                r["arms"]["subtree"]["after"]["strategies"].get(key, 0.0)
                - r["arms"]["token"]["after"]["strategies"].get(key, 0.0)
                if key
                else (r["arms"]["subtree"]["after"]["child_correct_rate"] or 0.0)
                - (r["arms"]["token"]["after"]["child_correct_rate"] or 0.0)
            )
            for r in both
        ]
        behaviour.append(f"{name} {' / '.join(f'{100 * v:+.0f}' for v in values)} points")
    lines.append(f"- What each arm taught, subtree minus token after RL, seed by seed: {'; '.join(behaviour)}.")
    shares = [r["arms"]["subtree"]["training"]["overall"] for r in both] + [
        r["arms"]["token"]["training"]["overall"] for r in both
    ]
    lines.append(
        "- The trees are uneven: over all training rollouts of both arms, the children carry "
        f"{_span([100 * s['children_token_share'] for s in shares], '{:.0f}%')} of the action tokens (what `token` "
        f"weighs) but {_span([100 * s['children_weight_share'] for s in shares], '{:.0f}%')} of the 1/k_g weight; "
        "the 5-6-part trees carry "
        f"{_span([100 * s['many_token_share'] for s in shares], '{:.0f}%')} of the tokens but "
        f"{_span([100 * s['many_weight_share'] for s in shares], '{:.0f}%')} of the 1/k_g weight."
    )
    diffs = [after(r, "subtree") - after(r, "token") for r in both]
    errors = [
        [standard_error(r["arms"][arm]["after"]["trees_file"] or "") for arm in ("subtree", "token")] for r in both
    ]
    if all(None not in pair for pair in errors):
        noise = [(a**2 + b**2) ** 0.5 for a, b in errors]
        lines.append(
            "- Evaluation noise: the standard error of a seed's held-out difference (over its "
            f"{both[0]['arms']['subtree']['after']['rollouts']} rollouts per arm) is {_span(noise, '{:.3f}')}."
        )
    if workdir is not None:
        found = [
            f"seed {r['seed']} {arm}: {', '.join(alerts)}"
            for r in both
            for arm, alerts in monitor_alerts(workdir / f"seed{r['seed']}.log").items()
        ]
        lines.append(f"- Monitor alerts (default monitors, from the seed logs): {'; '.join(found) or 'none'}.")
    wins = sum(d > 0 for d in diffs)
    within = all(None not in pair for pair in errors) and all(abs(d) < 2 * n for d, n in zip(diffs, noise))
    caveat = (
        ", but every seed's difference is under two standard errors of its evaluation: a consistent direction, "
        "not a demonstrated edge"
        if within
        else ""
    )
    if wins == len(both):
        verdict = f"subtree beat token on every seed ({_span(diffs)}){caveat}"
    elif wins == 0:
        verdict = f"subtree beat token on no seed ({_span(diffs)}): no edge for 1/k_g here"
    else:
        verdict = f"subtree beat token on {wins} of {len(both)} seeds ({_span(diffs)}): no consistent edge"
    lines.append(f"- **Verdict**: {verdict}.")
    return lines


def table(records: list[dict]) -> list[str]:
    lines = [
        "| seed | arm | held-out reward, SFT only → after RL | few parts (1-2) | many parts (5-6) | root delegates | "
        "children per root | children right | children's share: tokens / 1/k_g weight | RL s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for record in sorted(records, key=lambda r: r["seed"]):
        before, split = record["before"], record["before_by_parts"]
        for arm, result in record["arms"].items():
            after, parts, shares = result["after"], result["after_by_parts"], result["training"]["overall"]
            lines.append(
                f"| {record['seed']} | {ARM_LABELS[arm]} | {before['reward']:.3f} → **{after['reward']:.3f}** | "
                f"{split['few']:.3f} → {parts['few']:.3f} | {split['many']:.3f} → {parts['many']:.3f} | "
                f"{_pct(before['strategies'].get('delegate', 0.0))} → {_pct(after['strategies'].get('delegate', 0.0))} | "
                f"{before['children_mean']:.2f} → {after['children_mean']:.2f} | "
                f"{_pct(before['child_correct_rate'])} → {_pct(after['child_correct_rate'])} | "
                f"{_pct(shares['children_token_share'])} / {_pct(shares['children_weight_share'])} | "
                f"{result['rl_s']:.0f} |"
            )
    return lines


def plot(records: list[dict]) -> Path:
    from _plots import plot_curves

    curves: dict[str, dict[str, list]] = {
        "training reward (each generation batch)": {},
        "root delegation rate (training rollouts)": {},
        "children's share of action tokens (training rollouts)": {},
    }
    for arm in ARMS:
        runs = [r["arms"][arm]["training"] for r in records if arm in r["arms"]]
        curves["training reward (each generation batch)"][arm] = [
            ([s for s, _ in run["reward"]], [v for _, v in run["reward"]]) for run in runs
        ]
        for panel, key in (
            ("root delegation rate (training rollouts)", "delegation"),
            ("children's share of action tokens (training rollouts)", "children_token_share"),
        ):
            curves[panel][arm] = [
                ([b["step"] for b in run["batches"]], [b[key] for b in run["batches"]]) for run in runs
            ]
    return plot_curves(curves, "uneven_trees", "1/k_g (subtree) vs token mean on uneven trees")


def section(records: list[dict], command: str, total_s: float | None, workdir: Path | None = None) -> str:
    settings = records[0]["settings"]
    wall = f"; {total_s / 60:.0f} min in all" if total_s is not None else ""
    children = sorted({c for r in records for a in r["arms"].values() for c in a["training"]["children_counts"]})
    intro = (
        f"`{command}` ({machine(threads=False)}, {records[0]['threads']} torch thread per run, one run at a time on a "
        f"{os.cpu_count()}-CPU machine shared with other jobs{wall}). The quickstart's toy task with contexts of "
        f"{', '.join(map(str, PARTS_COUNTS))} parts (`make_toy_dataset(parts_counts=...)`), so a delegating root spawns "
        f"1 to {MAX_CHILDREN} children and a reading root none (children per training tree seen: "
        f"{', '.join(map(str, children))}); a one-part context fits the root's REPL output, more do not. Per seed "
        f"one cold start (teacher traces, SFT, the 'SFT only' evaluation), then each arm's RL stage from a copy of that "
        f"policy with the same RL seed: {settings['rl_steps']} optimizer steps, {settings['prompts_per_step']} tasks x "
        f"{settings['num_generations']} rollouts per generation, {settings['num_iterations']} steps per generation, "
        f"IPO, LoRA, cosine learning rate; the arms differ only in `rlm_loss_normalization`. Held-out: "
        f"{settings['num_eval_examples']} tasks x {settings['eval_samples']} samples never seen in SFT or RL, split "
        "into few (1-2) and many (5-6) parts. *Root delegates*: roots that called `rlm_query_batched`; *children "
        "right*: children whose answer is their part's value; *children's share*: over the arm's training rollouts, "
        "the children's share of the action tokens (`token`'s weighting) and of Σ W(v) (`subtree`'s)."
    )
    lines = [f"## {TITLE}", "", intro, "", *table(records), "", *verdicts(records, workdir), ""]
    lines.append(
        "![training reward, root delegation and the children's token share per step, both arms, mean and "
        "range over seeds](images/uneven_trees.png)"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--steps", type=int, default=28, help="RL optimizer steps per arm (quickstart: 28)")
    parser.add_argument("--prompts", type=int, default=4, help="tasks per generation (quickstart: 4)")
    parser.add_argument("--generations", type=int, default=8, help="rollouts per task (quickstart: 8)")
    parser.add_argument("--eval-examples", type=int, default=48, help="held-out tasks (x 2 samples)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temporary dir)")
    parser.add_argument("--render", action="store_true", help="no new runs: the section from --workdir's records")
    parser.add_argument("--no-write", action="store_true", help="leave RESULTS.md alone (the plot is still drawn)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--overrides", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="uneven-trees-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.worker is not None:
        worker(args.worker, args.arms, workdir, json.loads(args.overrides))
        return
    overrides = {
        "rl_steps": args.steps,
        "prompts_per_step": args.prompts,
        "num_generations": args.generations,
        "num_eval_examples": args.eval_examples,
        "rl_micro_batches": 2 if (args.prompts * args.generations) % 4 else 4,
    }
    started = time.perf_counter()
    study = workdir / "study.json"  # the wall time of the runs, for --render
    if args.render:
        records = [json.loads((workdir / f"seed{seed}.json").read_text()) for seed in args.seeds]
        total = json.loads(study.read_text())["wall_s"] if study.exists() else None
    else:
        records = [run_seed(seed, args.arms, workdir, overrides) for seed in args.seeds]  # one process at a time
        total = time.perf_counter() - started
        study.write_text(json.dumps({"wall_s": total, "seeds": args.seeds}))
    used = records[0]["settings"]  # what the runs used (with --render: not the flags of this call)
    command = (
        f"python benchmarks/uneven_trees.py --seeds {' '.join(map(str, args.seeds))} --steps {used['rl_steps']} "
        f"--prompts {used['prompts_per_step']} --generations {used['num_generations']} --eval-examples "
        f"{used['num_eval_examples']}"
    )
    body = section(records, command, total, workdir)
    print(body)
    print(f"plot: {plot(records)}", file=sys.stderr)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
