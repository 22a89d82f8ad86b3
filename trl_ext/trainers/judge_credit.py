"""`JudgeCreditTrainer`: an LLM judge marks token spans of each rollout; its credit is added to the per-token
advantage under a λ cap (docs/judge_credit.md).

The trainer is thin; the method lives in `trl_ext.judge`. Per generation batch:

1. As soon as the completions exist (right after generation, before TRL's log-prob passes and rewards), the
   completions are marked (`insert_markers`) and one judge conversation per rollout starts on a background event
   loop — provided the verifier's verdict is already known. With ``judge_verdict_reward`` naming a reward function
   (or ``"auto"`` with a single callable reward), that function runs first, alone, its value is the verdict, and
   TRL later reuses the value instead of calling it again. With ``"total"`` the verdict is the weighted total
   reward, so the judge starts once TRL has computed the rewards.
2. While the judge works, TRL computes old/reference log-probs, the remaining rewards and the group advantages A.
3. `process_scored_batch` waits for the verdicts, turns spans into capped credit (`rollout_credit`: `span_credit`,
   then `cap_credit`, λ = ``judge_lambda``, as the asynchronous trainer does) and sets ``advantages = A[:, None] + c``
   (B, T).

A judge fault (endpoint down, 429/5xx after retries, timeout, unparseable answer) gives that rollout zero credit,
is counted in ``judge/failure_ratio`` and recorded in the audit log; the rollout keeps its outcome advantage. A
judge that does not answer is logged: a warning when the trainer is built (`JudgeCreditTrainer._probe_judge`), and
one when every call of a batch failed, an error once that has lasted ``JudgeCredit.outage_loud_batches`` batches.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..judge.batch import PendingJudgement, verdict_text
from ..judge.credit import per_token_advantages
from ..judge.judge import JudgeVerdict
from ..judge.method import JudgeCredit, verdict_reward_index
from ..methods import METHODS
from ..samples import loss_mask
from .ext_grpo import ExtGRPOTrainer
from .judge_credit_config import JudgeCreditConfig
from .requirements import changed_settings, check_trainer_inputs
from .trl_seam import BatchScope, GeneratedBatch

logger = logging.getLogger(__name__)


@dataclass
class JudgeBatchScope(BatchScope):
    """One generation batch of `JudgeCreditTrainer`: the judge calls in flight, and the verifier's rewards computed
    right after generation (reused when TRL scores the batch)."""

    pending: PendingJudgement | None = None
    verifier_values: list[float] | None = None


class _CachedReward:
    """Stands in for the verifier reward function inside TRL's `_calculate_rewards`, returning the values the
    trainer computed right after generation (so the function runs once per batch)."""

    def __init__(self, values: list[float], name: str):
        self.values, self.__name__ = values, name

    def __call__(self, prompts: list, completions: list, completion_ids: list, **kwargs: Any) -> list[float]:
        if len(self.values) != len(prompts):
            raise RuntimeError(
                f"Cached verifier rewards have {len(self.values)} rows, the batch {len(prompts)}; this is a trl-ext "
                "bug, please report it."
            )
        return self.values


class JudgeCreditTrainer(ExtGRPOTrainer):
    """GRPO with token-span LLM-judge credit (docs/judge_credit.md): ``A_t = A + cap_λ(c)_t``.

    Use like `trl.GRPOTrainer` with a [`JudgeCreditConfig`]. Extra keyword argument ``judge``: a ready
    `trl_ext.judge.SpanJudge` to use instead of the one built from the config (e.g. with a custom Python sandbox).

    Metrics: docs/judge_credit.md ("Metrics"; `trl_ext.judge.metrics.verdict_metrics`, the asynchronous trainer's
    too), and ``judge/latency_p50``, ``judge/wait_s`` and ``judge/blocking_s`` (main-thread time spent on the judge).
    """

    batch_scope_class = JudgeBatchScope

    model_card = METHODS["judge-credit"]

    def __init__(self, model, reward_funcs=None, args: JudgeCreditConfig | None = None, *pargs, judge=None, **kwargs):
        if not isinstance(args, JudgeCreditConfig):
            raise TypeError(
                "JudgeCreditTrainer needs its endpoint settings: pass args=JudgeCreditConfig(output_dir=..., "
                f"judge_base_url=..., judge_model=...), got {type(args).__name__}."
            )
        # What the reward functions need (packages, columns, conversational prompts) and the reference columns set
        # explicitly (their defaults are optional: shown when present) fail now, not at the first batch.
        check_trainer_inputs(
            "JudgeCreditTrainer",
            reward_funcs,
            pargs,
            kwargs,
            column_settings=changed_settings(args, ("judge_answer_column", "judge_solution_column")),
        )
        super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        self.method, sandbox_info = JudgeCredit.from_arguments(
            args,
            self.processing_class,
            stop_ids={*self.eos_token_ids, self.tokenizer.pad_token_id},
            judge=judge,
            rank=self.accelerator.process_index,
        )
        self.judge = self.method.judge
        if sandbox_info is not None:
            self.sandbox_info = sandbox_info  # written to the run info
        self.method.verdict_reward = verdict_reward_index(
            args.judge_verdict_reward,
            self.reward_func_names,
            [not isinstance(func, nn.Module) for func in self.reward_funcs],
        )
        self.method.probe(type(self).__name__, self.args.judge_timeout)

    @property
    def judge_audit_path(self) -> str | None:
        """Where this rank's verdicts are appended (None when the audit log is off)."""
        return None if self.method.audit is None else self.method.audit.path

    def _judging(self) -> bool:
        return self.model.training or self.args.judge_on_eval

    # ------------------------------------------------------------------------------------------------------------
    # Starting the judge as early as TRL's flow allows
    # ------------------------------------------------------------------------------------------------------------
    def on_batch_end(self, scope: JudgeBatchScope) -> None:
        super().on_batch_end(scope)
        if scope.pending is not None:  # an exception left calls in flight: do not leak them into the next batch
            scope.pending.cancel()

    def on_generated(self, prompts: list, generated: GeneratedBatch, scope: JudgeBatchScope) -> None:
        """Run the verifier and start the judge on the raw rollouts, before TRL decodes and scores them."""
        super().on_generated(prompts, generated, scope)
        if self._judging() and self.method.verdict_reward is not None:
            values = self._run_verifier(
                scope.inputs, prompts, generated.completions, generated.completion_ids, generated.extra_fields
            )
            scope.verifier_values = values
            name = self.reward_func_names[self.method.verdict_reward]
            scope.pending = self.method.start(
                prompts, generated.completion_ids, scope.inputs, [verdict_text(name, v) for v in values]
            )

    def _run_verifier(
        self, inputs: list, prompts: list, completions: list, completion_ids_list: list, extra_fields: dict
    ) -> list:
        """Call the verifier reward function on this rank's rollouts, with the kwargs TRL would pass it."""
        rows = [dict(row) for row in inputs]
        for i, row in enumerate(rows):  # TRL merges rollout_func extra fields into the rows before scoring
            for key, values in (extra_fields or {}).items():
                if isinstance(values, list):
                    if i < len(values):
                        row[key] = values[i]
                else:
                    row[key] = values
        keys = [key for key in rows[0] if key not in ("prompt", "completion", "completion_ids")]
        kwargs: dict[str, Any] = {key: [row.get(key) for row in rows] for key in keys}
        kwargs.update(trainer_state=self.state, **self.reward_logging_kwargs())
        if self.environments is not None:
            kwargs["environments"] = self.environments
        func, name = self.reward_funcs[self.method.verdict_reward], self.reward_func_names[self.method.verdict_reward]
        call = dict(prompts=prompts, completions=completions, completion_ids=completion_ids_list, **kwargs)
        if _is_async(func):
            values = asyncio.run_coroutine_threadsafe(func(**call), self.async_loop).result()
        else:
            values = func(**call)
        values = [math.nan if value is None else float(value) for value in values]
        if len(values) != len(prompts):
            raise ValueError(
                f"The reward function '{name}' returned {len(values)} rewards "
                f"for {len(prompts)} completions; return one per completion."
            )
        return values

    def compute_rewards(self, inputs, prompts, completions, completion_ids_list):
        scope = self.batch_scope
        cached, scope.verifier_values = scope.verifier_values, None
        if cached is not None:
            index = self.method.verdict_reward
            original = self.reward_funcs[index]
            self.reward_funcs[index] = _CachedReward(cached, self.reward_func_names[index])
            try:
                rewards_per_func = super().compute_rewards(inputs, prompts, completions, completion_ids_list)
            finally:
                self.reward_funcs[index] = original
        else:
            rewards_per_func = super().compute_rewards(inputs, prompts, completions, completion_ids_list)
        if self._judging() and scope.pending is None:
            scope.rewards_per_func = rewards_per_func
            totals = self._local_rewards(scope, len(prompts)).tolist()
            scope.pending = self.method.start(
                prompts, completion_ids_list, inputs, [verdict_text("reward", v) for v in totals]
            )
        return rewards_per_func

    # ------------------------------------------------------------------------------------------------------------
    # The hook: credit into per-token advantages
    # ------------------------------------------------------------------------------------------------------------
    def process_scored_batch(self, batch: dict[str, Any], inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """Wait for the verdicts of this batch and set ``advantages = A[:, None] + cap_λ(c)`` (B, T)."""
        batch = super().process_scored_batch(batch, inputs)
        if not self._judging():
            return batch
        entered = time.perf_counter()
        completion_ids = batch["completion_ids"]
        length = completion_ids.shape[1]
        scope = self.batch_scope
        pending, scope.pending = scope.pending, None
        if pending is None or not pending.matches(completion_ids):
            if pending is not None:
                logger.warning("Judge calls do not match the scored batch's rows; judging the batch again.")
                pending.cancel()
            pending = self._judge_from_batch(batch, inputs)

        waited = time.perf_counter()
        verdicts = self.method.collect(pending)
        waited = time.perf_counter() - waited

        trained = loss_mask(batch)
        # The cap's mean |c| runs over the trained tokens the judge read (not the trailing EOS/pad it never sees).
        credit = torch.stack(
            [
                self.method.credit(verdict, length, len(ids), trained=trained[row].cpu())
                for row, (verdict, ids) in enumerate(zip(verdicts, pending.completion_ids, strict=True))
            ]
        )
        advantages = batch["advantages"]
        credit = credit.to(device=advantages.device, dtype=advantages.dtype)
        if advantages.dim() == 1:
            batch["advantages"] = per_token_advantages(advantages, credit)
        else:  # an earlier hook already made them per-token
            batch["advantages"] = advantages + credit
        keep = trained.to(device=credit.device, dtype=credit.dtype)
        outcome = advantages.abs() if advantages.dim() == 2 else advantages.abs().unsqueeze(1)
        metrics = self.method.finish(
            pending,
            verdicts,
            credit_mass=(credit.abs() * keep).sum(),
            outcome_mass=(outcome.to(credit.dtype) * keep).sum(),
            step=self.state.global_step,
            mode=self.mode,
            rank=self.accelerator.process_index,
        )
        blocking = pending.start_seconds + time.perf_counter() - entered
        self._log_judge_metrics(metrics, verdicts, waited, blocking)
        return batch

    def _judge_from_batch(self, batch: dict[str, Any], inputs: list[dict[str, Any]]) -> PendingJudgement:
        """Start the judge from the scored batch itself (when the early start did not happen or does not match)."""
        mask = batch["completion_mask"].bool()
        ids = [row[m].tolist() for row, m in zip(batch["completion_ids"], mask)]
        rewards = batch.get("rewards")
        totals = rewards.tolist() if rewards is not None else [math.nan] * len(ids)
        prompts = [row.get("prompt", "") for row in inputs]
        return self.method.start(prompts, ids, inputs, [verdict_text("reward", v) for v in totals])

    def _log_judge_metrics(
        self, metrics: dict[str, Any], verdicts: list[JudgeVerdict], waited: float, blocking: float
    ) -> None:
        # One generation batch is every rank's: its counts summed over the ranks; a rate with nothing counted is not
        # logged (as the asynchronous trainer).
        self.log_rollout_metrics(
            metrics, counts=[name for name, value in metrics.items() if not isinstance(value, tuple)]
        )
        wait_s, blocking_s = self.global_max(waited, blocking).tolist()
        device = self.accelerator.device
        latencies = self.accelerator.gather(torch.tensor([v.latency_s for v in verdicts], device=device)).tolist()
        self.log_metric("judge/latency_p50", statistics.median(latencies) if latencies else 0.0)
        self.log_metric("judge/wait_s", wait_s)
        self.log_metric("judge/blocking_s", blocking_s)


def _is_async(func: Any) -> bool:
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)
