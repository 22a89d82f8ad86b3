"""Fault detection for asynchronous training (docs/async.md): a `vllm serve` that went away ends training with an
error that names it, instead of the trainer waiting on an empty rollout queue.

TRL's asynchronous trainer notices a rollout worker that fails or stops ticking its heartbeat (``check_health``,
called every few seconds while the trainer waits for samples). A server that is gone is neither: TRL's worker retries
each ``/v1/completions`` request 30 times with a back-off of up to 16 s (about 9 minutes), ticking its heartbeat all the
while, before it fails. `watch_server` wraps the worker's ``check_health`` so that each call also asks the server's
``/health``; once the server has not answered for ``unreachable_after_s`` seconds (the config's
``vllm_server_timeout``), the check raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import requests

__all__ = ["ServerWatch", "watch_server"]


class ServerWatch:
    """A worker's ``check_health(stale_after_s)`` plus a probe of ``GET {base_url}/health``.

    Args:
        check_health: the worker's own check, called first (its error wins: it names the worker's cause; when the
            server does not answer either, the error names the server too).
        base_url: the server, e.g. ``"http://localhost:8000"``.
        unreachable_after_s: how long the server may fail to answer before the check raises.
        probe_timeout_s: one probe's timeout.
        clock: seconds, monotonic (tests pass their own).

    Attributes:
        down_since: the clock time of the first failed probe of the current outage, or None while the server answers.
    """

    def __init__(
        self,
        check_health: Callable[[float], None],
        base_url: str,
        unreachable_after_s: float,
        *,
        probe_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if unreachable_after_s <= 0:
            raise ValueError(f"unreachable_after_s must be > 0 seconds, got {unreachable_after_s}.")
        self.check_health = check_health
        self.base_url = base_url.rstrip("/")
        self.unreachable_after_s = unreachable_after_s
        self.probe_timeout_s = probe_timeout_s
        self.clock = clock
        self.down_since: float | None = None
        self.last_error = ""

    def server_answers(self) -> bool:
        """Whether ``/health`` answers 200 now (the reason of a failure is kept in `last_error`)."""
        try:
            response = requests.get(f"{self.base_url}/health", timeout=self.probe_timeout_s)
        except requests.RequestException as error:
            self.last_error = f"{type(error).__name__}: {error}"
            return False
        if response.status_code != 200:
            self.last_error = f"/health answered {response.status_code}"
            return False
        return True

    def __call__(self, stale_after_s: float) -> None:
        try:
            self.check_health(stale_after_s)
        except Exception as error:
            if self.server_answers():
                raise
            # a worker that stalls or fails while its server is gone: name both (the server is the likely cause)
            raise RuntimeError(
                f"{error} The vLLM server at {self.base_url} does not answer /health either ({self.last_error}): "
                "restart `vllm serve`, then resume from the last checkpoint (resume_from_checkpoint=True)."
            ) from error
        now = self.clock()
        if self.server_answers():
            self.down_since = None
            return
        if self.down_since is None:
            self.down_since = now
        down_s = now - self.down_since
        if down_s >= self.unreachable_after_s:
            raise RuntimeError(
                f"The vLLM server at {self.base_url} has not answered /health for {down_s:.0f} s "
                f"(> vllm_server_timeout={self.unreachable_after_s:.0f}; last: {self.last_error}). Restart "
                "`vllm serve`, then resume from the last checkpoint (resume_from_checkpoint=True)."
            )


def watch_server(trainer: Any) -> ServerWatch | None:
    """Wrap ``trainer.rollout_worker.check_health`` in a `ServerWatch` of ``args.vllm_server_base_url`` with
    ``args.vllm_server_timeout``; call it once, after TRL's ``__init__`` and before ``train()`` (the dataloader
    takes the check when it is built). Returns the watch, or None on a rank without a worker or without a server URL,
    or when the weights go to a sampler that uses no server (a ``weight_transfer`` with ``uses_server = False``:
    `trl_ext.trainers.LocalPolicy`).
    """
    worker = getattr(trainer, "rollout_worker", None)
    url = getattr(trainer.args, "vllm_server_base_url", None)
    if worker is None or not url or not getattr(getattr(trainer, "weight_transfer", None), "uses_server", True):
        return None
    if isinstance(worker.check_health, ServerWatch):
        return worker.check_health
    watch = ServerWatch(worker.check_health, url, float(trainer.args.vllm_server_timeout))
    worker.check_health = watch
    return watch
