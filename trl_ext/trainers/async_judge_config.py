"""`AsyncJudgeCreditConfig`: `AsyncMethodConfig` plus the span judge's settings of `JudgeCreditConfig`
(`trl_ext.judge.arguments.JudgeCreditArguments`, declared once for both; docs/judge_credit.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ..fields import document_fields
from ..judge.arguments import JudgeCreditArguments
from .ext_async_grpo_config import AsyncMethodConfig

__all__ = ["AsyncJudgeCreditConfig"]


@document_fields
@dataclass
class AsyncJudgeCreditConfig(JudgeCreditArguments, AsyncMethodConfig):
    r"""
    Configuration for [`AsyncJudgeCreditTrainer`]: every field of [`ExtAsyncGRPOConfig`] (TRL's asynchronous
    trainer, ``loss_type``/``ipo_*``), ``reward_weights`` (`AsyncMethodConfig`) and the span judge's settings of
    `JudgeCreditConfig` (`trl_ext.judge.arguments.JudgeCreditArguments`: ``judge_lambda``, ``label_scores``,
    ``marker_every``, the ``judge_<name>`` endpoint fields, ``judge_tools``, the ``repl_<name>`` sandbox fields of
    the judge's Python tools, ...), the same fields.

    As in `JudgeCreditConfig`: ``loss_type="ipo"`` and ``scale_rewards="none"`` (Dr. GRPO, ``A = r − mean(group)``).
    The rollout worker scores one group at a time, so ``scale_rewards`` is ``"none"`` or ``"group"``. The worker
    computes every reward before it asks the judge, so ``judge_verdict_reward`` only chooses which score the judge is
    shown. Sampling follows TRL's async settings (``max_completion_length``, ``temperature``, ``top_p``, ...) against
    ``vllm_server_base_url``.
    """

    def __post_init__(self):
        super().__post_init__()
        self.check_judge_arguments()
