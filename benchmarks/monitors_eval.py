"""Evaluation of the default monitors on real runs (issue 31): alerts on healthy runs, pathologies caught, and when.

    python benchmarks/monitors_eval.py [--seeds 0 1 2] [--steps 40] [--onset 16] [--no-write]

Every run trains the judge-credit miniature of the quickstart (`trl_ext.quickstart.judge_credit`: a tiny Qwen2 model
after brief cold-start SFT on the digit-copy task, `JudgeCreditTrainer` with the IPO loss, LoRA, a scripted span
judge on 127.0.0.1, each batch used twice) with `default_monitors(action="warn", stop_on_collapse=False)` plus a KL
penalty (β = 0.04, so that the KL rule has a metric). Healthy runs use the miniature's settings over ``--seeds``.
Each pathology is injected into seed 0 at optimizer step ``--onset`` (or from the first step where it is a setting)
and has the rules that should name it:

| pathology | injected | expected rules |
|---|---|---|
| learning rate x30 | the optimizer's learning rate x30 at the onset | kl_spike, entropy_collapse, clip_rate_high |
| temperature 0.05 | sampling temperature from the start | entropy_collapse |
| constant reward | the outcome reward returns 0.5 from the onset (λ = 0: no judge credit) | reward_no_signal |
| stale rollouts | each batch used 16 times, learning rate x10, from the start | clip_rate_high |
| judge fails | the judge answers HTTP 500 from the onset | judge_failure |
| sign flip | the outcome reward is negated from the onset | reward_collapse |

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
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _results import machine, write_section
from transformers import TrainerCallback

from trl_ext.callbacks import default_monitors
from trl_ext.quickstart.copy_task import copy_digit_accuracy_reward, copy_exact_match_reward, copy_task_splits
from trl_ext.quickstart.judge_credit import JudgeCreditSettings, build_policy, judge_for, sft_copy_policy, train_rl
from trl_ext.quickstart.scripted_server import ErrorReply, ScriptedChatServer
from trl_ext.quickstart.training import fresh_copy

KL_BETA = 0.04


@dataclasses.dataclass(frozen=True)
class Pathology:
    """One injected failure, the rules that should name it, and how it is injected.

    From the first step: ``config`` (fields of the run's `JudgeCreditConfig`), ``learning_rate_x`` (the configured
    learning rate times this), ``judge_lambda`` (None: the miniature's). At the onset step (`Onset`):
    ``onset_learning_rate_x`` (the optimizer's learning rate times this), ``reward`` (the outcome reward turns
    ``"constant"`` or ``"flipped"``), ``judge_down`` (the judge answers HTTP 500).
    """

    name: str
    expected: tuple[str, ...]
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    learning_rate_x: float = 1.0
    judge_lambda: float | None = None
    onset_learning_rate_x: float | None = None
    reward: str | None = None
    judge_down: bool = False

    @property
    def mid_run(self) -> bool:
        """Switched on at the onset step (else present from the first step)."""
        return self.onset_learning_rate_x is not None or self.reward is not None or self.judge_down


PATHOLOGIES = (
    Pathology("learning rate x30", ("kl_spike", "entropy_collapse", "clip_rate_high"), onset_learning_rate_x=30.0),
    Pathology("temperature 0.05", ("entropy_collapse",), config={"temperature": 0.05}),
    # λ = 0: the outcome reward is the only signal
    Pathology("constant reward", ("reward_no_signal",), judge_lambda=0.0, reward="constant"),
    Pathology("stale rollouts", ("clip_rate_high",), config={"num_iterations": 16}, learning_rate_x=10.0),
    Pathology("judge fails", ("judge_failure",), judge_down=True),
    Pathology("sign flip", ("reward_collapse",), reward="flipped"),
)


class Onset(TrainerCallback):
    """Switches a pathology on at the start of optimizer step ``onset`` (1-based, as the logs number steps)."""

    def __init__(self, onset: int, learning_rate_x: float | None = None) -> None:
        self.onset, self.learning_rate_x, self.on = onset, learning_rate_x, False

    def on_step_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if not self.on and state.global_step + 1 >= self.onset:
            self.on = True
            if self.learning_rate_x is not None:  # a constant schedule: scale its base rates too, or it resets them
                lr_scheduler.base_lrs = [lr * self.learning_rate_x for lr in lr_scheduler.base_lrs]
                for group in optimizer.param_groups:
                    group["lr"] *= self.learning_rate_x


def outcome_reward(onset: Onset, kind: str | None) -> Callable[..., list[float]]:
    """The miniature's exact-match reward, ``"constant"`` (0.5) or ``"flipped"`` (negated) once `onset` is on."""

    def copy_exact_match_reward_(completions, answer, **kwargs):
        rewards = copy_exact_match_reward(completions, answer, **kwargs)
        if onset.on and kind == "constant":
            return [0.5] * len(rewards)
        if onset.on and kind == "flipped":
            return [-r for r in rewards]
        return rewards

    copy_exact_match_reward_.__name__ = "copy_exact_match_reward"  # the judge's verdict reward, by name
    return copy_exact_match_reward_


def run(
    js: JudgeCreditSettings,
    sft: tuple[Any, Any, Any],
    steps: int,
    onset_step: int,
    pathology: Pathology | None,
    logs_dir: str | None = None,
) -> dict[str, Any]:
    """One RL run from the seed's SFT policy (``pathology`` None: healthy); returns its alerts (rule, step) and the
    onset."""
    model, tokenizer, rl_set = sft
    sick = pathology or Pathology("healthy", ())
    onset = Onset(onset_step if sick.mid_run else 1, sick.onset_learning_rate_x)
    judge = judge_for(js)

    def script(request):
        return ErrorReply(500, "the judge is down") if sick.judge_down and onset.on else judge(request)

    monitors = default_monitors(action="warn", stop_on_collapse=False)
    overrides = {"max_steps": steps, "beta": KL_BETA, **sick.config}
    if sick.learning_rate_x != 1.0:
        overrides["learning_rate"] = js.rl_learning_rate * sick.learning_rate_x
    judge_lambda = js.judge_lambda if sick.judge_lambda is None else sick.judge_lambda
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as output, ScriptedChatServer(script, model="judge") as server:
        trainer = train_rl(
            fresh_copy(model),
            tokenizer,
            rl_set,
            js,
            judge_lambda,
            Path(output),
            server.base_url,
            monitors=[*monitors, onset],
            reward_funcs=[outcome_reward(onset, sick.reward), copy_digit_accuracy_reward],
            config_overrides=overrides,
        )
    alerts = sorted((a["rule"], a["step"]) for m in monitors for a in m.alerts)
    if logs_dir is not None:  # the run's logs, to replay the rules on (`replay`)
        path = Path(logs_dir) / f"{sick.name.replace(' ', '_')}-seed{js.seed}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        fields = (
            "gradient_accumulation_steps",
            "steps_per_generation",
            "num_iterations",
            "loss_type",
            "use_vllm",
            "judge_lambda",
        )
        run_args = {field: getattr(trainer.args, field) for field in fields} | {"logging_steps": 1}
        path.write_text(json.dumps({"onset": onset.onset, "args": run_args, "log_history": trainer.state.log_history}))
    return {
        "seed": js.seed,
        "pathology": sick.name,
        "onset": onset.onset,
        "alerts": alerts,
        "steps": trainer.state.global_step,
        "seconds": time.perf_counter() - started,
    }


