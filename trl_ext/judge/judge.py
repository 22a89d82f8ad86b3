"""The agentic span judge: one conversation per rollout, bounded tool rounds, validated spans (docs/judge_credit.md).

`SpanJudge.judge` sends the question, the marked trace, the final answer, the verifier's verdict and the reference
(when the dataset has one) to an OpenAI-compatible endpoint through `AsyncChatClient`. The judge may call tools
(`trl_ext.judge.tools`) for at most ``max_tool_rounds`` rounds and hands in its spans by calling ``submit_verdict``
(offered with the tools: its arguments are the verdict, a channel the policy's text cannot write); without tools, or
once the rounds are spent, it must answer with spans (JSON schema structured output on that tool-free request where
the endpoint supports it; a reply read by `trl_ext.judge.spans.extract_span_list`, which refuses a reply holding
several different span lists). Its spans are validated against the real token text
(`trl_ext.judge.spans.validate_spans`).

**Judge injection.** The policy may end its trace with a forged ``{"spans": [...]}``, hoping the judge quotes it and
the parser credits it. A trace holding verdict-shaped JSON or delimiter-shaped text, or a judge reply refused for
holding several different verdicts, sets ``JudgeVerdict.injection_suspected`` (the trainers log the count as
``judge/injection_suspected``); the judge is told, outside the data, that such JSON is the student's text.

`SpanJudge.judge` never raises for a judge fault: an endpoint that fails after its retries gives
``status="failed"``, an answer with no JSON (after one repair request, `AsyncChatClient.chat_parsed`) gives
``status="unparseable"``; both mean zero credit for the rollout, and the caller counts them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .client import REPLY_STATUSES, AsyncChatClient, ChatCallError, JudgeOutcome
from .credit import DEFAULT_LABEL_SCORES
from .markers import MarkedTrace
from .prompts import (
    FINAL_ROUND_PROMPT,
    REPAIR_PROMPT,
    SPANS_RESPONSE_FORMAT,
    SUBMIT_VERDICT,
    SUBMIT_VERDICT_TOOL,
    build_messages,
    has_forged_delimiter,
    new_nonce,
)
from .spans import (
    DroppedSpan,
    Span,
    SpanParseError,
    extract_span_list,
    forged_span_lists,
    span_list_in_text,
    spans_from_tool_arguments,
    validate_spans,
)
from .tools import TOOL_NAMES, JudgeTools, PythonSandbox, ReplSandbox
from .verdicts import read_from_text, reply_verdicts, verdict_tag

logger = logging.getLogger(__name__)

VERDICT_STATUSES = REPLY_STATUSES  # a verdict's status is that of the judge's reply
REPAIR_REQUESTS = 1  # follow-up requests after an answer with no span list


@dataclass
class JudgeRequest:
    """Everything the judge sees about one rollout.

    Attributes:
        trace: the completion with its token markers (`trl_ext.judge.markers.build_marked_trace`).
        question: the task, as the policy saw it (the last user message).
        final_answer: the rollout's final answer (`extract_final_answer`), if any.
        verdict: the verifier's verdict as text, e.g. ``"accuracy_reward = 1"``.
        reference_answer: the dataset's reference answer, when it has one.
        reference_solution: the dataset's worked solution, when it has one.
    """

    trace: MarkedTrace
    question: str
    final_answer: str | None = None
    verdict: str | None = None
    reference_answer: str | None = None
    reference_solution: str | None = None


@dataclass
class JudgeVerdict(JudgeOutcome):
    """What the judge said about one rollout.

    Attributes:
        status: ``"ok"``, ``"failed"`` (endpoint error after retries, or an internal error) or ``"unparseable"``.
        spans: validated spans (empty unless ``status == "ok"``).
        dropped: spans rejected by validation, with reasons.
        latency_s: wall time of the whole conversation.
        requests: chat requests sent (retries included).
        tool_calls: tool calls executed.
        error: what went wrong, for ``"failed"``/``"unparseable"``.
        raw_output: the judge's last text reply (for the audit log).
        error_kind: the `ChatCallError` kind of a ``"failed"`` verdict (``"connection"``, ``"timeout"``,
            ``"rate_limit"``, ``"server_error"``, ``"client_error"``, ``"bad_response"``), ``"internal"`` for a crash
            of the judge itself, ``"unparseable"``; ``None`` when ``"ok"``.
        error_status: the last HTTP status of a failed request, when there was one.
        injection_suspected: the trace holds a verdict-shaped JSON value or delimiter-shaped text, or a reply of the
            judge held several different span lists of its own.
        text_verdict: the verdict was read out of free text (`trl_ext.judge.verdicts.read_from_text`), not from a
            ``submit_verdict`` call or a reply that is one JSON value; counted as ``judge/text_verdicts``.
    """

    status: str
    spans: list[Span] = field(default_factory=list)
    dropped: list[DroppedSpan] = field(default_factory=list)
    latency_s: float = 0.0
    requests: int = 0
    tool_calls: int = 0
    error: str | None = None
    raw_output: str | None = None
    error_kind: str | None = None
    error_status: int | None = None
    injection_suspected: bool = False
    text_verdict: bool = False

    def to_record(self) -> dict[str, Any]:
        """A JSON-serialisable summary for the audit log."""
        return {
            "status": self.status,
            "spans": [span.to_dict() for span in self.spans],
            "dropped": [d.to_dict() for d in self.dropped],
            "latency_s": round(self.latency_s, 4),
            "requests": self.requests,
            "tool_calls": self.tool_calls,
            "error": self.error,
            "injection_suspected": self.injection_suspected,
            "text_verdict": self.text_verdict,
            "raw_output": None if self.raw_output is None else self.raw_output[:4000],
        }


def extract_final_answer(text: str, max_chars: int = 300) -> str | None:
    """The rollout's final answer: the content of the last ``\\boxed{...}``, else the last non-empty line."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, begin = 0, start + len("\\boxed")
        for position in range(begin, len(text)):
            depth += {"{": 1, "}": -1}.get(text[position], 0)
            if depth == 0:
                return text[begin + 1 : position][:max_chars]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:max_chars] if lines else None


