"""Evaluation of the default monitors on real runs (issues 31, 40): alerts on healthy runs, pathologies caught, and
when, over four workloads.

    python benchmarks/monitors_eval.py [--workloads judge-credit stepwise rlmt async] [--stepwise-logs DIR ...]
        [--cache-dir DIR] [--logs-dir DIR] [--no-write]
    python benchmarks/monitors_eval.py --replay LOGS_DIR [--stepwise-logs DIR ...] [--no-write]

The second form trains nothing: the current rules on the runs saved by ``--logs-dir`` (one or several invocations,
each run naming the command that made it), and the table written from them.

Every run is watched by `default_monitors(action="warn", stop_on_collapse=False)` (plus the `StalenessMonitor` of an
asynchronous run: ``args=`` its config). The workloads (`WORKLOADS`):

- **judge credit**: the judge-credit miniature of the quickstart (`trl_ext.quickstart.judge_credit`: a tiny Qwen2
  model after brief cold-start SFT on the digit-copy task, `JudgeCreditTrainer` with the IPO loss, LoRA, a scripted
  span judge on 127.0.0.1, each batch used twice) plus a KL penalty (β = 0.04, so that the KL rule has a metric).
  Healthy runs over ``--seeds`` (``--healthy-steps``), pathologies on seed 0 (``--steps``, onset ``--onset``).
- **stepwise**: the default quickstart (`trl_ext.quickstart.stepwise`: the toy delegation task, scripted teacher,
  cold-start SFT, then `StepwiseRLMTrainer` with its default settings: IPO, β = 0.2, LoRA, 4 passes per generation
  batch) on seed 0, stopped after ``--stepwise-steps`` of its ``rl_steps`` (the learning-rate schedule is the default
  run's). Healthy runs: ``--stepwise-seeds`` (none by default: a full run takes minutes) and the quickstart runs
  replayed from ``--stepwise-logs`` (every ``trainer_state.json`` below each folder, named by its folder, with the
  settings its ``trl_ext_run.json`` records: `trl-ext quickstart` output folders, or the ``--workdir`` of
  benchmarks/quickstart_ablations.py, whose folders name the seed and the kernels).
- **RLMT**: the RLMT miniature (`trl_ext.quickstart.rlmt`: `RLMTTrainer`, an untrained tiny policy, the tiny reward
  model scoring the response, IPO, LoRA, each batch used twice), ``--rlmt-steps`` steps instead of its 8 and β = 0.04
  instead of its 0.001 (unanchored, its KL drifts past 1 nat per token within 24 steps).
- **async**: the judge-credit miniature trained asynchronously: `AsyncJudgeCreditTrainer` from the same SFT policy
  (saved to disk), sampling with a `LocalPolicy` (an in-process sampling copy synced every step, no vLLM server),
  ``max_staleness`` 1, each sample trained once, no KL term, ``--async-steps`` steps.

Each pathology is injected at its workload's onset step (or from the first step where it is a setting) and has the
rules that should name it:

| workload | pathology | injected | expected rules |
|---|---|---|---|
| judge credit, stepwise, RLMT | learning rate x30 | the optimizer's learning rate x30 at the onset | kl_spike, entropy_collapse, clip_rate_high |
| judge credit, stepwise, RLMT | temperature 0.05 | sampling temperature from the start | entropy_collapse |
| judge credit, RLMT | constant reward | the outcome reward returns 0.5 from the onset (judge credit: λ = 0) | reward_no_signal |
| judge credit | stale rollouts | each batch used 16 times, learning rate x10, from the start | clip_rate_high |
| judge credit, async | judge fails | the judge answers HTTP 500 from the onset | judge_failure |
| judge credit, stepwise | sign flip | the outcome reward is negated from the onset | reward_collapse |
| async | stale rollouts | from the onset the worker's staleness gate is off and each trainer step takes 1 s longer | stale_rollouts |
| async | slow generation | from the onset each sampling call (one group) takes 0.5 s longer | trainer_starved |

A pathology counts as caught when one of its rules fires at or after the onset; the delay is the first such step
minus the onset. Alerts before the onset of a pathology run count as false alarms too. Prints the confusion table
and rewrites the ``monitors_eval`` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _monitors_runs import (  # noqa: E402
    ASYNC_MAX_STALENESS,
    KL_BETA,
    async_sft_policy,
    run,
    run_async,
    run_rlmt,
    run_stepwise,
    sft_policy,
    stepwise_start,
)
from _monitors_workloads import (  # noqa: E402
    ASYNC_PATHOLOGIES,
    PATHOLOGIES,
    RLMT_PATHOLOGIES,
    STEPWISE_PATHOLOGIES,
    WORKLOADS,
    expected_rules,
)
from _results import machine, write_section  # noqa: E402

from trl_ext.callbacks import default_monitors  # noqa: E402
from trl_ext.quickstart.judge_credit import JudgeCreditSettings  # noqa: E402

__all__ = [  # what tests/callbacks uses
    "ASYNC_PATHOLOGIES",
    "PATHOLOGIES",
    "async_sft_policy",
    "evaluate",
    "replayed_record",
    "run",
    "run_async",
    "run_rlmt",
    "sft_policy",
    "stepwise_log_records",
]

CAUGHT_WITHIN = 5  # steps after the onset


# ----------------------------------------------------------------------------------------------------------------
# Replay: the current rules on saved logs
# ----------------------------------------------------------------------------------------------------------------
def replay_history(log_history: Iterable[Mapping[str, Any]], run_args: Mapping[str, Any]) -> list[tuple[str, int]]:
    """The alerts fresh default monitors give on a run's log history, the run's arguments ``run_args`` (the fields
    the monitors read: `_monitors_workloads.RUN_ARG_FIELDS`, ``logging_steps``): the rules are pure functions of the logs, so a rule
    change is measured on the same runs without training them again."""
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    args = SimpleNamespace(**run_args)
    monitors = default_monitors(action="warn", stop_on_collapse=False, args=args)
    alerts = []
    for monitor in monitors:
        monitor.on_train_begin(args, TrainerState(), TrainerControl())
        for logs in log_history:
            if "step" in logs and "loss" in logs:
                alerts += [(alert.rule, alert.step) for alert in monitor.observe(logs, logs["step"])]
    return sorted(alerts)


def replayed_record(path: Path) -> dict[str, Any]:
    """The record of a run saved with ``--logs-dir`` (`_monitors_workloads.result_of`), its alerts from the current
    rules (`replay_history`)."""
    saved = json.loads(path.read_text())
    return {
        "workload": saved["workload"],
        "run": f"seed {saved['seed']}",
        "seed": saved["seed"],
        "pathology": saved["pathology"],
        "onset": saved["onset"],
        "steps": saved["steps"],
        "error": saved.get("error"),
        "command": saved["command"],
        "alerts": replay_history(saved["log_history"], saved["args"]),
    }


def quickstart_monitor_args(settings: Mapping[str, Any]) -> dict[str, Any]:
    """What the monitors read from the training arguments of a quickstart RL run with ``settings``
    (`trl_ext.quickstart.settings.toy_rl_config_kwargs`: one log per step, ``rl_micro_batches`` accumulated
    micro-batches per optimizer step, TRL's ``steps_per_generation`` = gradient accumulation)."""
    return {
        "logging_steps": 1,
        "gradient_accumulation_steps": settings["rl_micro_batches"],
        "steps_per_generation": settings["rl_micro_batches"],
        "num_iterations": settings["num_iterations"],
        "loss_type": settings["loss_type"],
        "beta": settings["rl_beta"],
    }


def settings_note(settings: Mapping[str, Any], defaults: Mapping[str, Any]) -> str:
    """A replayed quickstart run's ``settings`` against today's ``defaults`` (`QuickstartSettings.default` as a
    dict), the seed aside: ``"default settings"`` or what differs."""
    differ = [
        f"{name}={settings.get(name)!r} (default {default!r})"
        for name, default in defaults.items()
        if name != "seed" and settings.get(name) != default
    ]
    return "default settings" if not differ else "not the default: " + ", ".join(differ)


def stepwise_log_record(folder: Path, root: Path, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The record of the quickstart RL run in ``folder`` (below ``root``: its ``trainer_state.json`` and
    ``trl_ext_run.json``, as `trl-ext quickstart` and benchmarks/quickstart_ablations.py write them), replayed as a
    healthy stepwise run, named by its folder, its settings noted (`settings_note`)."""
    info_path = folder / "trl_ext_run.json"
    if not info_path.exists():
        raise FileNotFoundError(
            f"{folder} has a trainer_state.json but no trl_ext_run.json: --stepwise-logs replays the output folders "
            "of `trl-ext quickstart` or benchmarks/quickstart_ablations.py, which record the run's settings there."
        )
    settings = json.loads(info_path.read_text())["extra"]["settings"]
    state = json.loads((folder / "trainer_state.json").read_text())
    name = folder.relative_to(root).as_posix()
    return {
        "workload": "stepwise",
        "run": root.resolve().name if name == "." else name,
        "seed": settings["seed"],
        "pathology": "healthy",
        "onset": 1,
        "alerts": replay_history(state["log_history"], quickstart_monitor_args(settings)),
        "steps": state.get("global_step"),
        "settings": settings_note(settings, defaults),
        "replayed": True,
    }


def stepwise_log_records(roots: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Every quickstart run below ``roots`` (each folder holding a ``trainer_state.json``) as a replayed healthy
    stepwise record (`stepwise_log_record`)."""
    from trl_ext.quickstart import QuickstartSettings

    defaults = dataclasses.asdict(QuickstartSettings.default())
    return [
        stepwise_log_record(state.parent, Path(root), defaults)
        for root in roots
        for state in sorted(Path(root).rglob("trainer_state.json"))
    ]


# ----------------------------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------------------------
def healthy(result: Mapping[str, Any]) -> bool:
    return result["pathology"] == "healthy"


def evaluate(runs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each run with its false alarms (any alert of a healthy run, any before a pathology's onset), the expected rule
    that caught its pathology first (``caught_by``) and how many steps after the onset (``delay``)."""
    rows = []
    for r in runs:
        rules = () if healthy(r) else expected_rules(r.get("workload", "judge-credit"), r["pathology"])
        before = [(rule, step) for rule, step in r["alerts"] if healthy(r) or step < r["onset"]]
        hits = [(step, rule) for rule, step in r["alerts"] if rule in rules and step >= r["onset"]]
        first = min(hits) if hits else None
        rows.append(
            {
                "workload": "judge-credit",
                "run": f"seed {r.get('seed')}",
                **r,
                "expected": rules,
                "false": before,
                "caught_by": first[1] if first else None,
                "delay": first[0] - r["onset"] if first else None,
            }
        )
    return rows


def summarize(rows: Sequence[Mapping[str, Any]], within: int = CAUGHT_WITHIN) -> dict[str, dict[str, int]]:
    """Per workload (in `WORKLOADS` order): healthy runs and those with an alert, healthy runs at today's default
    settings (replayed runs whose settings are recorded as the default, and every run trained here) and those with
    an alert, pathologies and those caught by an expected rule within ``within`` steps of the onset."""
    out: dict[str, dict[str, int]] = {}
    order = [name for name in WORKLOADS if any(r["workload"] == name for r in rows)]
    order += sorted({r["workload"] for r in rows} - set(order))
    for name in order:
        mine = [r for r in rows if r["workload"] == name]
        well = [r for r in mine if healthy(r)]
        default = [r for r in well if r.get("settings", "default settings") == "default settings"]
        sick = [r for r in mine if not healthy(r)]
        out[name] = {
            "healthy": len(well),
            "healthy_alerted": sum(bool(r["false"]) for r in well),
            "default": len(default),
            "default_alerted": sum(bool(r["false"]) for r in default),
            "pathologies": len(sick),
            "caught": sum(r["caught_by"] is not None and r["delay"] <= within for r in sick),
        }
    return out


def run_label(row: Mapping[str, Any]) -> str:
    """A row's run column: ``healthy, seed 0``, ``healthy, <folder> (replayed; <settings>)`` or the pathology, and
    the error that ended a failed run."""
    if healthy(row) and row.get("replayed"):
        label = f"healthy, `{row['run']}` (replayed; {row.get('settings', 'settings not recorded')})"
    else:
        label = f"{row['pathology']}, {row['run']}"
    if row.get("error"):
        label += f" (the run failed at step {row['steps'] + 1}: {row['error'][:90]})"
    return label


def render(rows: Sequence[Mapping[str, Any]], commands: Sequence[str]) -> str:
    """The RESULTS.md section: the ``commands`` that ran it and what was run (`describe`), one row per run, then per
    workload the healthy runs with an alert and the pathologies caught (k of n)."""
    titles = {name: w.title for name, w in WORKLOADS.items()}
    ordered = sorted(
        rows,
        key=lambda r: (list(WORKLOADS).index(r["workload"]) if r["workload"] in WORKLOADS else 99, not healthy(r)),
    )
    lines = [
        "## Monitors: alerts on healthy runs and injected pathologies",
        "",
        " then ".join(f"`{command}`" for command in commands)
        + f" ({machine(threads=False)}, {os.cpu_count()} CPUs). Every run is watched by "
        "`default_monitors(action='warn', stop_on_collapse=False)` (and its `StalenessMonitor` in the asynchronous "
        f"runs); a pathology is caught when an expected rule fires at or after its onset, within {CAUGHT_WITHIN} "
        "steps to count below; any alert of a healthy run, or before an onset, is a false alarm.",
        "",
        *[f"- {paragraph}" for paragraph in describe(rows)],
        "",
        "| workload | run | onset | expected rules | caught by (delay in steps) | false alarms (rule@step) |",
        "|---|---|---|---|---|---|",
    ]
    for r in ordered:
        if healthy(r):
            onset, caught = "—", "—"
        else:
            onset = str(r["onset"])
            caught = f"{r['caught_by']} (+{r['delay']})" if r["caught_by"] else "**missed**"
        false = ", ".join(f"{rule}@{step}" for rule, step in r["false"]) or "none"
        expected = ", ".join(r["expected"]) or "—"
        lines.append(
            f"| {titles.get(r['workload'], r['workload'])} | {run_label(r)} | {onset} | {expected} | {caught} "
            f"| {false} |"
        )
    lines.append("")
    for name, s in summarize(ordered).items():
        default = ""
        if s["default"] != s["healthy"]:
            default = f" (at today's default settings: {s['default_alerted']} of {s['default']})"
        lines.append(
            f"- {titles.get(name, name)}: healthy runs with an alert {s['healthy_alerted']} of {s['healthy']}"
            f"{default}; pathologies caught by an expected rule within {CAUGHT_WITHIN} steps of onset "
            f"{s['caught']} of {s['pathologies']}."
        )
    lines += [
        "",
        "Every alert of every run: "
        + "; ".join(
            f"{titles.get(r['workload'], r['workload'])} {r['pathology']} ({r['run']}): "
            + (", ".join(f"{rule}@{step}" for rule, step in r["alerts"]) or "none")
            for r in ordered
        )
        + ".",
    ]
    return "\n".join(lines)


# What each workload trains (`describe`).
WORKLOAD_TEXT = {
    "judge-credit": "the judge-credit miniature (tiny Qwen2 after cold-start SFT on digit copying, JudgeCreditTrainer, "
    f"IPO, LoRA, each batch used twice, a scripted span judge on 127.0.0.1, β = {KL_BETA})",
    "stepwise": "the default quickstart's RL stage (toy delegation task, scripted teacher, cold-start SFT, "
    "StepwiseRLMTrainer with the default settings: IPO, β = 0.2, LoRA, each generation batch used for 4 steps, "
    "28 steps)",
    "rlmt": "the RLMT miniature (untrained tiny policy, tiny reward model scoring the response, RLMTTrainer, IPO, "
    f"LoRA, each batch used twice) with β = {KL_BETA} instead of its 0.001",
    "async": "the judge-credit miniature's SFT policy trained by AsyncJudgeCreditTrainer (IPO, LoRA, max_staleness "
    f"{ASYNC_MAX_STALENESS}, each sample trained once, no KL term), sampling with a LocalPolicy (in-process, synced "
    "every step)",
}


def _spread(values: Iterable[Any]) -> str:
    found = sorted(set(values))
    return ", ".join(map(str, found)) if found else "?"


def describe(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One paragraph per workload in ``rows``: what it trains (`WORKLOAD_TEXT`) and the seeds, steps and onsets of
    its runs, read from the runs themselves."""
    paragraphs = []
    for name in [name for name in WORKLOADS if any(r["workload"] == name for r in rows)]:
        mine = [r for r in rows if r["workload"] == name]
        trained = [r for r in mine if healthy(r) and not r.get("replayed")]
        replayed = [r for r in mine if r.get("replayed")]
        sick = [r for r in mine if not healthy(r)]
        parts = []
        if trained:
            parts.append(
                f"healthy runs on seeds {_spread(r['seed'] for r in trained)} ({_spread(r['steps'] for r in trained)} "
                "steps)"
            )
        if replayed:
            parts.append(
                f"{len(replayed)} healthy runs replayed from their output folders ({_spread(r['steps'] for r in replayed)} "
                "steps; the folder names the seed and `ATEN_CPU_CAPABILITY`)"
            )
        if sick:
            parts.append(
                f"each pathology on seed {_spread(r['seed'] for r in sick)} ({_spread(r['steps'] for r in sick)} steps, "
                f"onset at step {_spread(r['onset'] for r in sick if r['onset'] > 1)}, step 1 where it is a setting)"
            )
        paragraphs.append(f"**{WORKLOADS[name].title}**: {WORKLOAD_TEXT[name]}; " + "; ".join(parts) + ".")
    return paragraphs


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------
def wanted(only: Sequence[str] | None, name: str) -> bool:
    return only is None or name in only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="judge credit: healthy seeds")
    parser.add_argument("--healthy-steps", type=int, default=JudgeCreditSettings.rl_steps)
    parser.add_argument("--steps", type=int, default=40, help="judge credit: steps of each pathology run")
    parser.add_argument("--onset", type=int, default=16, help="judge credit: the step a mid-run pathology starts at")
    parser.add_argument("--stepwise-seeds", type=int, nargs="*", default=[], help="stepwise: healthy seeds trained")
    parser.add_argument("--stepwise-steps", type=int, default=16)
    parser.add_argument("--stepwise-onset", type=int, default=9)
    parser.add_argument(
        "--stepwise-logs",
        nargs="+",
        action="extend",
        default=[],
        help="folders of quickstart runs: each trainer_state.json below them replayed as a healthy stepwise run",
    )
    parser.add_argument("--rlmt-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rlmt-steps", type=int, default=24)
    parser.add_argument("--rlmt-onset", type=int, default=10)
    parser.add_argument("--async-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--async-steps", type=int, default=24)
    parser.add_argument("--async-onset", type=int, default=10)
    parser.add_argument(
        "--only", nargs="*", default=None, help="run only these pathologies (names; 'healthy': the healthy runs)"
    )
    parser.add_argument("--cache-dir", default=None, help="keep the SFT policies here between invocations")
    parser.add_argument("--logs-dir", default=None, help="save each run's log history here (JSON)")
    parser.add_argument(
        "--replay", default=None, help="a --logs-dir: the current rules on its runs' logs (and --stepwise-logs)"
    )
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("trl_ext").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    command = shlex.join(["python", "benchmarks/monitors_eval.py", *sys.argv[1:]])
    if args.replay:  # the saved runs' logs through the current rules, no training
        runs = [replayed_record(path) for path in sorted(Path(args.replay).glob("*.json"))]
        runs += stepwise_log_records(args.stepwise_logs)
        commands = list(dict.fromkeys(r["command"] for r in runs if r.get("command")))
        body = render(evaluate(runs), [*commands, command])
        print(body)
        if not args.no_write:
            write_section("monitors_eval", body)
            print("\nwrote the monitors_eval section of benchmarks/RESULTS.md")
        return
    tick = time.perf_counter()
    runs: list[dict[str, Any]] = []

    def record(result: dict[str, Any]) -> None:
        runs.append(result)
        print({k: v for k, v in result.items()}, flush=True)

    only = args.only
    cache = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="monitors_eval-"))
    if "judge-credit" in args.workloads:
        policies = {seed: sft_policy(seed, str(cache)) for seed in sorted({0, *args.seeds})}
        if wanted(only, "healthy"):
            for seed in args.seeds:
                js, sft = policies[seed]
                record(run(js, sft, args.healthy_steps, args.onset, None, args.logs_dir))
        for pathology in PATHOLOGIES:
            if wanted(only, pathology.name):
                js, sft = policies[0]
                record(run(js, sft, args.steps, args.onset, pathology, args.logs_dir))
    if "async" in args.workloads:
        for seed, pathology in [(s, None) for s in args.async_seeds if wanted(only, "healthy")] + [
            (0, p) for p in ASYNC_PATHOLOGIES if wanted(only, p.name)
        ]:
            js, sft, sft_dir = async_sft_policy(seed, cache / f"async-seed{seed}")
            record(run_async(js, sft, sft_dir, args.async_steps, args.async_onset, pathology, args.logs_dir))
    if "rlmt" in args.workloads:
        for seed, pathology in [(s, None) for s in args.rlmt_seeds if wanted(only, "healthy")] + [
            (0, p) for p in RLMT_PATHOLOGIES if wanted(only, p.name)
        ]:
            record(run_rlmt(seed, args.rlmt_steps, args.rlmt_onset, pathology, args.logs_dir))
    if "stepwise" in args.workloads:
        for seed, pathology in [(s, None) for s in args.stepwise_seeds if wanted(only, "healthy")] + [
            (0, p) for p in STEPWISE_PATHOLOGIES if wanted(only, p.name)
        ]:
            settings, start = stepwise_start(seed, cache / f"stepwise-seed{seed}")
            record(run_stepwise(settings, start, args.stepwise_steps, args.stepwise_onset, pathology, args.logs_dir))
        runs.extend(stepwise_log_records(args.stepwise_logs))
    body = render(evaluate(runs), [command])
    print(body)
    print(f"\nwall time {time.perf_counter() - tick:.0f} s")
    if not args.no_write and args.only is None:
        write_section("monitors_eval", body)
        print("\nwrote the monitors_eval section of benchmarks/RESULTS.md")


if __name__ == "__main__":
    main()