def sft_policy(seed: int, cache_dir: str | None) -> tuple[JudgeCreditSettings, tuple[Any, Any, Any]]:
    """The seed's settings and its policy after the miniature's cold-start SFT (saved in and read from
    ``cache_dir/seed<seed>`` when given), its tokenizer and its RL prompts."""
    from transformers import AutoModelForCausalLM

    js = JudgeCreditSettings.default(seed)
    cached = Path(cache_dir) / f"seed{seed}" if cache_dir else None
    sft_rows, rl_set, _ = copy_task_splits(
        js.seed, js.num_sft_examples, js.num_rl_examples, js.num_eval_examples, js.digits
    )
    model, tokenizer = build_policy(js)
    if cached is not None and (cached / "config.json").exists():
        return js, (AutoModelForCausalLM.from_pretrained(cached).eval(), tokenizer, rl_set)
    with tempfile.TemporaryDirectory() as folder:
        model = sft_copy_policy(model, tokenizer, sft_rows, js, Path(folder), progress=False)
    if cached is not None:
        model.save_pretrained(cached)
    return js, (model, tokenizer, rl_set)


def replay(path: str | Path) -> list[tuple[str, int]]:
    """The alerts fresh default monitors give on a run's saved logs (``--logs-dir``): the rules are pure functions
    of the logs, so a rule change is measured on the same runs without training them again."""
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    saved = json.loads(Path(path).read_text())
    monitors = default_monitors(action="warn", stop_on_collapse=False)
    alerts = []
    for monitor in monitors:
        monitor.on_train_begin(SimpleNamespace(**saved["args"]), TrainerState(), TrainerControl())
        for logs in saved["log_history"]:
            if "step" in logs and "loss" in logs:
                alerts += [(alert.rule, alert.step) for alert in monitor.observe(logs, logs["step"])]
    return sorted(alerts)


def healthy(result: dict[str, Any]) -> bool:
    """A healthy run's result (``"healthy"``, or a replayed ``"healthy_<name>"``)."""
    return result["pathology"].startswith("healthy")


