"""Targets of the tests' `multiprocessing` spawn children: this module imports the standard library only.

A spawned child imports the module of its target before it runs it. A target in a test module makes the child import
what that module imports (accelerate, TRL, transformers, ...: 15-25 s on a loaded host) and outlive what a stop waits
for it: TRL's ``AsyncRolloutWorker.stop`` terminates a child that has not exited 15 s after the stop. ``tests`` (its
``__init__``) is imported too and stays as light (`tests/test_spawn_targets.py` checks both)."""

from __future__ import annotations

import time

READY_TIMEOUT_S = 120.0  # a hang guard only: a child that imports this module waits on its event within a second


def wait_for(event) -> None:
    event.wait()


def wait_until_waiting(event, child) -> None:
    """Return once the spawned ``child`` waits on the ``multiprocessing`` ``event`` (it is registered as one of its
    sleepers, the state in which a stop must wake it); fail when it exits first or hangs on the way."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while event._cond._sleeping_count.get_value() == 0:
        assert child.is_alive(), f"the child exited (exit code {child.exitcode}) before it waited on the event"
        assert time.monotonic() < deadline, f"the child did not wait on the event within {READY_TIMEOUT_S:.0f} s"
        time.sleep(0.01)
