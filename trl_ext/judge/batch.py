"""One generation batch's judge calls, outside the trainer: the calls in flight (`PendingJudgement`), the texts the
judge is given (`verdict_text`, `optional_text`), the verdicts collected (`collect_verdict`), and what the log says
when the judge endpoint fails (`JudgeOutage`, `judge_fix`)."""

from __future__ import annotations

import collections
import json
import logging
import math
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .judge import JudgeRequest, JudgeVerdict

logger = logging.getLogger(__name__)

__all__ = [
    "JudgeOutage",
    "PendingJudgement",
    "collect_verdict",
    "judge_fix",
    "optional_text",
    "prompt_text",
    "verdict_text",
]


@dataclass
class PendingJudgement:
    """Judge calls in flight for this rank's batch."""

    requests: list[JudgeRequest]
    futures: list[Future]
    completion_ids: list[list[int]]  # judged tokens of each row (trailing EOS/pad removed)
    verdicts_given: list[str]
    prompt_hashes: list[str]
    start_seconds: float = 0.0  # main-thread time spent marking the traces and submitting the calls

    def matches(self, completion_ids: Any) -> bool:
        """Whether these calls judge the rows of ``completion_ids`` ``(B, T)``, in order."""
        if len(self.futures) != completion_ids.shape[0]:
            return False
        for row, ids in enumerate(self.completion_ids):
            if len(ids) > completion_ids.shape[1] or completion_ids[row, : len(ids)].tolist() != ids:
                return False
        return True

    def cancel(self) -> None:
        """Cancel the calls not started yet (the batch they belong to is gone)."""
        for future in self.futures:
            future.cancel()


class JudgeOutage:
    """Logs the batches in which every judge call failed, naming the endpoint, the error and the fix.

    The first such batch gives a warning (on ``log``); ``loud_batches`` of them in a row an error (again at 2x, 4x, ... as many);
    the first batch with a verdict after an outage says so. Training goes on in every case.
    """

    def __init__(self, client: Any, log: logging.Logger = logger):
        self.client, self.log = client, log
        self.batches = 0  # consecutive batches in which every judge call failed

    def report(self, verdicts: list[JudgeVerdict], step: int, loud_batches: int) -> None:
        """Count a batch's verdicts (at global step ``step``) and log what the count calls for."""
        if not verdicts:
            return
        failed = [verdict for verdict in verdicts if not verdict.ok]
        client = self.client
        url, model = getattr(client, "base_url", "?"), getattr(client, "model", "?")
        if len(failed) < len(verdicts):
            if self.batches:
                self.log.warning(
                    "Judge at %s answers again (step %d) after %d batch(es) in which every call failed.",
                    url,
                    step,
                    self.batches,
                )
            self.batches = 0
            return
        self.batches += 1
        batches, loud = self.batches, max(1, loud_batches)
        if batches != 1 and not (batches % loud == 0 and (batches // loud).bit_count() == 1):
            return
        counts = collections.Counter((v.error_kind, v.error_status, v.error or v.status) for v in failed)
        (kind, status, error), count = counts.most_common(1)[0]
        fix = judge_fix(kind, status, client)
        if batches < loud:
            self.log.warning(
                "Every judge call of this batch failed (%d of %d, step %d) at %s (model %r); the most common error "
                "(%d): %s. These rollouts get zero judge credit and keep their outcome advantage; training goes on "
                "(judge/failure_ratio = 1.0). Fix: %s",
                len(failed),
                len(verdicts),
                step,
                url,
                model,
                count,
                error,
                fix,
            )
        else:
            self.log.error(
                "Every judge call has failed for %d batches in a row (step %d): judge credit is OFF and this run is "
                "training plain GRPO. Judge endpoint %s (model %r), last error: %s. Fix: %s Training goes on; "
                "stop it if judge credit is what you want.",
                batches,
                step,
                url,
                model,
                error,
                fix,
            )


def judge_fix(kind: str | None, status: int | None, client: Any) -> str:
    """What to change for a judge call that failed with this `ChatCallError` kind (and HTTP status)."""
    url, model = getattr(client, "base_url", "?"), getattr(client, "model", "?")
    if kind == "connection":
        return (
            f"nothing answers at {url}: start the judge server (e.g. `vllm serve {model} --port 8000`) or set "
            "judge_base_url to the endpoint that serves it (OpenAI-compatible, usually ending in /v1)."
        )
    if kind == "timeout":
        return (
            f"the endpoint took longer than judge_timeout={getattr(client, 'timeout', '?')} s: check that it is not "
            "overloaded, raise judge_timeout or lower judge_max_concurrency."
        )
    if kind == "rate_limit":
        return "the endpoint rate-limits the judge (HTTP 429): lower judge_max_concurrency or raise judge_max_retries."
    if kind == "client_error" and status in (401, 403):
        return (
            f"the endpoint refused the API key (HTTP {status}): put the key in the environment variable named by "
            f"judge_api_key_env (now {getattr(client, 'api_key_env', None)!r})."
        )
    if kind == "client_error" and status == 404:
        return (
            f"HTTP 404: check that judge_base_url={url!r} is the OpenAI-compatible root (usually ending in /v1) and "
            f"that judge_model={model!r} is a model it serves."
        )
    if kind == "client_error":
        return f"the endpoint rejected the request (HTTP {status}): check judge_model={model!r} and judge_max_tokens."
    if kind == "server_error":
        return f"the judge server fails (HTTP {status}): check its logs."
    if kind == "bad_response":
        return f"the replies of {url} are not chat completions: point judge_base_url at an OpenAI-compatible endpoint."
    if kind == "unparseable":
        return (
            "the judge answers without a span list: use a stronger judge model, or judge_structured_output='on' "
            "where the endpoint supports JSON-schema output."
        )
    return "see the judge's error above (its traceback is logged where the judge crashed) and judge_audit.jsonl."


def collect_verdict(future: Future) -> JudgeVerdict:
    """The verdict of a judge call, or a failed verdict (zero credit) when the call was cancelled or crashed."""
    try:
        return future.result()
    except Exception as error:  # SpanJudge.judge does not raise; this guards against cancellation or a bug
        logger.warning("A judge call ended with %r; the rollout gets zero credit.", error)
        return JudgeVerdict(status="failed", error=f"{type(error).__name__}: {error}", error_kind="internal")


def verdict_text(name: str, value: float) -> str:
    """How the judge is told the verifier's (or the total reward's) score of a rollout."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{name}: not scored"
    return f"{name} = {value:g} (the trainer's score of this rollout; higher is better)"


def prompt_text(prompt: Any) -> str:
    """A prompt (text or chat messages) as one stable string (what the audit log hashes)."""
    if isinstance(prompt, list):
        return json.dumps(
            [m if isinstance(m, dict) else str(m) for m in prompt], ensure_ascii=False, sort_keys=True, default=str
        )
    return str(prompt)


def optional_text(value: Any) -> str | None:
    """A dataset value as text for the judge (None when missing or blank)."""
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if text.strip() else None
