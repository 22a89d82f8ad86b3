"""`AsyncJudgeCreditTrainer`: token-span judge credit (docs/judge_credit.md) on TRL's asynchronous trainer.

TRL's ``AsyncGRPOTrainer`` trains on whatever its ``rollout_worker`` pushes; here that is `JudgeRolloutWorker`, which
samples from the policy served by ``vllm serve`` (`ServedPolicyGenerator`, the latest published adapter), scores
with the reward functions, computes the group advantage ``A``, asks the judge (its calls overlap training) and pushes
one sample per rollout with ``A`` and its capped credit ``cap_λ(c)``. The collator adds the credit to TRL's per-token
advantages (`trl_ext.trainers.async_seam.TokenCreditCollator`), so every loss, TRL's PPO-clip (``"dapo"``) or
trl-ext's (``"ipo"``, the default), trains on ``A_t = A + cap_λ(c)_t``, as `JudgeCreditTrainer` does.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ...judge.audit import JudgeAuditLog
from ...judge.batch import judge_fix
from ...judge.event_loop import BackgroundEventLoop
from ...judge.judge import SpanJudge
from ...methods import METHODS
from ..async_seam import token_credit_collator
from ..ext_async_grpo import ExtAsyncGRPOTrainer
from .config import AsyncJudgeCreditConfig
from .worker import JudgeRolloutWorker

logger = logging.getLogger(__name__)

__all__ = ["AUDIT_FILE", "AsyncJudgeCreditTrainer"]

AUDIT_FILE = "judge_audit.jsonl"
PROBE_TIMEOUT_S = 10.0  # the longest the start-up check of the judge endpoint may take


class AsyncJudgeCreditTrainer(ExtAsyncGRPOTrainer):
    """GRPO with token-span LLM-judge credit on TRL's asynchronous trainer: ``A_t = A + cap_λ(c)_t``.

    Use like `ExtAsyncGRPOTrainer` with an [`AsyncJudgeCreditConfig`]: ``model`` is a path or Hub id served by
    ``vllm serve`` at ``vllm_server_base_url`` (LoRA sync: start it with ``--enable-lora`` and
    ``--max-loras >= max_staleness + 2``). The dataset needs a ``prompt`` column (text or chat messages); reward
    functions get TRL's keyword lists. The rollout worker runs in a thread of this process, so reward functions need
    not be picklable. Extra keyword arguments: ``judge`` (a ready `trl_ext.judge.SpanJudge` instead of the one built
    from the config), ``generator`` (a `trl_ext.rlm.Generator` to sample with instead of the server; tests use a
    scripted one) and ``rollout_worker`` (to replace the worker).

    Metrics, besides TRL's and the loss's (each over the logging window): ``judge/failure_ratio`` (rollouts with no
    usable verdict), ``judge/refused_ratio`` (among them, judge replies with no readable verdict),
    ``judge/injection_suspected``, ``judge/text_verdicts`` (verdicts read out of free text), ``judge/share`` (Σ|c| / (Σ|A| + Σ|c|) over completion tokens), ``judge/spans_per_rollout``,
    ``judge/invalid_span_ratio`` (dropped / returned spans), ``judge/latency_p50`` (seconds per conversation),
    ``judge/label/<name>`` (valid spans with that label per worker run), ``judge/wait_s`` (the worker's wait for the
    verdicts of a run), ``judge/worker_errors_total`` (failed runs), ``reward``, ``rewards/<function>``. Every verdict
    is appended to ``<output_dir>/judge_audit.jsonl`` (``judge_audit_log``).
    """

    model_card = METHODS["judge-credit"]
    # Worker runs in which every judge call failed before the outage warning becomes an error (as JudgeCreditTrainer).
    judge_outage_loud_batches = 5

    method_worker = True
    config_class = AsyncJudgeCreditConfig
    default_output_suffix = None  # args is required: it holds the judge endpoint
    config_error = (
        "AsyncJudgeCreditTrainer needs its judge settings: pass args=AsyncJudgeCreditConfig(output_dir=..., "
        "judge_base_url=..., judge_model=...), got {got}."
    )
    dataset_error = "AsyncJudgeCreditTrainer needs a train_dataset with a 'prompt' column."

    def __init__(
        self,
        model: str,
        reward_funcs: Any = None,
        args: AsyncJudgeCreditConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        *,
        judge: SpanJudge | None = None,
        generator: Any = None,
        rollout_worker: Any = None,
        **kwargs: Any,
    ) -> None:
        self.judge = judge  # None: built from the config (set_up_method)
        super().__init__(
            model,
            reward_funcs,
            args,
            train_dataset,
            processing_class,
            generator=generator,
            rollout_worker=rollout_worker,
            **kwargs,
        )

    def set_up_method(self, args):
        """The judge (the one passed, or the config's) and the audit log."""
        self.judge, sandbox_info = args.configured_judge(self.judge)
        if sandbox_info is not None:
            self.sandbox_info = sandbox_info  # written to the run info
        self._audit = None
        if args.judge_audit_log and args.output_dir:
            self._audit = JudgeAuditLog(os.path.join(args.output_dir, AUDIT_FILE))

    def build_rollout_worker(self, args, worker_kwargs):
        return JudgeRolloutWorker(
            **worker_kwargs,
            judge=self.judge,
            judge_lambda=args.judge_lambda,
            marker_every=args.marker_every,
            verdict_reward=_verdict_reward_index(args.judge_verdict_reward, worker_kwargs["reward_funcs"]),
            answer_column=args.judge_answer_column,
            solution_column=args.judge_solution_column,
            audit=self._audit,
            step=lambda: self.state.global_step,
            outage_loud_batches=self.judge_outage_loud_batches,
        )

    def finish_set_up(self):
        """The judge endpoint probed (advice only, `_probe_judge`)."""
        if self.accelerator.is_main_process:
            self._probe_judge()

    @property
    def judge_audit_path(self) -> str | None:
        """Where the verdicts are appended (None when the audit log is off)."""
        return None if self._audit is None else self._audit.path

    def train_collation(self):
        """TRL's collator adds the samples' token credit to the advantages (and their loss weights, if any)
        (`trl_ext.trainers.async_seam.credit`)."""
        return token_credit_collator()

    def _probe_judge(self) -> None:
        """Warn now when the judge endpoint does not answer or does not serve ``judge_model`` (advice only: a judge
        that is down gives zero credit, counted, and training goes on)."""
        client = self.judge.client
        if not hasattr(client, "probe"):
            return
        loop = BackgroundEventLoop(name="trl-ext-judge-probe")
        try:
            probe = loop.run(client.probe(timeout=min(self.args.judge_timeout, PROBE_TIMEOUT_S)))
        except Exception as error:  # the probe is advice: it must never stop the trainer
            logger.debug("Judge endpoint probe of %s failed: %r", client.base_url, error)
            return
        finally:
            loop.close()
        if not probe.ok:
            logger.warning(
                "AsyncJudgeCreditTrainer: the judge endpoint %s does not answer (%s). Training will run, but until "
                "it answers every rollout gets zero judge credit (counted in judge/failure_ratio). Fix: %s",
                client.base_url,
                probe.error.detail,
                judge_fix(probe.error.kind, probe.error.status, client),
            )
        elif probe.models and client.model not in probe.models:
            logger.warning(
                "AsyncJudgeCreditTrainer: the judge endpoint %s serves %s, not judge_model=%r: every judge call may "
                "fail and its rollouts get zero credit. Set judge_model to the name the endpoint serves.",
                client.base_url,
                probe.models,
                client.model,
            )


def _verdict_reward_index(setting: str, funcs: list[Any]) -> int | None:
    """The reward function whose value the judge is shown (``judge_verdict_reward``), or None for the total."""
    if setting == "total":
        return None
    if setting == "auto":
        return 0 if len(funcs) == 1 else None
    names = [getattr(func, "__name__", type(func).__name__) for func in funcs]
    if setting not in names:
        raise ValueError(
            f"judge_verdict_reward={setting!r} is not a reward function of this trainer ({names}); use one of those "
            "names, 'auto' or 'total'."
        )
    return names.index(setting)
