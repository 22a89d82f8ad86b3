"""`AsyncJudgeCreditTrainer`: token-span judge credit (docs/judge_credit.md) on TRL's asynchronous trainer, an adapter:
its rollout worker runs `trl_ext.judge.method.JudgeCredit.rollout` (the method the synchronous trainer drives), and
TRL's collator adds each sample's credit to its per-token advantages (`trl_ext.trainers.async_seam.credit`), so every
loss trains on ``A_t = A + cap_λ(c)_t``, as `JudgeCreditTrainer` does."""

from __future__ import annotations

from typing import Any

from ..judge.judge import SpanJudge
from ..judge.method import JudgeCredit, verdict_reward_index
from ..methods import METHODS
from ..rollouts import reward_func_names
from .async_judge_config import AsyncJudgeCreditConfig
from .async_seam import token_credit_collator
from .async_worker import RolloutWorker
from .ext_async_grpo import ExtAsyncGRPOTrainer

__all__ = ["AsyncJudgeCreditConfig", "AsyncJudgeCreditTrainer"]


class AsyncJudgeCreditTrainer(ExtAsyncGRPOTrainer):
    """GRPO with token-span LLM-judge credit on TRL's asynchronous trainer: ``A_t = A + cap_λ(c)_t``.

    Use like `ExtAsyncGRPOTrainer` with an [`AsyncJudgeCreditConfig`]: ``model`` is a path or Hub id served by
    ``vllm serve`` at ``vllm_server_base_url`` (LoRA sync: start it with ``--enable-lora`` and
    ``--max-loras >= max_staleness + 2``). The dataset needs a ``prompt`` column (text or chat messages); reward
    functions get TRL's keyword lists. The rollout worker runs in a thread of this process, so reward functions need
    not be picklable. Extra keyword arguments: ``judge`` (a ready `trl_ext.judge.SpanJudge` instead of the one built
    from the config), ``generator`` (a `trl_ext.rlm.Generator` to sample with instead of the server; tests use a
    scripted one) and ``rollout_worker`` (to replace the worker).

    Metrics: those of `JudgeCreditTrainer` (docs/judge_credit.md, "Metrics"), the same names and values, over the
    logging window; ``judge/worker_errors_total`` counts failed rollout runs. Every verdict is appended to
    ``<output_dir>/judge_audit.jsonl`` (``judge_audit_log``).
    """

    model_card = METHODS["judge-credit"]

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

    def set_up_method(self, args, processing_class):
        """The judge-credit method: the judge (the one passed, or the config's) and the audit log."""
        self.method, sandbox_info = JudgeCredit.from_arguments(
            args,
            processing_class,
            judge=self.judge,
            loop_name="trl-ext-async-judge-loop",
        )
        self.judge = self.method.judge
        if sandbox_info is not None:
            self.sandbox_info = sandbox_info  # written to the run info

    def build_rollout_worker(self, args, worker_kwargs):
        funcs = worker_kwargs["reward_funcs"]
        # every reward of the worker is a callable: it runs them all before the judge
        names = reward_func_names(funcs)
        self.method.verdict_reward = verdict_reward_index(args.judge_verdict_reward, names, [True] * len(funcs))
        return RolloutWorker(method=self.method, **worker_kwargs)

    def finish_set_up(self):
        """The judge endpoint probed (advice only, `JudgeCredit.probe`)."""
        if self.accelerator.is_main_process:
            self.method.probe(type(self).__name__, self.args.judge_timeout)

    @property
    def judge_audit_path(self) -> str | None:
        """Where the verdicts are appended (None when the audit log is off)."""
        return None if self.method.audit is None else self.method.audit.path

    def train_collation(self):
        """TRL's collator adds the samples' token credit to the advantages (and their loss weights, if any)
        (`trl_ext.trainers.async_seam.credit`)."""
        return token_credit_collator()
