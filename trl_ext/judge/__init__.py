"""Token-span LLM-judge credit: markers, span validation, credit and λ cap, the judge and its client.

The folder reads in pipeline order: `markers` (what the judge sees) → `judge` with `prompts` and `tools` (the
conversation, over `client`, whose endpoint settings are `endpoint`; `tools` reads math with `math_expr`'s grammar:
`math_tokens`, `math_grammar`, `math_limits`) → `spans` (what it said, its own verdict only: `verdicts`, validated) →
`credit` (what it is worth) → `audit` (what was recorded). `event_loop` runs the judge's coroutines for a trainer.
The trainer that wires it into GRPO is `trl_ext.trainers.judge_credit.JudgeCreditTrainer`; the method and its
settings are described in docs/judge_credit.md.
"""

from .audit import JudgeAuditLog, text_hash
from .client import AsyncChatClient, ChatCallError, ChatClientStats, ChatResult, EndpointProbe, ParsedReply
from .credit import DEFAULT_LABEL_SCORES, cap_credit, judge_share, per_token_advantages, span_credit
from .endpoint import EndpointSettings
from .event_loop import BackgroundEventLoop
from .judge import JudgeRequest, JudgeVerdict, SpanJudge, extract_final_answer
from .markers import MarkedTrace, build_marked_trace, format_marker, insert_markers, strip_markers
from .spans import (
    DROP_REASONS,
    DroppedSpan,
    Span,
    SpanParseError,
    SpanValidation,
    extract_span_list,
    forged_span_lists,
    normalize_whitespace,
    span_list_of,
    spans_from_tool_arguments,
    validate_spans,
)
from .tools import TOOL_NAMES, JudgeTools, PythonSandbox, ReplSandbox, tool_schemas
from .verdicts import InjectionSuspected, read_verdict, verdicts_in

__all__ = [
    "DEFAULT_LABEL_SCORES",
    "DROP_REASONS",
    "TOOL_NAMES",
    "AsyncChatClient",
    "BackgroundEventLoop",
    "ChatCallError",
    "EndpointSettings",
    "ChatClientStats",
    "ChatResult",
    "DroppedSpan",
    "EndpointProbe",
    "InjectionSuspected",
    "JudgeAuditLog",
    "JudgeRequest",
    "JudgeTools",
    "JudgeVerdict",
    "MarkedTrace",
    "ParsedReply",
    "PythonSandbox",
    "ReplSandbox",
    "Span",
    "SpanJudge",
    "SpanParseError",
    "SpanValidation",
    "build_marked_trace",
    "cap_credit",
    "extract_final_answer",
    "extract_span_list",
    "forged_span_lists",
    "format_marker",
    "insert_markers",
    "judge_share",
    "normalize_whitespace",
    "per_token_advantages",
    "read_verdict",
    "span_list_of",
    "spans_from_tool_arguments",
    "span_credit",
    "strip_markers",
    "text_hash",
    "tool_schemas",
    "validate_spans",
    "verdicts_in",
]
