"""`JudgeRolloutWorker`: TRL's ``RolloutWorkerProtocol`` producing judged samples (docs/judge_credit.md).

A background thread of the trainer process loops: for ``groups_per_run`` prompts of the dataset (in order, cycling),
``num_generations`` completions each from the policy (one batched generator call: ``vllm serve``'s latest published
adapter, `ServedPolicyGenerator`); the verifier rewards (the reward functions, weighted and summed; None is skipped);
the group advantage ``A`` (`trl_ext.advantages.group_advantages`); then one judge conversation per rollout
(`SpanJudge`, on the worker's own event loop, every call of the run concurrently), its spans turned into ``cap_λ(c)``
(`trl_ext.judge.credit.rollout_credit`); and one `RolloutSample` per rollout (`judged_sample`) into ``rollout_buffer``.
The judge's time is the worker's, so it overlaps training.

Faults. A judge fault (endpoint down, 429/5xx after retries, timeout, unparseable answer, a crash) gives that rollout
zero credit: it keeps its outcome advantage, is counted in ``judge/failure_ratio`` and recorded in the audit log,
and the outage is logged as by the synchronous trainer (`JudgeOutage`); it never stops the worker. A failing run
(the generator, a reward function) is logged with its traceback, counted in ``judge/worker_errors_total`` and
retried with the next prompts; ``max_consecutive_errors`` failures in a row stop the thread, and then `check_health`
(called by the trainer while it waits for samples) raises with the cause.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...judge.audit import JudgeAuditLog, audit_record, text_hash
from ...judge.batch import JudgeOutage, collect_verdict, optional_text, prompt_text, verdict_text
from ...judge.credit import rollout_credit
from ...judge.event_loop import BackgroundEventLoop
from ...judge.judge import JudgeRequest, JudgeVerdict, SpanJudge, extract_final_answer
from ...judge.markers import build_marked_trace
from ...judge.metrics import verdict_metrics
from ...text import last_user_text
from ..group_worker import GroupRolloutWorker, ScoredGroup
from .samples import judged_sample

logger = logging.getLogger(__name__)

__all__ = ["JudgeRolloutWorker"]


class JudgeRolloutWorker(GroupRolloutWorker):
    """Judged rollouts for TRL's asynchronous trainer (``rollout_worker=``), in a thread of this process.

    Args:
        judge: the `SpanJudge`; its ``label_scores`` score the spans.
        judge_lambda: λ of the cap (`rollout_credit`).
        marker_every: the judge's markers (`build_marked_trace`).
        verdict_reward: the index of the reward function whose value the judge is shown, or None for the total.
        answer_column, solution_column: the dataset columns of the reference answer / worked solution (shown to the
            judge when present).
        audit: where every verdict is appended (None: not recorded).
        step: the trainer's global step, for the audit records and the outage log.
        outage_loud_batches: runs in which every judge call failed before the outage warning becomes an error.
        worker_args: those of `ThreadedRolloutWorker` (``dataset``, ``reward_funcs``, ``tokenizer`` (the judge reads
            its decoded tokens), ``generator``, ``num_generations``, ``groups_per_run`` (their judge calls
            concurrent), ``scale_rewards`` (``"none"`` here by default: Dr. GRPO), ...).

    Attributes:
        rollout_buffer, metrics_queue: what TRL's trainer drains (``RolloutWorkerProtocol``).
        model_version: the version last published by the trainer.
        errors: failed runs so far; groups: groups scored so far; last_verdicts: the verdicts of the last run.
    """

    worker_name = "judge"
    metric_prefix = "judge"
    stale_advice = ": the policy server or the judge may hang; lower judge_timeout"

    def __init__(
        self,
        *,
        judge: SpanJudge,
        judge_lambda: float = 0.25,
        marker_every: int = 64,
        verdict_reward: int | None = None,
        answer_column: str = "answer",
        solution_column: str = "solution",
        audit: JudgeAuditLog | None = None,
        step: Callable[[], int] = lambda: 0,
        outage_loud_batches: int = 5,
        **worker_args: Any,
    ) -> None:
        worker_args.setdefault("scale_rewards", "none")
        super().__init__(advantage_fn=None, **worker_args)
        if verdict_reward is not None and not 0 <= verdict_reward < len(self.reward_funcs):
            raise ValueError(f"verdict_reward={verdict_reward} is not the index of one of the reward functions.")
        self.judge = judge
        self.judge_lambda = judge_lambda
        self.marker_every = marker_every
        self.verdict_reward = verdict_reward
        self.answer_column, self.solution_column = answer_column, solution_column
        self.audit = audit
        self.step = step
        self.outage_loud_batches = outage_loud_batches
        self.stop_ids = {t for t in (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id) if t is not None}
        self.last_verdicts: list[JudgeVerdict] = []
        self._outage = JudgeOutage(judge.client, log=logger)
        self._loop: BackgroundEventLoop | None = None

    def _on_stopped(self) -> None:
        """Close the judge's event loop once the thread has ended."""
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    # ------------------------------------------------------------------------------ one run
    def rollout(self, rows: Sequence[dict[str, Any]]) -> list[Any]:
        """Sample, score, judge and turn into samples ``num_generations`` rollouts of each of ``rows``."""
        version = self.model_version  # the version the completions are sampled from
        groups = [self._judge_requests(group) for group in self.sample_groups(rows)]
        started = time.perf_counter()
        verdicts = self._judge([rollout for group in groups for rollout in group])
        waited = time.perf_counter() - started
        self._tick()
        self.last_verdicts = verdicts
        samples, rollouts = [], [rollout for group in groups for rollout in group]
        credit_mass = outcome_mass = 0.0
        for rollout, verdict in zip(rollouts, verdicts, strict=True):
            spans = verdict.spans if verdict.ok else []
            credit = rollout_credit(
                spans,
                len(rollout["completion"].token_ids),
                len(rollout["judged_ids"]),
                self.judge.label_scores,
                self.judge_lambda,
            ).numpy()
            credit_mass += float(abs(credit).sum())
            outcome_mass += abs(rollout["advantage"]) * len(credit)
            samples.append(
                judged_sample(
                    rollout["prompt_ids"],
                    rollout["completion"].token_ids,
                    rollout["completion"].logprobs,
                    advantage=rollout["advantage"],
                    credit=credit,
                    model_version=version,
                    group_id=rollout["group_id"],
                    metrics=rollout["metrics"],
                    prompt=rollout["prompt"],
                    completion=rollout["text"],
                )
            )
        self._write_audit(rollouts, verdicts, version)
        self._outage.report(verdicts, self.step(), self.outage_loud_batches)
        self._push_judge_metrics(verdicts, credit_mass, outcome_mass, waited)
        return samples

    def _judge_requests(self, group: ScoredGroup) -> list[dict]:
        """A scored group's judge requests, with what its samples carry: one dict per rollout."""
        if self.verdict_reward is None:
            name, shown = "reward", group.rewards
        else:
            name, shown = self.reward_func_names[self.verdict_reward], group.per_func[self.verdict_reward]
        row, rollouts = group.row, []
        for index, (completion, text) in enumerate(zip(group.completions, group.texts, strict=True)):
            ids = list(completion.token_ids)
            while ids and ids[-1] in self.stop_ids:  # the judge reads the text, not the end-of-sequence tokens
                ids.pop()
            trace = build_marked_trace(self.tokenizer, ids, every=self.marker_every)
            rollouts.append(
                {
                    "prompt": row["prompt"],
                    "prompt_ids": group.prompt_ids,
                    "completion": completion,
                    "text": text,
                    "judged_ids": ids,
                    "advantage": group.advantages[index],
                    "group_id": group.group_id,
                    "metrics": group.metrics(index, self.reward_func_names),
                    "verdict_given": verdict_text(name, shown[index]),
                    "request": JudgeRequest(
                        trace=trace,
                        question=last_user_text(row["prompt"]),
                        final_answer=extract_final_answer(trace.text),
                        verdict=verdict_text(name, shown[index]),
                        reference_answer=optional_text(row.get(self.answer_column)),
                        reference_solution=optional_text(row.get(self.solution_column)),
                    ),
                }
            )
        return rollouts

    def _judge(self, rollouts: list[dict]) -> list[JudgeVerdict]:
        """Every rollout's verdict, the calls concurrent on the worker's event loop; a fault is a failed verdict."""
        if self._loop is None:
            self._loop = BackgroundEventLoop(name="trl-ext-async-judge-loop")
        futures = [self._loop.submit(self.judge.judge(rollout["request"])) for rollout in rollouts]
        return [collect_verdict(future) for future in futures]

    def _write_audit(self, rollouts: list[dict], verdicts: list[JudgeVerdict], version: int) -> None:
        if self.audit is None:
            return
        step = self.step()
        records = [
            audit_record(
                step=step,
                mode="train",
                rank=0,
                row=row,
                model_version=version,
                group_id=rollout["group_id"],
                prompt_hash=text_hash(prompt_text(rollout["prompt"])),
                trace=rollout["request"].trace,
                verdict_given=rollout["verdict_given"],
                judge_model=self.judge.client.model,
                verdict=verdict,
            )
            for row, (rollout, verdict) in enumerate(zip(rollouts, verdicts, strict=True))
        ]
        try:
            self.audit.write(records)
        except OSError as error:  # a full disk must not stop training either
            logger.warning("Judge audit records not written (training goes on): %s", error)

    def _push_judge_metrics(
        self, verdicts: list[JudgeVerdict], credit_mass: float, outcome_mass: float, waited: float
    ) -> None:
        metrics: dict[str, Any] = verdict_metrics(verdicts, self.judge.label_scores, credit_mass, outcome_mass)
        metrics = {name: value for name, value in metrics.items() if not (isinstance(value, tuple) and not value[1])}
        metrics["judge/latency_p50"] = statistics.median(v.latency_s for v in verdicts) if verdicts else 0.0
        metrics["judge/wait_s"] = waited
        self._push_metrics(metrics)