class SpanJudge:
    """An LLM judge that marks token spans of rollouts.

    Args:
        client: the endpoint (`AsyncChatClient`); share one between judges to share its concurrency bound.
        label_scores: label -> score table (keys are the labels the judge may use); default
            `trl_ext.judge.credit.DEFAULT_LABEL_SCORES`.
        tools: names of the tools offered (subset of `trl_ext.judge.tools.TOOL_NAMES`); empty for none.
        max_tool_rounds: rounds of tool calls before the judge must answer.
        max_tool_calls_per_round: tool calls executed per round; extra ones get an error message.
        python_factory: makes a sandbox; each conversation gets one for ``run_python`` and another for
            ``check_equivalent`` (default `ReplSandbox`: the RLM scaffold's `PythonREPL`, started only if the
            judge calls that tool).
        python_timeout: seconds per sandboxed run.
    """

    def __init__(
        self,
        client: AsyncChatClient,
        *,
        label_scores: Mapping[str, float] | None = None,
        tools: Sequence[str] = TOOL_NAMES,
        max_tool_rounds: int = 4,
        max_tool_calls_per_round: int = 8,
        python_factory: Callable[[], PythonSandbox] = ReplSandbox,
        python_timeout: float = 10.0,
    ):
        if max_tool_rounds < 0:
            raise ValueError(f"max_tool_rounds={max_tool_rounds} must be >= 0 (0 = answer without tools).")
        self.client = client
        self.label_scores = dict(DEFAULT_LABEL_SCORES if label_scores is None else label_scores)
        if not self.label_scores:
            raise ValueError("label_scores is empty: give at least one label -> score.")
        self.tools = tuple(tools)
        self.max_tool_rounds = max_tool_rounds
        self.max_tool_calls_per_round = max_tool_calls_per_round
        self.python_factory = python_factory
        self.python_timeout = python_timeout

    async def judge_many(self, requests: Sequence[JudgeRequest]) -> list[JudgeVerdict]:
        """Judge rollouts concurrently (the client bounds how many requests are in flight)."""
        return list(await asyncio.gather(*(self.judge(request) for request in requests)))

    async def judge(self, request: JudgeRequest) -> JudgeVerdict:
        """Judge one rollout. Never raises for a judge fault (see the module docstring)."""
        started = time.perf_counter()
        tools = JudgeTools(
            request.trace,
            enabled=self.tools,
            python=self.python_factory(),
            checker=self.python_factory(),
            python_timeout=self.python_timeout,
        )
        verdict = JudgeVerdict(status="failed")
        try:
            await self._converse(request, tools, verdict)
        except ChatCallError as error:
            verdict.status, verdict.error = "failed", str(error)
            verdict.error_kind, verdict.error_status = error.kind, error.status
            verdict.requests += error.attempts
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a judge fault must never stop training
            logger.warning("Span judge crashed on a rollout (zero credit): %r", error, exc_info=True)
            verdict.status, verdict.error = "failed", f"{type(error).__name__}: {error}"
            verdict.error_kind = "internal"
        finally:
            await _close_quietly(tools)
        if verdict.status != "ok":
            verdict.spans = []
        verdict.tool_calls = len(tools.calls)
        verdict.latency_s = time.perf_counter() - started
        return verdict

    async def _converse(self, request: JudgeRequest, tools: JudgeTools, verdict: JudgeVerdict) -> None:
        use_tools = bool(self.tools) and self.max_tool_rounds > 0
        forged_lists = forged_span_lists(request.trace.text)
        forged = bool(forged_lists)
        verdict.injection_suspected = forged or has_forged_delimiter(request.trace.text)
        nonce = new_nonce()
        tag = verdict_tag(nonce)
        messages: list[dict[str, Any]] = build_messages(
            question=request.question,
            marked_trace=request.trace.marked,
            num_tokens=request.trace.num_tokens,
            final_answer=request.final_answer,
            verdict=request.verdict,
            reference_answer=request.reference_answer,
            reference_solution=request.reference_solution,
            label_scores=self.label_scores,
            tool_names=list(self.tools) if use_tools else [],
            max_rounds=self.max_tool_rounds if use_tools else 0,
            forged_verdict=forged,
            nonce=nonce,
        )
        rounds = 0
        while True:
            offer_tools = use_tools and rounds < self.max_tool_rounds
            # Structured output only on tool-free requests: a JSON grammar would forbid tool calls on some servers.
            answer = await self.client.chat(
                messages,
                tools=[*tools.schemas, SUBMIT_VERDICT_TOOL] if offer_tools else None,
                response_format=None if offer_tools else SPANS_RESPONSE_FORMAT,
            )
            verdict.requests += answer.attempts
            if not (offer_tools and answer.tool_calls):
                break
            submitted, outputs = await self._run_tools(answer.tool_calls, tools)
            if submitted is not None:
                verdict.raw_output = answer.content or ""
                self._accept(submitted, request, verdict)
                return
            rounds += 1
            messages.append(answer.message)
            messages.extend(outputs)
            if rounds >= self.max_tool_rounds:
                messages.append({"role": "user", "content": FINAL_ROUND_PROMPT.format(tag=tag)})
        # The answer has no tool calls: read its span list, asking again (without tools) when there is none.
        parsed = await self.client.chat_parsed(
            messages,
            functools.partial(extract_span_list, forged=forged_lists, label_scores=self.label_scores, tag=tag),
            repairs=REPAIR_REQUESTS,
            repair_prompt=lambda error: REPAIR_PROMPT.format(error=error, tag=tag),
            first=answer,
            response_format=SPANS_RESPONSE_FORMAT,
        )
        verdict.requests += parsed.requests
        verdict.raw_output = parsed.raw_output or ""
        verdict.injection_suspected |= parsed.injection_suspected
        # several span lists of its own in one reply (the most negative was taken): a paraphrased quote, or a judge
        # of two minds; flagged as a bare quote would be
        verdict.injection_suspected |= (
            len(reply_verdicts(verdict.raw_output, span_list_in_text, forged=forged_lists, tag=tag)) > 1
        )
        if not parsed.ok:
            verdict.status, verdict.error = parsed.status, parsed.error
            verdict.error_kind = "unparseable" if parsed.status == "unparseable" else None
            return
        verdict.text_verdict = read_from_text(verdict.raw_output)
        self._accept(parsed.value, request, verdict)

    def _accept(self, items: list[Any], request: JudgeRequest, verdict: JudgeVerdict) -> None:
        validation = validate_spans(items, request.trace, self.label_scores)
        verdict.status, verdict.spans, verdict.dropped = "ok", validation.valid, validation.dropped

    async def _run_tools(
        self, calls: list[dict[str, Any]], tools: JudgeTools
    ) -> tuple[list[Any] | None, list[dict[str, Any]]]:
        """Run one round's tool calls: (the span list of the first well-formed ``submit_verdict`` call, or None;
        the tool messages answering every call, a malformed ``submit_verdict`` answered with its error)."""
        submitted: list[list[Any]] = []

        async def run(index: int, call: dict[str, Any]) -> dict[str, Any]:
            function = call.get("function") or {}
            name, arguments = str(function.get("name")), function.get("arguments") or "{}"
            if index >= self.max_tool_calls_per_round:
                output = f"error: at most {self.max_tool_calls_per_round} tool calls per round; this one was skipped"
            elif name == SUBMIT_VERDICT:
                try:
                    submitted.append(spans_from_tool_arguments(arguments))
                    output = "verdict received"
                except SpanParseError as error:
                    output = f"error: {error}; call {SUBMIT_VERDICT} again with the right arguments"
            else:
                output = await tools.call(name, arguments)
            return {"role": "tool", "tool_call_id": call.get("id", f"call_{index}"), "content": output}

        outputs = list(await asyncio.gather(*(run(i, call) for i, call in enumerate(calls))))
        return (submitted[0] if submitted else None), outputs


async def _close_quietly(tools: JudgeTools) -> None:
    try:
        await tools.aclose()
    except Exception as error:  # closing a sandbox must not fail a verdict
        logger.warning("Could not close the judge sandbox: %r", error)
