"""Stopping TRL's rollout worker process never hangs (`trl_ext.trainers.async_seam.faults.stop_rollout_child`).

CI saw training hang once after a killed `vllm serve`: TRL's ``AsyncRolloutWorker.stop`` sets a
``multiprocessing.Event`` whose ``notify`` waits for every registered sleeper to wake, and the child, registered as
one, never did. A child frozen with SIGSTOP while it waits on the event reproduces that every time."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from types import SimpleNamespace

import pytest
from accelerate import PartialState

from trl_ext.trainers.async_seam.faults import stop_rollout_child

from ..spawn_targets import wait_for, wait_until_waiting
from ..utils import process_alive


@pytest.fixture(autouse=True)
def accelerate_state():
    PartialState()  # TRL's stop logs through accelerate's logger, as in a trainer


def test_a_child_that_never_acknowledges_the_stop_is_killed_and_the_stop_returns():
    context = multiprocessing.get_context("spawn")  # TRL's worker process is spawned too
    event = context.Event()
    child = context.Process(target=wait_for, args=(event,), daemon=True)
    child.start()
    wait_until_waiting(event, child)
    os.kill(child.pid, signal.SIGSTOP)  # alive, waiting on the event, and never waking to acknowledge it
    worker = SimpleNamespace(_process=child, _stop_event_mp=event)
    timeout_s = 2.0
    started = time.monotonic()
    stop_rollout_child(worker, timeout_s=timeout_s)
    # Its wait, then at most 5 s for the killed child to go (doubled: a loaded host); TRL's own would block for ever
    assert time.monotonic() - started < 2 * (timeout_s + 5)
    assert worker._process is None and not process_alive(child.pid)


def test_a_child_that_acknowledges_stops_cleanly():
    context = multiprocessing.get_context("spawn")
    event = context.Event()
    child = context.Process(target=wait_for, args=(event,), daemon=True)
    child.start()
    wait_until_waiting(event, child)  # TRL's stop gives it 15 s from the stop on: its start-up is not part of them
    worker = SimpleNamespace(_process=child, _stop_event_mp=event)
    stop_rollout_child(worker, timeout_s=30.0)
    assert worker._process is None and child.exitcode == 0
