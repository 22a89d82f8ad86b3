"""A dead rollout worker ends training with its cause; a resumed run keeps counting policy versions.

Two gaps of TRL 1.16's asynchronous trainer, closed here:

- **A rollout worker process that died.** ``AsyncRolloutWorker.check_health`` only looks at the worker's heartbeat,
  so a child killed by a signal (or crashed) is reported, after ``heartbeat_stale_after_s``, as "hung"; then
  ``AsyncRolloutWorker.stop`` waits for ever for the dead child to acknowledge the stop event, and training hangs.
  `guard_rollout_worker` makes the check name the exit first (code, signal) and the stop reap a dead child. A child
  that dies (or stalls) while the stop event is being set blocks ``multiprocessing.Event.set`` for ever too (its
  ``notify`` waits for every registered sleeper to wake; seen once in CI, after a killed server, with the thread
  stacks to prove it): the stop runs in a thread, and past `STOP_TIMEOUT_S` the child is killed.
- **Policy versions and the dataset position across a resume.** TRL saves the version counter in
  ``rollout_state.json`` for its own worker only; a trl-ext worker (stepwise RLM, judge credit, RLMT) restarted at
  version 0 and republished adapters under names a running ``vllm serve`` still holds (``400 ... has already been
  loaded``), and started its prompts from the first row again. `save_rollout_state` / `restore_rollout_state` write
  and read the counter and the worker's dataset position (after the last run whose groups were all trained: TRL's
  collator records the trained group ids) for those workers (`AsyncSeam._save_checkpoint`,
  `AsyncSeam._inner_training_loop`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from typing import Any

from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

__all__ = [
    "ROLLOUT_STATE_FILE",
    "STOP_TIMEOUT_S",
    "check_rollout_child",
    "guard_rollout_worker",
    "restore_rollout_state",
    "save_rollout_state",
    "stop_rollout_child",
]

ROLLOUT_STATE_FILE = "rollout_state.json"  # TRL's file name: its own worker's state goes in the same file
# TRL's stop joins the child for 15 s, then terminates it and joins for 5 s more: a stop still running past this
# is blocked in the stop event's set() by a child that will never acknowledge it.
STOP_TIMEOUT_S = 30.0

logger = logging.getLogger(__name__)


def _dead_child(worker: AsyncRolloutWorker) -> Any | None:
    """The worker's child process when it was started and has exited, else None."""
    process = worker._process
    if process is not None and process._popen is not None and not process.is_alive():
        return process
    return None


def check_rollout_child(worker: AsyncRolloutWorker, stale_after_s: float) -> None:
    """TRL's ``check_health``, after raising with the exit code when the worker's child process is gone."""
    process = _dead_child(worker)
    if process is not None:
        code = process.exitcode
        signal = f" (signal {-code})" if code is not None and code < 0 else ""
        raise RuntimeError(
            f"TRL's rollout worker process (pid {process.pid}) exited with code {code}{signal}; its traceback, if "
            "any, is above. Fix the cause, then resume from the last checkpoint (resume_from_checkpoint=True)."
        )
    age = time.time() - worker._heartbeat_value.value
    if worker._heartbeat_value.value and age > stale_after_s and not worker._failed_event.is_set():
        raise RuntimeError(
            f"TRL's rollout worker process (pid {worker._process.pid}) made no progress for {age:.0f} s "
            f"(heartbeat_stale_after_s={stale_after_s:.0f}): a reward function or tool that never returns, or a "
            "request the server never answers, stops it. Bound the slow call (a timeout in the reward function; "
            "request_timeout for the server), then resume from the last checkpoint (resume_from_checkpoint=True)."
        )
    AsyncRolloutWorker.check_health(worker, stale_after_s)


def stop_rollout_child(worker: AsyncRolloutWorker, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """TRL's ``stop``, after reaping a dead child (which would never acknowledge the stop event), bounded by
    ``timeout_s``: a child that dies or stalls while the event is set leaves TRL's stop blocked in ``Event.set``
    (in a daemon thread, which stays blocked), and the child is killed instead."""
    process = _dead_child(worker)
    if process is not None:
        process.join(timeout=1)
        worker._process = None
    process = worker._process
    raised: list[BaseException] = []

    def stop() -> None:
        try:
            AsyncRolloutWorker.stop(worker)
        except BaseException as error:  # noqa: BLE001  (raised in the caller's thread below)
            raised.append(error)

    stopper = threading.Thread(target=stop, name="trl-rollout-worker-stop", daemon=True)
    stopper.start()
    stopper.join(timeout_s)
    if raised:
        raise raised[0]
    if not stopper.is_alive() or process is None:
        return
    logger.warning(
        "TRL's rollout worker process (pid %s) did not acknowledge the stop within %.0f s (it died or stalled while "
        "the stop event was set): killing it.",
        process.pid,
        timeout_s,
    )
    process.kill()
    process.join(timeout=5)
    worker._process = None


def guard_rollout_worker(worker: Any) -> None:
    """Give TRL's own rollout worker the dead-child check and stop above; other workers are left as they are."""
    if isinstance(worker, AsyncRolloutWorker):
        worker.check_health = functools.partial(check_rollout_child, worker)
        worker.stop = functools.partial(stop_rollout_child, worker)


def save_rollout_state(folder: str, model_version: int, worker_state: dict[str, int] | None = None) -> None:
    """Write a trl-ext rollout worker's state into checkpoint ``folder``: the policy version counter and, when given,
    where its dataset resumes (`RolloutWorker.resume_state`: ``rows``, ``groups``)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ROLLOUT_STATE_FILE), "w") as file:
        json.dump({"model_version": int(model_version), **(worker_state or {})}, file)


def restore_rollout_state(folder: str) -> dict[str, int] | None:
    """The state `save_rollout_state` wrote in checkpoint ``folder`` (``model_version`` and, when saved, ``rows``
    and ``groups``), or None when it holds none."""
    path = os.path.join(folder, ROLLOUT_STATE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as file:
        state = json.load(file)
    return {key: int(value) for key, value in state.items() if key in ("model_version", "rows", "groups")}
