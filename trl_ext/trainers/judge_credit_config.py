"""`JudgeCreditConfig`: the span judge's settings (endpoint, λ, labels, tools), on top of `ExtGRPOConfig` and the
REPL sandbox fields (docs/judge_credit.md)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..judge.client import STRUCTURED_OUTPUT_MODES
from ..judge.credit import DEFAULT_LABEL_SCORES
from ..judge.tools import TOOL_NAMES
from ..rlm.sandbox import SandboxArguments
from .ext_grpo_config import ExtGRPOConfig

logger = logging.getLogger(__name__)


@dataclass
class JudgeCreditConfig(SandboxArguments, ExtGRPOConfig):
    r"""
    Configuration for [`JudgeCreditTrainer`]: every field of [`ExtGRPOConfig`], plus the span judge.

    Defaults follow the reference run of docs/judge_credit.md: `loss_type="ipo"` and `scale_rewards="none"` (Dr. GRPO, `A = r −
    mean(group)`).

    Parameters:
        > Credit

        judge_lambda (`float`, *optional*, defaults to `0.25`):
            λ: per rollout, the judge's credit is scaled down when its mean |c_t| over completion tokens exceeds λ.
            0.25 nudges (judge ≈ 6 % of the advantage mass), 1.0 ≈ 20 %. 0 turns the credit off while the judge
            still runs and is audited (shadow mode).
        label_scores (`dict[str, float]` or `str`, *optional*):
            Label -> score (a dict or its JSON). Defaults (docs/judge_credit.md): `verified_correction` +1.0, `key_progress`
            +0.5, `original_error` −1.0, `dependent_error` −0.5, `wasteful_loop` −0.25.
        marker_every (`int`, *optional*, defaults to `64`):
            Token markers `⟦i⟧` go at every line start and every `marker_every` tokens inside long lines.

        > Judge endpoint (any OpenAI-compatible chat-completions server)

        judge_base_url (`str`): e.g. `"http://127.0.0.1:8000/v1"` (vLLM) or `"https://api.openai.com/v1"`.
        judge_model (`str`): the judge model's name at that endpoint.
        judge_api_key_env (`str`, *optional*, defaults to `"OPENAI_API_KEY"`):
            Environment variable holding the API key (never logged). Unset: a placeholder key is sent.
        judge_max_concurrency (`int`, *optional*, defaults to `32`): judge requests in flight at once.
        judge_timeout (`float`, *optional*, defaults to `120.0`): seconds one request may take.
        judge_max_retries (`int`, *optional*, defaults to `3`): retries on 408/409/429/5xx/timeouts/connection
            errors, with the openai SDK's exponential backoff (honouring Retry-After).
        judge_structured_output (`str`, *optional*, defaults to `"auto"`):
            `"auto"` sends a JSON schema `response_format` and drops it if the endpoint rejects it, `"on"` always
            sends it, `"off"` never does (replies are parsed tolerantly either way).
        judge_temperature (`float`, *optional*, defaults to `0.0`) / judge_max_tokens (`int` or `None`): sampling.

        > Judge behaviour

        judge_tools (`list[str]`, *optional*): tools offered, from `view_tokens`, `search_trace`, `run_python`,
            `check_equivalent` (all by default; `[]` for none).
        judge_max_tool_rounds (`int`, *optional*, defaults to `4`): tool-call rounds before the judge must answer.
        repl_timeout_s, repl_isolation, repl_memory_mb, ... (every `trl_ext.rlm.SandboxLimits` field as
            ``repl_<name>``): the sandboxes of the judge's ``run_python`` and ``check_equivalent``;
            ``repl_timeout_s`` is the wall-clock limit of each call (docs/security.md).
        judge_verdict_reward (`str`, *optional*, defaults to `"auto"`):
            Where the verifier's verdict shown to the judge comes from: the name of a reward function (it runs
            first and the judge starts right after generation, overlapping log-prob passes and the other rewards),
            `"total"` (the weighted total reward; the judge starts after all rewards), or `"auto"` (the single
            reward function when there is exactly one callable, else `"total"`).
        judge_answer_column (`str`, *optional*, defaults to `"answer"`) / judge_solution_column (`str`, defaults
            to `"solution"`): dataset columns with the reference answer / worked solution, shown when present.
        judge_on_eval (`bool`, *optional*, defaults to `False`): also judge evaluation rollouts.
        judge_audit_log (`bool`, *optional*, defaults to `True`): append every verdict to
            `<output_dir>/judge_audit.jsonl` (other ranks: `judge_audit.rank<k>.jsonl`).
    """

    loss_type: str = field(
        default="ipo",
        metadata={
            "help": "Policy loss; the judge blog's reference run uses 'ipo' (docs/ipo_loss.md). Any registered loss works."
        },
    )
    scale_rewards: str = field(
        default="none",
        metadata={
            "help": "Reward scaling of the group advantage. 'none' is Dr. GRPO (A = r − mean(group)), the outcome "
            "advantage the judge's credit is added to (docs/judge_credit.md); 'group' and 'batch' divide by a std."
        },
    )
    judge_lambda: float = field(
        default=0.25,
        metadata={
            "help": "λ cap: per rollout, if mean |c_t| over the completion tokens the judge read (EOS excluded) exceeds λ the credit is scaled by "
            "λ / mean|c|. 0.25 nudges (≈ 6 % of advantage mass), 1.0 ≈ 20 %. 0 gives zero credit while the judge "
            "still runs and is audited (a shadow mode to inspect a judge before trusting it)."
        },
    )
    label_scores: dict | str | None = field(
        default=None,
        metadata={
            "help": "Label -> score, as a dict or a JSON string. Default (docs/judge_credit.md): verified_correction 1.0, "
            "key_progress 0.5, original_error -1.0, dependent_error -0.5, wasteful_loop -0.25."
        },
    )
    marker_every: int = field(
        default=64,
        metadata={"help": "Markers ⟦i⟧ go at every line start and every `marker_every` tokens inside long lines."},
    )
    judge_base_url: str | None = field(
        default=None,
        metadata={"help": "OpenAI-compatible endpoint of the judge, e.g. 'http://127.0.0.1:8000/v1'. Required."},
    )
    judge_model: str | None = field(
        default=None, metadata={"help": "Model name of the judge at judge_base_url. Required."}
    )
    judge_api_key_env: str = field(
        default="OPENAI_API_KEY",
        metadata={"help": "Name of the environment variable with the judge's API key (the key is never logged)."},
    )
    judge_max_concurrency: int = field(
        default=32, metadata={"help": "Judge requests in flight at once (per process)."}
    )
    judge_timeout: float = field(
        default=120.0, metadata={"help": "Seconds a single judge request may take (wall clock) before a retry."}
    )
    judge_max_retries: int = field(
        default=3,
        metadata={
            "help": "Retries of a judge request on 429, 5xx, timeouts and connection errors; then the "
            "rollout gets zero credit and is counted in judge/failure_ratio."
        },
    )
    judge_structured_output: str = field(
        default="auto",
        metadata={
            "help": "'auto': send a JSON-schema response_format and drop it if the endpoint rejects it; 'on': always; "
            "'off': never. Replies are parsed tolerantly in every mode."
        },
    )
    judge_temperature: float = field(default=0.0, metadata={"help": "Sampling temperature of the judge."})
    judge_max_tokens: int | None = field(
        default=None, metadata={"help": "Max tokens per judge reply (None: the endpoint's default)."}
    )
    judge_tools: list[str] = field(
        default_factory=lambda: list(TOOL_NAMES),
        metadata={
            "help": "Tools offered to the judge: view_tokens, search_trace, run_python, check_equivalent. "
            "Pass an empty list for none."
        },
    )
    judge_max_tool_rounds: int = field(
        default=4, metadata={"help": "Rounds of tool calls before the judge must answer with spans (0 = no tools)."}
    )
    judge_verdict_reward: str = field(
        default="auto",
        metadata={
            "help": "Source of the verifier verdict shown to the judge: a reward function's name (run first, so the "
            "judge overlaps the rest of scoring), 'total' (weighted total reward; the judge starts after all "
            "rewards) or 'auto' (the only reward function if there is exactly one callable, else 'total')."
        },
    )
    judge_answer_column: str = field(
        default="answer",
        metadata={"help": "Dataset column with the reference answer (shown to the judge if present)."},
    )
    judge_solution_column: str = field(
        default="solution",
        metadata={"help": "Dataset column with the worked reference solution (shown to the judge if present)."},
    )
    judge_on_eval: bool = field(
        default=False, metadata={"help": "Also judge evaluation rollouts (costs judge calls; off by default)."}
    )
    judge_audit_log: bool = field(
        default=True,
        metadata={
            "help": "Append every verdict (spans, dropped spans with reasons, latency) to "
            "<output_dir>/judge_audit.jsonl."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        self.label_scores = _normalise_label_scores(self.label_scores)
        if not self.judge_base_url or not str(self.judge_base_url).startswith(("http://", "https://")):
            raise ValueError(
                f"judge_base_url={self.judge_base_url!r}: set it to the judge's OpenAI-compatible endpoint, e.g. "
                "'http://127.0.0.1:8000/v1' for a local vLLM server or 'https://api.openai.com/v1'."
            )
        if not self.judge_model:
            raise ValueError("judge_model is not set: give the judge model's name at judge_base_url, e.g. 'gpt-4.1'.")
        if not (self.judge_lambda >= 0) or math.isnan(self.judge_lambda):
            raise ValueError(
                f"judge_lambda={self.judge_lambda} must be >= 0: 0.25 nudges, 1.0 is strong, 0 disables the credit."
            )
        if isinstance(self.marker_every, bool) or not isinstance(self.marker_every, int) or self.marker_every < 1:
            raise ValueError(
                f"marker_every={self.marker_every!r} must be an integer >= 1 (the method uses ~64, docs/judge_credit.md)."
            )
        for name in ("judge_max_concurrency",):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        for name in ("judge_max_retries", "judge_max_tool_rounds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0.")
        if not self.judge_timeout > 0:
            raise ValueError(f"judge_timeout={self.judge_timeout} must be > 0 seconds.")
        self.sandbox_limits()  # validates the repl_* fields with the sandbox's own messages
        if self.judge_structured_output not in STRUCTURED_OUTPUT_MODES:
            raise ValueError(
                f"judge_structured_output={self.judge_structured_output!r}: use one of {list(STRUCTURED_OUTPUT_MODES)}."
            )
        unknown = [name for name in self.judge_tools if name not in TOOL_NAMES]
        if unknown:
            raise ValueError(f"judge_tools has unknown tool(s) {unknown}; choose from {list(TOOL_NAMES)} (or []).")
        if self.judge_max_tokens is not None and self.judge_max_tokens < 1:
            raise ValueError(f"judge_max_tokens={self.judge_max_tokens} must be >= 1 or None.")
        if not self.judge_verdict_reward:
            raise ValueError("judge_verdict_reward is empty: use 'auto', 'total' or a reward function's name.")
        if self.scale_rewards != "none":
            logger.warning(
                "JudgeCreditConfig: scale_rewards=%r divides the outcome advantage by a std, so λ is no longer "
                "relative to Dr. GRPO's A = r − mean(group) as in docs/judge_credit.md. Set scale_rewards='none' to match it.",
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
