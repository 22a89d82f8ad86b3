"""The monitors' evaluation (`monitors_eval.py`): the injected pathologies, the workloads they are injected into, how
they are switched on mid-run, and a finished run's record."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from trl_ext.quickstart.copy_task import copy_exact_match_reward
from trl_ext.quickstart.judge_credit import JudgeCreditSettings, judge_for
from trl_ext.quickstart.scripted_server import ErrorReply

# The training arguments a run's record keeps: what the monitors read from them when its logs are replayed.
RUN_ARG_FIELDS = (
    "gradient_accumulation_steps",
    "steps_per_generation",
    "num_iterations",
    "loss_type",
    "use_vllm",
    "judge_lambda",
    "beta",
    "max_staleness",
)


@dataclasses.dataclass(frozen=True)
class Pathology:
    """One injected failure, the rules that should name it, and how it is injected.

    From the first step: ``config`` (fields of the run's trainer config), ``learning_rate_x`` (the configured
    learning rate times this), ``judge_lambda`` (None: the workload's). At the onset step (`Onset`):
    ``onset_learning_rate_x`` (the optimizer's learning rate times this), ``reward`` (the outcome reward turns
    ``"constant"`` or ``"flipped"``), ``judge_down`` (the judge answers HTTP 500), ``ungated`` (asynchronous runs:
    the rollout worker's staleness gate is switched off, so it samples as far ahead as its queue allows, as TRL's
    own worker may), ``slow_step_s`` (every optimizer step takes that much longer: a slow trainer),
    ``slow_generation_s`` (asynchronous runs: every sampling call takes that much longer: a slow generator).
    """

    name: str
    expected: tuple[str, ...]
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    learning_rate_x: float = 1.0
    judge_lambda: float | None = None
    onset_learning_rate_x: float | None = None
    reward: str | None = None
    judge_down: bool = False
    ungated: bool = False
    slow_step_s: float = 0.0
    slow_generation_s: float = 0.0

    @property
    def mid_run(self) -> bool:
        """Switched on at the onset step (else present from the first step)."""
        return (
            self.onset_learning_rate_x is not None
            or self.reward is not None
            or self.judge_down
            or self.ungated
            or self.slow_step_s > 0
            or self.slow_generation_s > 0
        )


HEALTHY = Pathology("healthy", ())
LR_X30 = Pathology("learning rate x30", ("kl_spike", "entropy_collapse", "clip_rate_high"), onset_learning_rate_x=30.0)
COLD = Pathology("temperature 0.05", ("entropy_collapse",), config={"temperature": 0.05})
JUDGE_DOWN = Pathology("judge fails", ("judge_failure",), judge_down=True)
SIGN_FLIP = Pathology("sign flip", ("reward_collapse",), reward="flipped")

PATHOLOGIES = (  # the judge-credit workload's
    LR_X30,
    COLD,
    # λ = 0: the outcome reward is the only signal
    Pathology("constant reward", ("reward_no_signal",), judge_lambda=0.0, reward="constant"),
    Pathology("stale rollouts", ("clip_rate_high",), config={"num_iterations": 16}, learning_rate_x=10.0),
    JUDGE_DOWN,
    SIGN_FLIP,
)
STEPWISE_PATHOLOGIES = (LR_X30, COLD, SIGN_FLIP)
RLMT_PATHOLOGIES = (LR_X30, COLD, Pathology("constant reward", ("reward_no_signal",), reward="constant"))
ASYNC_PATHOLOGIES = (
    Pathology("stale rollouts", ("stale_rollouts",), ungated=True, slow_step_s=1.0),
    JUDGE_DOWN,
    Pathology("slow generation", ("trainer_starved",), slow_generation_s=0.5),
)


@dataclasses.dataclass(frozen=True)
class Workload:
    """A kind of training run the monitors are evaluated on (module docstring): its name in tables and on the command
    line, what it trains, and its pathologies."""

    name: str
    title: str
    pathologies: tuple[Pathology, ...]


WORKLOADS = {
    workload.name: workload
    for workload in (
        Workload("judge-credit", "judge credit", PATHOLOGIES),
        Workload("stepwise", "stepwise RLM", STEPWISE_PATHOLOGIES),
        Workload("rlmt", "RLMT", RLMT_PATHOLOGIES),
        Workload("async", "async judge credit", ASYNC_PATHOLOGIES),
    )
}


def expected_rules(workload: str, pathology: str) -> tuple[str, ...]:
    """The rules that should name ``pathology`` in ``workload`` (none for a healthy run or an unknown name)."""
    found = WORKLOADS.get(workload)
    return next((p.expected for p in found.pathologies if p.name == pathology), ()) if found else ()


# ----------------------------------------------------------------------------------------------------------------
# Injection
# ----------------------------------------------------------------------------------------------------------------
class Onset(TrainerCallback):
    """Switches a pathology on at the start of optimizer step ``onset`` (1-based, as the logs number steps): scales
    the learning rate by ``learning_rate_x``, runs each of ``hooks`` once, and from then on sleeps ``slow_step_s``
    at the start of every step. ``stop_after``: end training after that step (None: at ``max_steps``)."""

    def __init__(
        self,
        onset: int,
        learning_rate_x: float | None = None,
        slow_step_s: float = 0.0,
        stop_after: int | None = None,
    ) -> None:
        self.onset, self.learning_rate_x, self.on = onset, learning_rate_x, False
        self.slow_step_s, self.stop_after = slow_step_s, stop_after
        self.hooks: list[Callable[[], None]] = []
        self.args: Any = None  # the run's arguments and state (`on_train_begin`), for its record
        self.state: Any = None
        self.error: str | None = None  # `surviving`: the error that ended the run

    def on_train_begin(self, args, state, control, **kwargs):
        self.args, self.state = args, state

    def on_step_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if not self.on and state.global_step + 1 >= self.onset:
            self.on = True
            if self.learning_rate_x is not None:  # scale the schedule's base rates too, or it resets them
                lr_scheduler.base_lrs = [lr * self.learning_rate_x for lr in lr_scheduler.base_lrs]
                for group in optimizer.param_groups:
                    group["lr"] *= self.learning_rate_x
            for hook in self.hooks:
                hook()
        if self.on and self.slow_step_s:
            time.sleep(self.slow_step_s)

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop_after is not None and state.global_step >= self.stop_after:
            control.should_training_stop = True


def sick_reward(func: Callable[..., list[float]], onset: Onset, kind: str | None, name: str | None = None):
    """``func``, returning ``"constant"`` 0.5 or ``"flipped"`` (negated) rewards once `onset` is on; named ``name``
    (default: ``func``'s name; the judge's verdict reward is chosen by name)."""

    def reward(*args, **kwargs):
        rewards = func(*args, **kwargs)
        if onset.on and kind == "constant":
            return [0.5] * len(rewards)
        if onset.on and kind == "flipped":
            return [None if r is None else -r for r in rewards]
        return rewards

    reward.__name__ = name or getattr(func, "__name__", type(func).__name__)
    return reward


def outcome_reward(onset: Onset, kind: str | None) -> Callable[..., list[float]]:
    """The copy task's exact-match reward, ``"constant"`` (0.5) or ``"flipped"`` (negated) once `onset` is on."""
    return sick_reward(copy_exact_match_reward, onset, kind)


def judge_script(js: JudgeCreditSettings, sick: Pathology, onset: Onset) -> Callable[[Any], Any]:
    """The scripted judge of the copy task; HTTP 500 from the onset when the pathology takes the judge down."""
    judge = judge_for(js)

    def script(request):
        return ErrorReply(500, "the judge is down") if sick.judge_down and onset.on else judge(request)

    return script


def onset_for(sick: Pathology, onset_step: int, stop_after: int | None = None) -> Onset:
    return Onset(onset_step if sick.mid_run else 1, sick.onset_learning_rate_x, sick.slow_step_s, stop_after)


@contextlib.contextmanager
def surviving(onset: Onset) -> Iterator[None]:
    """Run a training run: an exception that ends it (a diverged pathology run: NaN logits, say) is kept on
    ``onset.error`` and ends the run, not the evaluation; its record keeps the alerts raised until then."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - any failure of the run under test is its result
        onset.error = f"{type(error).__name__}: {error}"


def result_of(
    workload: str,
    seed: int,
    sick: Pathology,
    onset: Onset,
    monitors: Sequence[Any],
    started: float,
    logs_dir: str | None,
) -> dict[str, Any]:
    """A finished (or failed: `surviving`) run's record: its alerts as (rule, step), the step it reached, its error;
    its logs saved under ``logs_dir`` for `replay`."""
    alerts = sorted((a["rule"], a["step"]) for m in monitors for a in m.alerts)
    steps = onset.state.global_step if onset.state is not None else 0
    if logs_dir is not None:
        path = Path(logs_dir) / f"{workload}-{sick.name.replace(' ', '_')}-seed{seed}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        run_args = {f: getattr(onset.args, f) for f in RUN_ARG_FIELDS if hasattr(onset.args, f)}
        saved = {
            "workload": workload,
            "pathology": sick.name,
            "seed": seed,
            "onset": onset.onset,
            "steps": steps,
            "error": onset.error,
            "command": shlex.join(["python", "benchmarks/monitors_eval.py", *sys.argv[1:]]),
            "args": run_args | {"logging_steps": 1},
            "log_history": onset.state.log_history if onset.state is not None else [],
        }
        path.write_text(json.dumps(saved))
    return {
        "workload": workload,
        "run": f"seed {seed}",
        "seed": seed,
        "pathology": sick.name,
        "onset": onset.onset,
        "alerts": alerts,
        "steps": steps,
        "error": onset.error,
        "seconds": time.perf_counter() - started,
    }
