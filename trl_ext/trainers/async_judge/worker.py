"""`JudgeRolloutWorker`: TRL's ``RolloutWorkerProtocol`` producing judged samples (docs/judge_credit.md).

A background thread of the trainer process loops: for ``groups_per_run`` prompts of the dataset (in order, cycling),
``num_generations`` completions each from the policy (one batched generator call: ``vllm serve``'s latest published
adapter, `ServedPolicyGenerator`); the verifier rewards (the reward functions, weighted and summed; None is skipped);
the group advantage ``A`` (`trl_ext.advantages.group_advantages`); then one judge conversation per rollout
(`trl_ext.judge.method.JudgeCredit`, the method the synchronous trainer drives too: every call of the run concurrent
on its event loop), its spans turned into ``cap_λ(c)``; and one `RolloutSample` per rollout into ``rollout_buffer``,
with ``A`` as its advantage and ``cap_λ(c)`` as its token credit (`ScoredGroup.training_sample`, `to_rollout_sample`:
the collator adds the credit to TRL's per-token advantages, `trl_ext.trainers.async_seam.credit`).
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

from ...judge.batch import verdict_text
from ...judge.judge import JudgeVerdict
from ...judge.method import JudgeCredit
from ..async_worker import to_rollout_sample
from ..group_worker import GroupRolloutWorker, ScoredGroup

logger = logging.getLogger(__name__)

__all__ = ["JudgeRolloutWorker"]


class JudgeRolloutWorker(GroupRolloutWorker):
    """Judged rollouts for TRL's asynchronous trainer (``rollout_worker=``), in a thread of this process.

    Args:
        method: the `JudgeCredit` (judge, λ, markers, reference columns, audit log); its event loop is closed when
            the thread ends.
        verdict_reward: the index of the reward function whose value the judge is shown, or None for the total.
        step: the trainer's global step, for the audit records and the outage log.
        worker_args: those of `ThreadedRolloutWorker` (``dataset``, ``reward_funcs``, ``tokenizer``, ``generator``,
            ``num_generations``, ``groups_per_run`` (their judge calls concurrent), ``scale_rewards`` (``"none"``
            here by default: Dr. GRPO), ...).

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
        method: JudgeCredit,
        verdict_reward: int | None = None,
        step: Callable[[], int] = lambda: 0,
        **worker_args: Any,
    ) -> None:
        worker_args.setdefault("scale_rewards", "none")
        super().__init__(advantage_fn=None, **worker_args)
        if verdict_reward is not None and not 0 <= verdict_reward < len(self.reward_funcs):
            raise ValueError(f"verdict_reward={verdict_reward} is not the index of one of the reward functions.")
        self.method = method
        self.verdict_reward = verdict_reward
        self.step = step
        self.last_verdicts: list[JudgeVerdict] = []

    def _on_stopped(self) -> None:
        """Close the judge's event loop once the thread has ended."""
        self.method.close()

    # ------------------------------------------------------------------------------ one run
    def rollout(self, rows: Sequence[dict[str, Any]]) -> list[Any]:
        """Sample, score, judge and turn into samples ``num_generations`` rollouts of each of ``rows``."""
        version = self.model_version  # the version the completions are sampled from
        groups = self.sample_groups(rows)
        rollouts = [(group, index) for group in groups for index in range(len(group.completions))]
        pending = self.method.start(
            [group.row["prompt"] for group, _ in rollouts],
            [group.completions[index].token_ids for group, index in rollouts],
            [group.row for group, _ in rollouts],
            [self._verdict_given(group, index) for group, index in rollouts],
        )
        started = time.perf_counter()
        verdicts = self.method.collect(pending)
        waited = time.perf_counter() - started
        self._tick()
        self.last_verdicts = verdicts
        samples, credit_mass, outcome_mass = [], 0.0, 0.0
        for (group, index), verdict, judged in zip(rollouts, verdicts, pending.completion_ids, strict=True):
            completion = group.completions[index]
            credit = self.method.credit(verdict, len(completion.token_ids), len(judged)).numpy()
            credit_mass += float(abs(credit).sum())
            outcome_mass += abs(group.advantages[index]) * len(credit)
            sample = group.training_sample(index, self.reward_func_names, token_credit=credit.tolist())
            samples.append(to_rollout_sample(sample, version))
        metrics: dict[str, Any] = self.method.finish(
            pending,
            verdicts,
            credit_mass=credit_mass,
            outcome_mass=outcome_mass,
            step=self.step(),
            sources=lambda row: {"model_version": version, "group_id": rollouts[row][0].group_id},
        )
        metrics["judge/latency_p50"] = statistics.median(v.latency_s for v in verdicts) if verdicts else 0.0
        metrics["judge/wait_s"] = waited
        metrics["judge/blocking_s"] = 0.0  # the training step never waits for the judge: the worker does
        self._push_metrics(metrics)
        return samples

    def _verdict_given(self, group: ScoredGroup, index: int) -> str:
        """What the judge is told the rollout scored: the verdict reward's value, or the weighted total."""
        if self.verdict_reward is None:
            return verdict_text("reward", group.rewards[index])
        return verdict_text(self.reward_func_names[self.verdict_reward], group.per_func[self.verdict_reward][index])
