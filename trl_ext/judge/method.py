"""Token-span judge credit as one object both trainers drive (docs/judge_credit.md): `JudgeCredit` knows the judge,
its settings, its event loop, its audit log and its outage log, and nothing of the training loop.

A runtime hands it rollouts and gets back what it trains on and logs:

1. `JudgeCredit.start`: one judge conversation per rollout (the completion's tokens less their trailing stop tokens,
   marked every ``marker_every`` tokens; the question, the final answer, the verdict the judge is shown and the
   dataset's reference answer / solution), every call concurrent on the method's event loop;
2. `JudgeCredit.collect`: the verdicts (a fault is a failed verdict: zero credit);
3. `JudgeCredit.credit`: one rollout's capped credit ``cap_λ(c)`` (`trl_ext.judge.credit.rollout_credit`);
4. `JudgeCredit.finish`: the audit lines (`trl_ext.judge.audit.audit_record`), the outage log (`JudgeOutage`) and
   the metrics (`trl_ext.judge.metrics.verdict_metrics`).

`JudgeCreditTrainer` (on TRL's ``GRPOTrainer``) calls these on each generation batch; on TRL's asynchronous trainer
the rollout worker calls `JudgeCredit.rollout` on each run, which samples and scores the groups and calls the same
four. `verdict_reward_index` reads ``judge_verdict_reward`` for both (`JudgeCredit.verdict_reward`), and
`JudgeCredit.probe` is their start-up check of the endpoint.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..jsonl import rewrite_jsonl, written_after
from ..rollouts import RolloutMethod, RolloutRuntime, ScoredGroup
from ..samples import TrainingSample
from ..text import last_user_text
from .audit import JudgeAuditLog, audit_record, text_hash
from .batch import (
    JudgeOutage,
    PendingJudgement,
    collect_verdict,
    judge_fix,
    optional_text,
    prompt_text,
    verdict_text,
)
from .credit import rollout_credit
from .event_loop import BackgroundEventLoop
from .judge import JudgeRequest, JudgeVerdict, SpanJudge, extract_final_answer
from .markers import build_marked_trace
from .metrics import verdict_metrics

logger = logging.getLogger(__name__)

__all__ = ["AUDIT_FILE", "JudgeCredit", "verdict_reward_index"]

AUDIT_FILE = "judge_audit.jsonl"  # in output_dir; rank k > 0 of the synchronous trainer: judge_audit.rank<k>.jsonl
PROBE_TIMEOUT_S = 10.0  # the longest the start-up check of the judge endpoint may take


def verdict_reward_index(setting: str, names: Sequence[str], callables: Sequence[bool]) -> int | None:
    """The reward function whose value the judge is shown (``judge_verdict_reward``), or None for the total.

    Args:
        setting: ``"total"``, ``"auto"`` (the only reward function when there is one and it is callable, else the
            total) or a reward function's name.
        names: the reward functions' names, in order.
        callables: for each, whether it is a callable (a verifier) rather than a reward model.
    """
    if setting == "total":
        return None
    if setting == "auto":
        return 0 if len(names) == 1 and callables[0] else None
    if setting not in names:
        raise ValueError(
            f"judge_verdict_reward={setting!r} is not a reward function of this trainer ({list(names)}); use one of "
            "those names, 'auto' or 'total'."
        )
    index = list(names).index(setting)
    if not callables[index]:
        raise ValueError(
            f"judge_verdict_reward={setting!r} is a reward model; name a callable reward function (a verifier) or "
            "use 'total'."
        )
    return index


class JudgeCredit(RolloutMethod):
    """The judge-credit method of one trainer: requests, credit, audit, outage and metrics (module docstring).

    Args:
        judge: the `SpanJudge`; its ``label_scores`` score the spans.
        tokenizer: decodes the judged tokens into the marked trace.
        stop_ids: the tokens stripped from a completion's end before judging (None: the tokenizer's EOS and pad).
        judge_lambda: λ of the cap (`rollout_credit`).
        marker_every: the judge's markers (`build_marked_trace`).
        answer_column, solution_column: the dataset columns of the reference answer / worked solution (shown to the
            judge when present).
        audit_path: where every verdict is appended (None: not recorded).
        outage_loud_batches: consecutive batches in which every judge call failed before the outage warning becomes an
            error (then repeated at 2x, 4x, ... that many batches): by then the run is plain GRPO.
        loop_name: the name of the event loop's thread.

    Attributes:
        verdict_reward: the index of the reward function whose value the judge is shown, or None for the weighted
            total (`verdict_reward_index`; set by the trainer once it knows its reward functions).
        last_verdicts: the verdicts of the last asynchronous run (for inspection).
    """

    name = "judge"
    metric_prefix = "judge"
    stale_advice = ": the policy server or the judge may hang; lower judge_timeout"

    def __init__(
        self,
        judge: SpanJudge,
        tokenizer: Any,
        *,
        stop_ids: set[int] | None = None,
        judge_lambda: float = 0.25,
        marker_every: int = 64,
        answer_column: str = "answer",
        solution_column: str = "solution",
        audit_path: str | os.PathLike[str] | None = None,
        outage_loud_batches: int = 5,
        loop_name: str = "trl-ext-judge-loop",
    ) -> None:
        if stop_ids is None:
            stop_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
        self.judge, self.tokenizer, self.stop_ids = judge, tokenizer, {t for t in stop_ids if t is not None}
        self.judge_lambda, self.marker_every = judge_lambda, marker_every
        self.answer_column, self.solution_column = answer_column, solution_column
        self.audit = None if audit_path is None else JudgeAuditLog(audit_path)
        self.outage_loud_batches = outage_loud_batches
        self.outage = JudgeOutage(judge.client, log=logger)
        self._loop_name, self._loop = loop_name, None
        self.verdict_reward: int | None = None
        self.last_verdicts: list[JudgeVerdict] = []

    @classmethod
    def from_arguments(
        cls, args: Any, tokenizer: Any, *, judge: SpanJudge | None = None, rank: int = 0, **kwargs: Any
    ) -> tuple[JudgeCredit, Any]:
        """The method of a `JudgeCreditArguments` config, and its sandbox report (`configured_judge`): its judge
        (``judge`` when given), λ, markers, columns and the audit log ``<output_dir>/judge_audit.jsonl`` (rank
        ``rank`` > 0: ``judge_audit.rank<rank>.jsonl``) when ``judge_audit_log`` is on; ``kwargs``: the other
        arguments (``stop_ids``, ``outage_loud_batches``, ``loop_name``)."""
        judge, sandbox_info = args.configured_judge(judge)
        audit_path = None
        if args.judge_audit_log and args.output_dir:
            name = AUDIT_FILE if rank == 0 else AUDIT_FILE.replace(".jsonl", f".rank{rank}.jsonl")
            audit_path = os.path.join(args.output_dir, name)
        method = cls(
            judge,
            tokenizer,
            judge_lambda=args.judge_lambda,
            marker_every=args.marker_every,
            answer_column=args.judge_answer_column,
            solution_column=args.judge_solution_column,
            audit_path=audit_path,
            **kwargs,
        )
        return method, sandbox_info

    @property
    def loop(self) -> BackgroundEventLoop:
        """The event loop the judge calls run on (started on first use, again after `close`)."""
        if self._loop is None:
            self._loop = BackgroundEventLoop(name=self._loop_name)
        return self._loop

    def close(self) -> None:
        """Stop the event loop (a later call starts a new one)."""
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    # ------------------------------------------------------------------------------ start-up
    def probe(self, owner: str, timeout: float) -> None:
        """Warn (naming ``owner``, the trainer) when the judge endpoint does not answer or does not serve the judge
        model. Advice only: a judge that is down at start may come up later, and a failing judge never stops
        training (its rollouts get zero credit, counted)."""
        client = self.judge.client
        if not hasattr(client, "probe"):
            return
        try:
            probe = self.loop.run(client.probe(timeout=min(timeout, PROBE_TIMEOUT_S)))
        except Exception as error:  # the probe is advice: it must never stop the trainer
            logger.debug("Judge endpoint probe of %s failed: %r", client.base_url, error)
            return
        if not probe.ok:
            logger.warning(
                "%s: the judge endpoint %s does not answer (%s). Training will run, but until it answers every "
                "rollout gets zero judge credit (counted in judge/failure_ratio). Fix: %s",
                owner,
                client.base_url,
                probe.error.detail,
                judge_fix(probe.error.kind, probe.error.status, client),
            )
        elif probe.models and client.model not in probe.models:
            logger.warning(
                "%s: the judge endpoint %s serves %s, not judge_model=%r: every judge call may fail and its rollouts "
                "get zero credit. Set judge_model to the name the endpoint serves.",
                owner,
                client.base_url,
                probe.models,
                client.model,
            )

    # ------------------------------------------------------------------------------ one batch
    def start(
        self,
        prompts: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        rows: Sequence[Mapping[str, Any]],
        verdicts: Sequence[str],
    ) -> PendingJudgement:
        """Start one judge conversation per rollout: ``prompts[i]`` (text or chat messages), its completion's token
        ids, its dataset row (the reference columns) and the verdict the judge is shown (`verdict_text`)."""
        started = time.perf_counter()
        requests, judged_ids = [], []
        for prompt, ids, row, verdict in zip(prompts, completion_ids, rows, verdicts, strict=True):
            ids = [int(t) for t in (ids.tolist() if hasattr(ids, "tolist") else ids)]
            while ids and ids[-1] in self.stop_ids:  # the judge reads the text, not the end-of-sequence tokens
                ids.pop()
            trace = build_marked_trace(self.tokenizer, ids, every=self.marker_every)
            requests.append(
                JudgeRequest(
                    trace=trace,
                    question=last_user_text(prompt),
                    final_answer=extract_final_answer(trace.text),
                    verdict=verdict,
                    reference_answer=optional_text(row.get(self.answer_column)),
                    reference_solution=optional_text(row.get(self.solution_column)),
                )
            )
            judged_ids.append(ids)
        return PendingJudgement(
            requests=requests,
            futures=[self.loop.submit(self.judge.judge(request)) for request in requests],
            completion_ids=judged_ids,
            verdicts_given=list(verdicts),
            prompt_hashes=[text_hash(prompt_text(prompt)) for prompt in prompts],
            start_seconds=time.perf_counter() - started,
        )

    @staticmethod
    def collect(pending: PendingJudgement) -> list[JudgeVerdict]:
        """The verdicts of ``pending``'s calls, in order, waiting for them (a fault: a failed verdict)."""
        return [collect_verdict(future) for future in pending.futures]

    def credit(
        self, verdict: JudgeVerdict, length: int, judged_length: int, trained: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One rollout's ``(length,)`` capped credit ``cap_λ(c)`` from its verdict (none when the call failed): the
        first ``judged_length`` tokens were judged; ``trained`` ``(length,)`` marks the tokens the loss sees (the
        cap's mean runs over the judged trained ones)."""
        spans = verdict.spans if verdict.ok else []
        return rollout_credit(
            spans, length, judged_length, self.judge.label_scores, self.judge_lambda, trained=trained
        )

    def finish(
        self,
        pending: PendingJudgement,
        verdicts: Sequence[JudgeVerdict],
        *,
        credit_mass: float,
        outcome_mass: float,
        step: int,
        mode: str = "train",
        rank: int = 0,
        sources: Callable[[int], Mapping[str, Any]] | None = None,
    ) -> dict[str, float | tuple[float, float]]:
        """Record a batch's verdicts and return its metrics.

        Appends one audit line per rollout (``sources(row)``: extra keys of that line, such as the asynchronous
        trainer's ``model_version`` and ``group_id``), reports an outage (`JudgeOutage`) and returns
        `verdict_metrics` (``credit_mass``: Σ|c|, ``outcome_mass``: Σ|A| over the trained completion tokens).
        """
        self._write_audit(pending, verdicts, step=step, mode=mode, rank=rank, sources=sources)
        self.outage.report(list(verdicts), step, self.outage_loud_batches)
        return verdict_metrics(verdicts, self.judge.label_scores, credit_mass, outcome_mass)

    def discard_records_after(self, step: int, writer: str) -> None:
        """Drop the audit records of the steps after ``step`` (a resumed run writes them again)."""
        if self.audit is None:
            return
        keep = lambda record: not written_after(record.get("mode"), record.get("step", 0), step)  # noqa: E731
        dropped = rewrite_jsonl(self.audit.path, keep=keep)
        if dropped:
            logger.info("Dropped %d judge audit record(s) of steps after %d from %s.", dropped, step, self.audit.path)

    # ------------------------------------------------------------------------------ one asynchronous run
    def rollout(self, rows: Sequence[dict[str, Any]], runtime: RolloutRuntime, version: int) -> list[TrainingSample]:
        """Sample and score a group per row, judge every rollout (the calls of the run concurrent) and return one
        sample per rollout: its group advantage ``A`` and its capped credit ``cap_λ(c)`` as token credit. A judge
        fault gives that rollout zero credit (counted, audited); the judge's wait is the worker's, so it overlaps
        training (``judge/blocking_s`` is 0)."""
        groups = runtime.sample_groups(rows)
        rollouts = [(group, index) for group in groups for index in range(len(group.completions))]
        pending = self.start(
            [group.row["prompt"] for group, _ in rollouts],
            [group.completions[index].token_ids for group, index in rollouts],
            [group.row for group, _ in rollouts],
            [self._verdict_given(group, index, runtime.reward_func_names) for group, index in rollouts],
        )
        started = time.perf_counter()
        verdicts = self.collect(pending)
        waited = time.perf_counter() - started
        runtime.tick()
        self.last_verdicts = verdicts
        samples, credit_mass, outcome_mass = [], 0.0, 0.0
        for (group, index), verdict, judged in zip(rollouts, verdicts, pending.completion_ids, strict=True):
            credit = self.credit(verdict, len(group.completions[index].token_ids), len(judged)).numpy()
            credit_mass += float(abs(credit).sum())
            outcome_mass += abs(group.advantages[index]) * len(credit)
            samples.append(group.training_sample(index, runtime.reward_func_names, token_credit=credit.tolist()))
        metrics: dict[str, Any] = self.finish(
            pending,
            verdicts,
            credit_mass=credit_mass,
            outcome_mass=outcome_mass,
            step=runtime.step(),
            sources=lambda row: {"model_version": version, "group_id": rollouts[row][0].group_id},
        )
        metrics["judge/latency_p50"] = statistics.median(v.latency_s for v in verdicts) if verdicts else 0.0
        metrics["judge/wait_s"] = waited
        metrics["judge/blocking_s"] = 0.0  # the training step never waits for the judge: the worker does
        runtime.push_metrics(metrics)
        return samples

    def _verdict_given(self, group: ScoredGroup, index: int, names: Sequence[str]) -> str:
        """What the judge is told the rollout scored: the verdict reward's value, or the weighted total."""
        if self.verdict_reward is None:
            return verdict_text("reward", group.rewards[index])
        return verdict_text(names[self.verdict_reward], group.per_func[self.verdict_reward][index])

    def _write_audit(
        self,
        pending: PendingJudgement,
        verdicts: Sequence[JudgeVerdict],
        *,
        step: int,
        mode: str,
        rank: int,
        sources: Callable[[int], Mapping[str, Any]] | None,
    ) -> None:
        if self.audit is None:
            return
        records = [
            audit_record(
                step=step,
                mode=mode,
                rank=rank,
                row=row,
                **(sources(row) if sources is not None else {}),
                prompt_hash=pending.prompt_hashes[row],
                trace=request.trace,
                verdict_given=pending.verdicts_given[row],
                judge_model=self.judge.client.model,
                verdict=verdict,
            )
            for row, (request, verdict) in enumerate(zip(pending.requests, verdicts, strict=True))
        ]
        try:
            self.audit.write(records)
        except OSError as error:  # a full disk must not stop training either
            logger.warning(
                "Judge audit records of step %d not written (training goes on; the log keeps its earlier records): %s",
                step,
                error,
            )