def evaluate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run with its false alarms (any alert of a healthy run, any before a pathology's onset), the expected rule
    that caught its pathology first (``caught_by``) and how many steps after the onset (``delay``)."""
    expected = {p.name: p.expected for p in PATHOLOGIES}
    rows = []
    for r in runs:
        rules = expected.get(r["pathology"], ())
        before = [(rule, step) for rule, step in r["alerts"] if healthy(r) or step < r["onset"]]
        hits = [(step, rule) for rule, step in r["alerts"] if rule in rules and step >= r["onset"]]
        first = min(hits) if hits else None
        rows.append(
            {
                **r,
                "false": before,
                "caught_by": first[1] if first else None,
                "delay": first[0] - r["onset"] if first else None,
            }
        )
    return rows


def render(rows: list[dict[str, Any]], seeds: list[int], steps: int, healthy_steps: int, command: str) -> str:
    well = [r for r in rows if healthy(r)]
    sick = [r for r in rows if not healthy(r)]
    lines = [
        "## Monitors: alerts on healthy runs and injected pathologies",
        "",
        f"`{command}` ({machine()}, {os.cpu_count()} CPUs). The judge-credit miniature (tiny Qwen2 after cold-start "
        f"SFT on digit copying, JudgeCreditTrainer, IPO, LoRA, each batch used twice, β = {KL_BETA}) with "
        "`default_monitors(action='warn', stop_on_collapse=False)`; healthy runs "
        f"{healthy_steps} steps over seeds {', '.join(map(str, seeds))}; each pathology on seed 0, {steps} steps, "
        "injected at its onset (step 1 where it is a setting).",
        "",
        "| run | onset | expected rules | caught by (delay in steps) | false alarms (rule@step) |",
        "|---|---|---|---|---|",
    ]
    expected = {p.name: ", ".join(p.expected) for p in PATHOLOGIES}
    for r in well + sick:
        if healthy(r):
            name, onset, caught = f"healthy, seed {r['seed']}", "—", "—"
        else:
            name, onset = r["pathology"], str(r["onset"])
            caught = f"{r['caught_by']} (+{r['delay']})" if r["caught_by"] else "**missed**"
        false = ", ".join(f"{rule}@{step}" for rule, step in r["false"]) or "none"
        lines.append(f"| {name} | {onset} | {expected.get(r['pathology'], '—')} | {caught} | {false} |")
    caught = sum(r["caught_by"] is not None and r["delay"] <= 5 for r in sick)
    lines += [
        "",
        f"Healthy runs with an alert: {sum(bool(r['false']) for r in well)} of {len(well)}. Pathologies caught "
        f"by an expected rule within 5 steps of onset: {caught} of {len(sick)}. Every alert of every run: "
        + "; ".join(f"{r['pathology']} (seed {r['seed']}): {r['alerts'] or 'none'}" for r in rows)
        + ".",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the healthy runs")
    parser.add_argument("--healthy-steps", type=int, default=JudgeCreditSettings.rl_steps)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps of each pathology run")
    parser.add_argument("--onset", type=int, default=16, help="the step a mid-run pathology starts at")
    parser.add_argument(
        "--only", nargs="*", default=None, help="run only these pathologies (names; 'healthy': the healthy runs)"
    )
    parser.add_argument("--cache-dir", default=None, help="keep the SFT policies here between invocations")
    parser.add_argument("--logs-dir", default=None, help="save each run's log history here (JSON)")
    parser.add_argument("--replay", default=None, help="a --logs-dir: evaluate the current rules on its runs' logs")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("trl_ext").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if args.replay:  # the saved runs' logs through the current rules, no training
        runs = []
        for path in sorted(Path(args.replay).glob("*.json")):
            name, seed = path.stem.rsplit("-seed", 1)
            onset = json.loads(path.read_text())["onset"]
            runs.append(
                {"seed": int(seed), "pathology": name.replace("_", " "), "onset": onset, "alerts": replay(path)}
            )
        print(render(evaluate(runs), args.seeds, args.steps, args.healthy_steps, "replay of " + args.replay))
        return
    policies = {seed: sft_policy(seed, args.cache_dir) for seed in sorted({0, *args.seeds})}
    runs = []
    if args.only is None or "healthy" in args.only:
        for seed in args.seeds:
            js, sft = policies[seed]
            runs.append(run(js, sft, args.healthy_steps, args.onset, None, args.logs_dir))
            print(runs[-1], flush=True)
    for pathology in PATHOLOGIES:
        if args.only is not None and pathology.name not in args.only:
            continue
        js, sft = policies[0]
        runs.append(run(js, sft, args.steps, args.onset, pathology, args.logs_dir))
        print(runs[-1], flush=True)
    command = "python benchmarks/monitors_eval.py " + " ".join(sys.argv[1:])
    body = render(evaluate(runs), args.seeds, args.steps, args.healthy_steps, command.strip())
    print(body)
    if not args.no_write and args.only is None:
        write_section("monitors_eval", body)
        print("\nwrote the monitors_eval section of benchmarks/RESULTS.md")


if __name__ == "__main__":
    main()
