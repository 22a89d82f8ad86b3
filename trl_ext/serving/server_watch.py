"""`ServerWatch`: a `vllm serve` that went away ends asynchronous training with an error that names it (docs/async.md),
instead of the trainer waiting on an empty rollout queue.

TRL's asynchronous trainer notices a rollout worker that fails or stops ticking its heartbeat (``check_health``,
called every few seconds while the trainer waits for samples). A server that is gone is neither: TRL's worker retries
each ``/v1/completions`` request 30 times with a back-off of up to 16 s (about 9 minutes), ticking its heartbeat all the
while, before it fails. The asynchronous trainer wraps the worker's ``check_health`` in a `ServerWatch`
(`trl_ext.trainers.ext_async_grpo.watch_server`), so that each call also asks the server's ``/health``; once the server has not answered for ``unreachable_after_s`` seconds (the config's
``vllm_server_timeout``), the check raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import requests

__all__ = ["ServerWatch"]


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
