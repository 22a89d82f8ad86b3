"""Faults of `ExtAsyncGRPOTrainer` (TRL's rollout worker in a spawned child process) against a real `vllm serve`.

Each test trains a LoRA policy in a thread until a fault it injects ends the run, and fails, instead of blocking CI,
when training has not ended by a hard deadline (`train_until_fault`). Both use the session's shared server
(`tests/conftest.py`); the server test kills it, so it runs after every other test (`vllm_server_to_kill`).

- The rollout worker's child process is killed (SIGKILL): TRL's ``check_health`` does not look at the process, so
  the trainer notices only once the child's heartbeat is ``heartbeat_stale_after_s`` old; then TRL's
  ``AsyncRolloutWorker.stop`` hangs for ever: setting its ``multiprocessing.Event`` waits for the dead child's
  stop-watcher thread to acknowledge the wake-up (an expected failure until the seam reaps a dead child first).
- The server is killed: TRL's worker retries each request for about 9 minutes, ticking its heartbeat; with
  `trl_ext.trainers.ext_async_grpo.watch_server` the trainer raises once ``/health`` has failed for
  ``vllm_server_timeout`` seconds (or earlier, when a weight sync finds the server gone).

Skipped where vLLM is not installed; run with ``.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_async_faults.py``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

from .async_rewards import vowel_share_reward
from .vllm_server import VLLM_TEST_MARKS

pytestmark = VLLM_TEST_MARKS

MAX_STALENESS = 1
HEARTBEAT_S = 8.0  # heartbeat_stale_after_s
SERVER_TIMEOUT_S = 6.0  # vllm_server_timeout (the watch's limit)
DEADLINE_S = 90.0  # a hang: far above what any fault here takes to surface (seconds)


def make_trainer(server: Any, output_dir: Path) -> Any:
    from datasets import Dataset
    from peft import LoraConfig

    from trl_ext.trainers import ExtAsyncGRPOConfig, ExtAsyncGRPOTrainer

    prompts = [[{"role": "system", "content": "Count."}, {"role": "user", "content": f"to {i}"}] for i in range(32)]
    args = ExtAsyncGRPOConfig(
        output_dir=str(output_dir),
        max_steps=1000,  # a fault ends the run
        max_staleness=MAX_STALENESS,
        per_device_train_batch_size=8,
        token_budget=0,
        queue_maxsize=16,
        num_generations=4,
        max_completion_length=8,
        vllm_server_base_url=server.url,
        vllm_server_timeout=SERVER_TIMEOUT_S,
        request_timeout=10,
        heartbeat_stale_after_s=HEARTBEAT_S,
        use_cpu=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    return ExtAsyncGRPOTrainer(
        server.model,
        vowel_share_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
    )


def train_until_fault(trainer: Any, inject: Any) -> BaseException | None:
    """Train in a thread; once a step has trained, call ``inject()``; return what training raised.

    Fails the test when training has not ended ``DEADLINE_S`` seconds after the fault (a hang)."""
    outcome: dict[str, BaseException | None] = {"error": None}

    def target() -> None:
        try:
            trainer.train()
        except BaseException as error:  # noqa: BLE001  (handed to the test)
            outcome["error"] = error

    thread = threading.Thread(target=target, name="train-until-fault", daemon=True)
    thread.start()
    start = time.monotonic()
    while trainer.state.global_step < 1 and thread.is_alive() and time.monotonic() - start < DEADLINE_S:
        time.sleep(0.2)
    assert trainer.state.global_step >= 1, f"no step trained before the fault: {outcome['error']!r}"
    inject()
    thread.join(DEADLINE_S)
    if thread.is_alive():  # the stacks of every thread say where, for a hang seen once in CI and not since
        pytest.fail(f"training hung: still running {DEADLINE_S:.0f} s after the fault. Threads:\n{thread_stacks()}")
    return outcome["error"]


def thread_stacks() -> str:
    """The Python stack of every thread of this process, innermost call last."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return "\n".join(
        f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )


def error_text(error: BaseException | None) -> str:
    """The messages of ``error`` and its causes, outermost first."""
    parts = []
    while error is not None:
        parts.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return "\n".join(parts)


def test_killed_worker_process_ends_training_with_a_clear_error(vllm_server, tmp_path):
    trainer = make_trainer(vllm_server, tmp_path)
    child = {}

    def kill_child() -> None:
        process = trainer.rollout_worker._process  # TRL's spawned child (AsyncRolloutWorker)
        child["pid"] = process.pid
        os.kill(process.pid, signal.SIGKILL)

    error = train_until_fault(trainer, kill_child)
    assert isinstance(error, RuntimeError), error
    assert "exited with code -9" in str(error), error_text(error)  # the dead child named as dead, not as hung
    assert trainer.rollout_worker._process is None  # stopped (and reaped) on the way out
    with pytest.raises(ProcessLookupError):
        os.kill(child["pid"], 0)


def test_killed_server_ends_training_with_an_error_naming_it(vllm_server_to_kill, tmp_path):
    from trl_ext.trainers.ext_async_grpo import watch_server

    trainer = make_trainer(vllm_server_to_kill, tmp_path)
    watch = watch_server(trainer)
    assert watch is not None
    error = train_until_fault(trainer, vllm_server_to_kill.stop)
    text = error_text(error)
    assert error is not None, "training went on without its server"
    port = vllm_server_to_kill.url.rsplit(":", 1)[1]
    assert port in text, text  # the error names the server (the watch's, or a weight sync's connection error)
    assert trainer.rollout_worker._process is None
