"""Faults of asynchronous training on the CPU, without vLLM (issue 29): what `AsyncStepwiseRLMTrainer` (its
`RolloutWorker` (of `StepwiseRLM`) thread, scripted RLM trees with real sandboxed REPLs, a no-op weight sync) and
`ExtAsyncGRPOTrainer` (an in-process queue worker) do when the rollouts fail, hang, go stale or are cut by a resume.

Every training run goes through `train_within`, which fails the test after a hard deadline instead of blocking CI
when training hangs. The same faults against a real ``vllm serve`` and TRL's spawned worker are in
``tests/test_vllm_async_faults.py``.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from trl_ext.rlm.sandbox.limits import DEFAULT_SANDBOX_UIDS
from trl_ext.serving.server_watch import ServerWatch
from trl_ext.testing import VariantGenerator
from trl_ext.trainers.ext_async_grpo import watch_server

from .test_async_rlm import DATASET, FlakyGenerator, make_trainer, model_dir  # noqa: F401  (model_dir: a fixture)
from .test_ext_async_grpo import build_trainer, rollout_samples
from .test_ext_async_grpo import model_dir as plain_model_dir  # noqa: F401  (a fixture)

DEADLINE_S = 240.0  # far above any run here (seconds); only a hang reaches it


def train_within(trainer: Any, deadline_s: float = DEADLINE_S, **train_kwargs: Any) -> BaseException | None:
    """Run ``trainer.train(**train_kwargs)`` in a thread; return what it raised (None when it finished).

    Fails the test when training has not ended after ``deadline_s`` seconds: a hang (the thread is a daemon, so
    the test process still exits).
    """
    outcome: dict[str, BaseException | None] = {"error": None}

    def target() -> None:
        try:
            trainer.train(**train_kwargs)
        except BaseException as error:  # noqa: BLE001  (handed to the test)
            outcome["error"] = error

    thread = threading.Thread(target=target, name="train-within", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        pytest.fail(f"training hung: still running after {deadline_s:.0f} s")
    return outcome["error"]


def sandbox_processes() -> list[psutil.Process]:
    """Live processes descended from this test process that run as a sandbox uid (the REPLs and their children)."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.uids().real in DEFAULT_SANDBOX_UIDS and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found


