"""`JudgeCreditArguments`: the span judge's settings as trainer-config fields (endpoint, λ, labels, tools), declared
and documented once for the synchronous (`JudgeCreditConfig`) and the asynchronous (`AsyncJudgeCreditConfig`) trainer
(docs/judge_credit.md), with the ``repl_<name>`` sandbox fields of the judge's ``run_python`` and
``check_equivalent`` tools.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..fields import document_fields, documented, mirror_field
from ..rlm.sandbox import SandboxArguments, isolation_report, resolve_isolation
from .client import AsyncChatClient
from .credit import DEFAULT_LABEL_SCORES
from .endpoint import EndpointSettings
from .judge import SpanJudge
from .tools import TOOL_NAMES, ReplSandbox

logger = logging.getLogger(__name__)

__all__ = ["JudgeCreditArguments"]

_CREDIT = "Credit"
_ENDPOINT = "Judge endpoint (any OpenAI-compatible chat-completions server)"
_BEHAVIOUR = "Judge behaviour"


def _endpoint_field(name: str, **options: Any) -> Any:
    """The `EndpointSettings` field ``name`` as the config field ``judge_<name>``."""
    return mirror_field(EndpointSettings, name, "Judge endpoint", section=_ENDPOINT, **options)


@document_fields
@dataclass
class JudgeCreditArguments(SandboxArguments):
    """The span judge's settings. Defaults follow the reference run of docs/judge_credit.md: ``loss_type="ipo"`` and
    ``scale_rewards="none"`` (Dr. GRPO, ``A = r − mean(group)``); `judge_endpoint` gives the endpoint fields as one
    `EndpointSettings`."""

    loss_type: str = documented(
        "ipo",
        "Policy loss; the judge blog's reference run uses 'ipo' (docs/ipo_loss.md). Any registered loss works.",
        section=_CREDIT,
    )
    scale_rewards: str = documented(
        "none",
        "Reward scaling of the group advantage. 'none' is Dr. GRPO (A = r − mean(group)), the outcome advantage the "
        "judge's credit is added to (docs/judge_credit.md); 'group' divides by the group's std, and in the "
        "synchronous trainer 'batch' by the batch's.",
        section=_CREDIT,
    )
    judge_lambda: float = documented(
        0.25,
        "λ cap: per rollout, if mean |c_t| over the completion tokens the judge read (EOS excluded) exceeds λ the "
        "credit is scaled by λ / mean|c|. 0.25 nudges (≈ 6 % of advantage mass), 1.0 ≈ 20 %. 0 gives zero credit "
        "while the judge still runs and is audited (a shadow mode to inspect a judge before trusting it).",
        section=_CREDIT,
    )
    label_scores: dict | str | None = documented(
        None,
        "Label -> score, as a dict or a JSON string. Default (docs/judge_credit.md): verified_correction 1.0, "
        "key_progress 0.5, original_error -1.0, dependent_error -0.5, wasteful_loop -0.25.",
        section=_CREDIT,
    )
    marker_every: int = documented(
        64, "Markers ⟦i⟧ go at every line start and every `marker_every` tokens inside long lines.", section=_CREDIT
    )
    judge_base_url: str | None = _endpoint_field("base_url", default=None, note="Required.")
    judge_model: str | None = _endpoint_field("model", default=None, note="Required.")
    judge_api_key_env: str = _endpoint_field("api_key_env")
    judge_max_concurrency: int = _endpoint_field("max_concurrency")
    judge_timeout: float = _endpoint_field("timeout")
    judge_max_retries: int = _endpoint_field(
        "max_retries", note="After the retries the rollout gets zero credit and is counted in judge/failure_ratio."
    )
    judge_structured_output: str = _endpoint_field("structured_output")
    judge_temperature: float = documented(0.0, "Sampling temperature of the judge.", section=_ENDPOINT)
    judge_max_tokens: int | None = documented(
        None, "Max tokens per judge reply (None: the endpoint's default).", section=_ENDPOINT
    )
    judge_tools: list[str] = documented(
        help="Tools offered to the judge: view_tokens, search_trace, run_python, check_equivalent (all by default). "
        "Pass an empty list for none.",
        section=_BEHAVIOUR,
        default_factory=lambda: list(TOOL_NAMES),
    )
    judge_max_tool_rounds: int = documented(
        4, "Rounds of tool calls before the judge must answer with spans (0 = no tools).", section=_BEHAVIOUR
    )
    judge_verdict_reward: str = documented(
        "auto",
        "Source of the verifier verdict shown to the judge: a reward function's name (run first, so the judge "
        "overlaps the rest of scoring), 'total' (weighted total reward; the judge starts after all rewards) or "
        "'auto' (the only reward function if there is exactly one callable, else 'total'). The asynchronous "
        "trainer's rollout worker runs every reward before the judge: there the setting only picks the score shown.",
        section=_BEHAVIOUR,
    )
    judge_answer_column: str = documented(
        "answer", "Dataset column with the reference answer (shown to the judge if present).", section=_BEHAVIOUR
    )
    judge_solution_column: str = documented(
        "solution",
        "Dataset column with the worked reference solution (shown to the judge if present).",
        section=_BEHAVIOUR,
    )
    judge_audit_log: bool = documented(
        True,
        "Append every verdict (spans, dropped spans with reasons, latency) to <output_dir>/judge_audit.jsonl "
        "(other ranks: judge_audit.rank<k>.jsonl).",
        section=_BEHAVIOUR,
    )

    def judge_endpoint(self) -> EndpointSettings:
        """The judge's `EndpointSettings`: the ``judge_<name>`` fields, with ``judge_temperature`` and
        ``judge_max_tokens`` as its request parameters."""
        request_params: dict[str, Any] = {"temperature": self.judge_temperature}
        if self.judge_max_tokens is not None:
            request_params["max_tokens"] = self.judge_max_tokens
        return EndpointSettings.from_fields(self, "judge_", request_params=request_params)

    def configured_judge(self, judge: SpanJudge | None = None) -> tuple[SpanJudge, Any]:
        """The trainer's `SpanJudge` (``judge`` when given, else built from these fields) and its sandbox report:
        the isolation report of the judge's Python tools' sandbox (None when neither ``run_python`` nor
        ``check_equivalent`` is offered); ``isolation="strict"`` fails here."""
        if judge is None:
            judge = SpanJudge(
                AsyncChatClient.from_settings(self.judge_endpoint()),
                label_scores=self.label_scores,
                tools=self.judge_tools,
                max_tool_rounds=self.judge_max_tool_rounds,
                python_factory=functools.partial(ReplSandbox, self.sandbox_limits()),
                python_timeout=self.repl_timeout_s,
            )
        elif not isinstance(judge, SpanJudge):
            raise TypeError(f"judge must be a trl_ext.judge.SpanJudge, got {type(judge).__name__}.")
        if "run_python" not in self.judge_tools and "check_equivalent" not in self.judge_tools:
            return judge, None
        resolve_isolation(self.sandbox_limits())  # isolation="strict" fails now; "auto" warns once if weaker
        return judge, isolation_report(self.sandbox_limits())

    def check_judge_arguments(self) -> None:
        """Validate (and normalise ``label_scores`` of) these fields, the ``repl_<name>`` sandbox fields included;
        every error names the field. Warns when ``scale_rewards`` is not ``"none"`` (λ is then no longer relative to
        Dr. GRPO's advantage)."""
        self.label_scores = _normalise_label_scores(self.label_scores)
        self.judge_endpoint()  # validates the judge_<endpoint> fields, naming them
        if not (self.judge_lambda >= 0) or math.isnan(self.judge_lambda):
            raise ValueError(
                f"judge_lambda={self.judge_lambda} must be >= 0: 0.25 nudges, 1.0 is strong, 0 disables the credit."
            )
        if isinstance(self.marker_every, bool) or not isinstance(self.marker_every, int) or self.marker_every < 1:
            raise ValueError(
                f"marker_every={self.marker_every!r} must be an integer >= 1 (the method uses ~64, "
                "docs/judge_credit.md)."
            )
        if self.judge_max_tool_rounds < 0:
            raise ValueError(f"judge_max_tool_rounds={self.judge_max_tool_rounds} must be >= 0.")
        self.sandbox_limits()  # validates the repl_* fields with the sandbox's own messages
        unknown = [name for name in self.judge_tools if name not in TOOL_NAMES]
        if unknown:
            raise ValueError(f"judge_tools has unknown tool(s) {unknown}; choose from {list(TOOL_NAMES)} (or []).")
        if self.judge_max_tokens is not None and self.judge_max_tokens < 1:
            raise ValueError(f"judge_max_tokens={self.judge_max_tokens} must be >= 1 or None.")
        if not self.judge_verdict_reward:
            raise ValueError("judge_verdict_reward is empty: use 'auto', 'total' or a reward function's name.")
        if self.scale_rewards != "none":
            logger.warning(
                "%s: scale_rewards=%r divides the outcome advantage by a std, so λ is no longer relative to Dr. GRPO's "
                "A = r − mean(group) as in docs/judge_credit.md. Set scale_rewards='none' to match it.",
                type(self).__name__,
                self.scale_rewards,
            )


def _normalise_label_scores(value: Any) -> dict[str, float]:
    if value is None:
        return dict(DEFAULT_LABEL_SCORES)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ValueError(
                f"label_scores={value!r} is not JSON: pass a dict or e.g. '{{\"original_error\": -1.0}}' ({error})."
            ) from None
    if not isinstance(value, Mapping) or not value:
        raise ValueError(f"label_scores={value!r} must be a non-empty mapping label -> score.")
    scores: dict[str, float] = {}
    for label, score in value.items():
        if not isinstance(label, str) or not label:
            raise ValueError(f"label_scores has a bad label {label!r}: labels are non-empty strings.")
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise ValueError(f"label_scores[{label!r}]={score!r} must be a finite number (e.g. -0.5).")
        scores[label] = float(score)
    return scores
