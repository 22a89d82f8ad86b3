"""`AsyncJudgeCreditConfig`: `ExtAsyncGRPOConfig` plus the span judge's settings, under the names (and meaning) of
`JudgeCreditConfig` (docs/judge_credit.md), and the REPL sandbox fields of its ``run_python`` / ``check_equivalent``
tools."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ...fields import document_fields, mirror_field
from ...judge.endpoint import EndpointSettings
from ...judge.tools import TOOL_NAMES
from ...rlm.sandbox import SandboxArguments
from ..ext_async_grpo_config import ExtAsyncGRPOConfig
from ..judge_credit_config import JudgeCreditConfig, check_judge_fields, warn_scaled_outcome

logger = logging.getLogger(__name__)

__all__ = ["AsyncJudgeCreditConfig"]

_CREDIT = "Credit (docs/judge_credit.md)"
_ENDPOINT = "Judge endpoint (any OpenAI-compatible chat-completions server)"
_BEHAVIOUR = "Judge behaviour"


def _judge(name: str, section: str = _BEHAVIOUR, **options: Any) -> Any:
    """`JudgeCreditConfig`'s field ``name``: its default and help text."""
    return mirror_field(JudgeCreditConfig, name, "Judge credit", section=section, **options)


def _endpoint(name: str, **options: Any) -> Any:
    """The `EndpointSettings` field ``name`` as ``judge_<name>``, as `JudgeCreditConfig` declares it."""
    return mirror_field(EndpointSettings, name, "Judge endpoint", section=_ENDPOINT, **options)


@document_fields
@dataclass
class AsyncJudgeCreditConfig(SandboxArguments, ExtAsyncGRPOConfig):
    r"""
    Configuration for [`AsyncJudgeCreditTrainer`]: every field of [`ExtAsyncGRPOConfig`] (TRL's asynchronous
    trainer, ``loss_type``/``ipo_*``), the span judge's fields of `JudgeCreditConfig` (same names, same meaning:
    ``judge_lambda``, ``label_scores``, ``marker_every``, the ``judge_<name>`` endpoint fields, ``judge_tools``, ...)
    and the ``repl_<name>`` sandbox fields of the judge's Python tools.

    As in `JudgeCreditConfig`: ``loss_type="ipo"`` and ``scale_rewards="none"`` (Dr. GRPO, ``A = r − mean(group)``).
    The rollout worker scores one group at a time, so ``scale_rewards`` is ``"none"`` or ``"group"``. The worker
    computes every reward before it asks the judge, so ``judge_verdict_reward`` only chooses which score the judge is
    shown. Sampling follows TRL's async settings (``max_completion_length``, ``temperature``, ``top_p``, ...) against
    ``vllm_server_base_url``.
    """

    loss_type: str = _judge("loss_type", section=_CREDIT)
    scale_rewards: str = _judge(
        "scale_rewards",
        section=_CREDIT,
        note="The rollout worker scores one group at a time, so 'batch' is not available here.",
    )
    judge_lambda: float = _judge("judge_lambda", section=_CREDIT)
    label_scores: dict | str | None = _judge("label_scores", section=_CREDIT)
    marker_every: int = _judge("marker_every", section=_CREDIT)
    judge_base_url: str | None = _endpoint("base_url", default=None, note="Required.")
    judge_model: str | None = _endpoint("model", default=None, note="Required.")
    judge_api_key_env: str = _endpoint("api_key_env")
    judge_max_concurrency: int = _endpoint("max_concurrency")
    judge_timeout: float = _endpoint("timeout")
    judge_max_retries: int = _endpoint(
        "max_retries", note="After the retries the rollout gets zero credit and is counted in judge/failure_ratio."
    )
    judge_structured_output: str = _endpoint("structured_output")
    judge_temperature: float = _judge("judge_temperature", section=_ENDPOINT)
    judge_max_tokens: int | None = _judge("judge_max_tokens", section=_ENDPOINT)
    judge_tools: list[str] = _judge("judge_tools", default_factory=lambda: list(TOOL_NAMES))
    judge_max_tool_rounds: int = _judge("judge_max_tool_rounds")
    judge_verdict_reward: str = _judge(
        "judge_verdict_reward",
        note="Here every reward runs before the judge (in the rollout worker): the setting only picks the score shown.",
    )
    judge_answer_column: str = _judge("judge_answer_column")
    judge_solution_column: str = _judge("judge_solution_column")
    judge_audit_log: bool = _judge("judge_audit_log")

    def __post_init__(self):
        super().__post_init__()
        check_judge_fields(self)
        if self.scale_rewards not in ("group", "none"):
            raise ValueError(
                f"scale_rewards={self.scale_rewards!r}: the asynchronous rollout worker scores one group at a time; "
                "set 'none' (Dr. GRPO, the outcome advantage of docs/judge_credit.md) or 'group'."
            )
        warn_scaled_outcome(self, "AsyncJudgeCreditConfig")

    def judge_endpoint(self) -> EndpointSettings:
        """The judge's `EndpointSettings`, as `JudgeCreditConfig.judge_endpoint` builds it."""
        return JudgeCreditConfig.judge_endpoint(self)