def no_repl_left(timeout_s: float = 10.0) -> list[psutil.Process]:
    """The sandbox processes still alive after waiting up to ``timeout_s`` for them to go ([] when none is left)."""
    deadline = time.monotonic() + timeout_s
    while (left := sandbox_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def logged(trainer: Any, name: str) -> list[float]:
    return [entry[name] for entry in trainer.state.log_history if entry.get(name) is not None]


# ----------------------------------------------------------------------------------------------------------------
# 2. The worker dies: a generator that always raises
# ----------------------------------------------------------------------------------------------------------------
def test_rlm_worker_that_keeps_failing_ends_training_with_the_cause(model_dir, tmp_path):  # noqa: F811
    trainer = make_trainer(model_dir, tmp_path, max_steps=2, queue_maxsize=64)
    trainer.rollout_worker.generator = FlakyGenerator(trainer.processing_class, failures=10**6)
    error = train_within(trainer)
    assert isinstance(error, RuntimeError), error
    assert "RLM rollout worker stopped" in str(error) and "3 RLM rollout runs failed in a row" in str(error)
    assert "the policy server went away" in str(error)  # the generator's own error, in the message
    assert trainer.state.global_step == 0 and trainer.rollout_worker._stop.is_set()
    assert not no_repl_left()


# ----------------------------------------------------------------------------------------------------------------
# 3. The worker hangs: a generator call that does not return
# ----------------------------------------------------------------------------------------------------------------
class HangingGenerator(VariantGenerator):
    """Plays the script for its first ``calls`` calls, then blocks until `release` is set (a request that never
    answers, until a request timeout), then raises."""

    def __init__(self, tokenizer, calls: int):
        super().__init__(tokenizer)
        self.calls, self.release, self.blocked = calls, threading.Event(), threading.Event()

    def generate(self, prompts):
        if self.calls <= 0:
            self.blocked.set()
            self.release.wait()
            raise TimeoutError("the policy server did not answer")
        self.calls -= 1
        return super().generate(prompts)


def test_rlm_worker_that_hangs_ends_training_after_the_heartbeat_limit(model_dir, tmp_path):  # noqa: F811
    trainer = make_trainer(model_dir, tmp_path, max_steps=2, queue_maxsize=64, heartbeat_stale_after_s=2.0)
    generator = HangingGenerator(trainer.processing_class, calls=1)  # a REPL is open when the call hangs
    trainer.rollout_worker.generator = generator

    def release_once_stopped() -> None:  # the hung request times out once the trainer has given up on it
        trainer.rollout_worker._stop.wait(DEADLINE_S)
        generator.release.set()

    threading.Thread(target=release_once_stopped, daemon=True).start()
    error = train_within(trainer)
    assert generator.blocked.is_set()
    assert isinstance(error, RuntimeError) and "made no progress for" in str(error), error
    assert "heartbeat_stale_after_s=2" in str(error)
    assert trainer.state.global_step == 0
    assert not no_repl_left()  # the engine closed the REPLs of the run that hung


# ----------------------------------------------------------------------------------------------------------------
# 4. Rollouts beyond max_staleness are dropped and counted
# ----------------------------------------------------------------------------------------------------------------
def test_stale_samples_are_dropped_and_counted_exactly(plain_model_dir, tmp_path):  # noqa: F811
    # The cold sync at the start publishes version 1. Staleness is judged when a sample leaves the queue, and the
    # loader reads on demand (`OnDemandLoader`): samples 0-3 leave it for step 1 under version 1; step 1's sync
    # publishes version 2 before step 2 fetches, so under max_staleness=0 samples 4-11 (version 1) are dropped and
    # 12-15 (version 2) are trained. (Accelerate's look-ahead would have fetched 4-7 before the sync and trained them
    # one version old.)
    samples = rollout_samples(16)
    for index, sample in enumerate(samples):
        sample.model_version = 1 if index < 12 else 2
    trainer, worker = build_trainer(plain_model_dir, tmp_path, samples=samples, max_staleness=0)
    assert train_within(trainer) is None
    assert trainer.state.global_step == 2 and worker.rollout_buffer.empty()
    assert sum(logged(trainer, "sample/dropped_stale_total")) == 8.0
    assert logged(trainer, "sample/staleness_max") == [0.0, 0.0]
    assert not logged(trainer, "sample/dropped_stale_tokens_total")  # nothing older reached the loss


def test_rlm_worker_running_ahead_has_its_stale_samples_dropped(model_dir, tmp_path):  # noqa: F811
    # One engine run makes more samples than a step trains; what is left when the step syncs is one version old.
    trainer = make_trainer(model_dir, tmp_path, max_steps=2, max_staleness=0, queue_maxsize=256)
    assert train_within(trainer) is None
    assert trainer.state.global_step == 2
    assert sum(logged(trainer, "sample/dropped_stale_total")) > 0
    assert all(value == 0.0 for value in logged(trainer, "sample/staleness_max"))
    assert not no_repl_left()


# ----------------------------------------------------------------------------------------------------------------
# 5. Resume from a checkpoint
# ----------------------------------------------------------------------------------------------------------------
def test_rlm_resume_continues_from_the_checkpoint_and_leaves_no_repl(model_dir, tmp_path):  # noqa: F811
    first = make_trainer(model_dir, tmp_path, max_steps=2, save_strategy="steps", save_steps=1, queue_maxsize=64)
    assert train_within(first) is None
    checkpoint = Path(tmp_path) / "checkpoint-2"
    assert (checkpoint / "trainer_state.json").is_file()
    assert not no_repl_left()

    resumed = make_trainer(model_dir, tmp_path, max_steps=3, save_strategy="steps", save_steps=1, queue_maxsize=64)
    assert train_within(resumed, resume_from_checkpoint=True) is None
    assert resumed.state.global_step == 3
    steps = [entry["step"] for entry in resumed.state.log_history if "loss" in entry]
    assert steps == [1, 2, 3] and len(set(steps)) == len(steps)  # the history of step 1-2 kept once, not redone
    assert resumed.rollout_worker.groups > 0  # the in-flight rollouts of the first run were generated anew
    assert not no_repl_left()


def test_rlm_resume_keeps_counting_policy_versions(model_dir, tmp_path):  # noqa: F811
    # Adapter names are trl-policy-v<version>: a resumed run that counted from 0 again would publish names a still
    # running server already holds (vLLM refuses to load an adapter name twice). TRL saves the version in
    # rollout_state.json for its own worker only.
    first = make_trainer(model_dir, tmp_path, max_steps=2, save_strategy="steps", save_steps=2, queue_maxsize=64)
    assert train_within(first) is None
    version_at_checkpoint = first.model_version
    state_file = Path(tmp_path) / "checkpoint-2" / "rollout_state.json"
    assert state_file.is_file(), "the checkpoint holds no rollout_state.json (the policy version is lost)"
    assert json.loads(state_file.read_text())["model_version"] == version_at_checkpoint

    resumed = make_trainer(model_dir, tmp_path, max_steps=3, save_strategy="steps", save_steps=2, queue_maxsize=64)
    assert train_within(resumed, resume_from_checkpoint=True) is None
    assert resumed.model_version == version_at_checkpoint + 2  # the cold sync at start, then step 3


# ----------------------------------------------------------------------------------------------------------------
# 1. The server goes away: `ServerWatch` (trl_ext.serving.server_watch) against a real HTTP server
# ----------------------------------------------------------------------------------------------------------------
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802  (http.server's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):  # keep the test output quiet
        pass


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_server_watch_raises_once_the_server_is_gone_for_its_limit():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    worker_checks: list[float] = []
    clock = Clock()
    watch = ServerWatch(worker_checks.append, url, unreachable_after_s=10.0, probe_timeout_s=2.0, clock=clock)
    watch(300.0)  # the server answers
    assert watch.down_since is None and worker_checks == [300.0]
    server.shutdown()
    server.server_close()
    watch(300.0)  # first failed probe: the outage starts
    assert watch.down_since == 0.0
    clock.now = 9.0
    watch(300.0)  # down 9 s < 10 s
    clock.now = 10.0
    with pytest.raises(RuntimeError, match=rf"{url} has not answered /health for 10 s .*Restart `vllm serve`"):
        watch(300.0)
    assert worker_checks == [300.0] * 4  # the worker's own check ran first every time


class ShuttingDown(http.server.BaseHTTPRequestHandler):
    """What `vllm serve` answered to the weight sync's /pause while it shut down (seen in CI)."""

    def do_POST(self):  # noqa: N802  (http.server's name)
        body = b'{"error":"Failed to pause generation: cannot schedule new futures after shutdown"}'
        self.send_response(500)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def weight_sync_probe(url: str):
    """The seam's `_sync_weight` over TRL's own, with TRL's real HTTP client to ``url`` as the weight transfer and
    just the trainer state TRL's merged sync reads before its first request."""
    from types import SimpleNamespace

    import torch
    from accelerate import Accelerator
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    from trl_ext.trainers.async_seam.trainer import AsyncSeam

    probe = object.__new__(type("Probe", (AsyncSeam,), {}))
    probe.args = SimpleNamespace(vllm_server_base_url=url)
    probe.accelerator, probe.model, probe._lora_sync = Accelerator(cpu=True), torch.nn.Linear(1, 1), False
    probe.weight_transfer = VLLMClient(url)  # has pause(): TRL's "Request failed: <status>, <body>" on an error
    return probe


def test_a_weight_sync_refused_by_a_stopping_server_names_the_server_and_the_fix():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ShuttingDown)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(RuntimeError, match=rf"weight sync to the vLLM server at {url} failed") as caught:
            weight_sync_probe(url)._sync_weight()
    finally:
        server.shutdown()
        server.server_close()
    assert "Request failed: 500" in str(caught.value) and "resume_from_checkpoint=True" in str(caught.value)
    assert "cannot schedule new futures" in str(caught.value.__cause__)  # TRL's error kept as the cause
    # a server that is gone: a ConnectionError naming it
    with pytest.raises(ConnectionError, match=rf"could not reach the vLLM server at {url} .*Restart `vllm serve`"):
        weight_sync_probe(url)._sync_weight()


def test_server_watch_lets_the_workers_own_error_through():
    def failed_worker(stale_after_s: float) -> None:
        raise RuntimeError("Rollout worker child has failed")

    watch = ServerWatch(failed_worker, "http://127.0.0.1:9", unreachable_after_s=1.0)
    with pytest.raises(RuntimeError, match="Rollout worker child has failed") as raised:
        watch(300.0)  # the server does not answer either: the error names it too
    assert "http://127.0.0.1:9 does not answer /health" in str(raised.value)
    with pytest.raises(ValueError, match="unreachable_after_s must be > 0"):
        ServerWatch(failed_worker, "http://127.0.0.1:9", unreachable_after_s=0)


def test_watch_server_wraps_the_workers_check_once(plain_model_dir, tmp_path):  # noqa: F811
    trainer, worker = build_trainer(plain_model_dir, tmp_path, vllm_server_base_url="http://127.0.0.1:9")
    watch = watch_server(trainer)
    assert isinstance(worker.check_health, ServerWatch) and watch_server(trainer) is watch
    assert watch.unreachable_after_s == trainer.args.vllm_server_timeout


# ----------------------------------------------------------------------------------------------------------------
# 6. TRL's own worker process stops ticking (a reward function that never returns): named, with the fix
# ----------------------------------------------------------------------------------------------------------------
def test_a_stalled_trl_worker_process_is_named_with_the_fix():
    import multiprocessing

    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from trl_ext.trainers.async_seam.faults import check_rollout_child

    context = multiprocessing.get_context("spawn")
    worker = AsyncRolloutWorker.__new__(AsyncRolloutWorker)  # the process-facing state only: no server, no model
    worker._heartbeat_value = context.Value("d", time.time())
    worker._failed_event = context.Event()
    worker._process = context.Process(target=time.sleep, args=(60,), daemon=True)
    worker._process.start()
    try:
        check_rollout_child(worker, stale_after_s=30)  # fresh heartbeat: healthy
        worker._heartbeat_value.value = time.time() - 45  # the child's loops stopped ticking 45 s ago
        with pytest.raises(RuntimeError, match=r"made no progress for 4\d s .*reward function .*request_timeout"):
            check_rollout_child(worker, stale_after_s=30)
    finally:
        worker._process.kill()
        worker._process.join(timeout=10)
