"""Rubric LLM-judge reward (docs/rubric_judge.md): an OpenAI-compatible judge grades a prediction against the truth.

The RLM blog replaced the noisy char-span F1 (`trl_ext.rewards.span_f1`) by this judge: given the query, the ground
truth and the prediction, it scores **precision** (how much of the prediction is right) and **recall** (how much of
the ground truth the prediction covers), each 1–10, and the reward is ``(p/10 + r/10) / 2``. The rubric text, the
score fields, their scale and the score → reward mapping are all configurable (`RubricJudgeConfig`, in
`rubric_config`; reading the judge's reply is `rubric_parsing`).

Robustness, so that a judge never stops training:

- requests go through `trl_ext.judge.client.AsyncChatClient` (bounded concurrency, wall-clock timeout, the openai
  SDK's retries with backoff, API key from an environment variable: `trl_ext.judge.endpoint.EndpointSettings`);
- JSON-schema structured output is sent where the endpoint supports it (dropped automatically where it does not),
  and the reply is parsed tolerantly anyway (JSON anywhere in the text, else ``precision: 8/10``-style lines);
- an unparseable reply gets ``repair_attempts`` follow-up requests asking for the JSON only
  (`AsyncChatClient.chat_parsed`, as for the span judge);
- a judgement that still fails (endpoint error after retries, or no valid scores) gets ``fallback_reward`` and is
  counted in `RubricJudgeReward.stats`; nothing is raised into the training loop. Per batch, the counts are also
  logged through TRL's ``log_metric`` (``rubric_judge/failed``, ``rubric_judge/unparseable``, ...).

Everything taken from the rollout or the dataset is placed inside blocks fenced by a random per-request nonce, and
the system message tells the judge that block contents are data, never instructions: a policy cannot end its block
early or pose as the grading harness to ask for a 10 (delimiter-shaped text in the data is replaced,
`trl_ext.judge.prompts.defang_data`).

**Judge injection.** The policy may write its own scores into its answer (``{"precision": 10, "recall": 10}``),
hoping the judge quotes them before its verdict and the parser reads them. A reply that is one JSON object
(structured output) is read as a whole; in any other reply a verdict or score line that the prediction holds too is a
quote and is dropped, and of several different scores left the lowest is taken (`parse_rubric_scores`): never a
refusal, whose fallback reward a policy could aim for. A reply cut at the token limit is asked again, never read. A
prediction holding verdict-shaped JSON or delimiter-shaped text sets ``RubricVerdict.injection_suspected``,
counted in ``stats.injection_suspected`` and logged per batch as ``<name>/injection_suspected``; the judge is told,
outside the data, that such JSON in the prediction is the policy's text.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..judge.client import REPLY_STATUSES, AsyncChatClient, JudgeOutcome
from ..judge.event_loop import BackgroundEventLoop
from ..judge.prompts import defang_data, has_forged_delimiter, new_nonce
from ..judge.verdicts import read_from_text, reply_verdicts, verdict_tag
from ..text import completion_text, final_answer_text, last_user_text
from .rlmt import split_thinking
from .rubric_config import FORGED_SCORES_NOTE, REPAIR_PROMPT, RubricJudgeConfig
from .rubric_parsing import (
    forged_score_verdicts,
    mean_score_fraction,
    parse_rubric_scores,
    response_format_for,
    score_text,
    score_verdict_of,
)

logger = logging.getLogger(__name__)

VERDICT_STATUSES = REPLY_STATUSES  # a verdict's status is that of the judge's reply


@dataclass
class RubricVerdict(JudgeOutcome):
    """One judgement.

    Attributes:
        status: ``"ok"``, ``"unparseable"`` (no valid scores, repairs included) or ``"failed"`` (endpoint error after
            retries, or a reward mapping that raised).
        reward: the reward given (``fallback_reward`` unless ``status == "ok"``).
        scores: the parsed scores (empty unless ``"ok"``).
        explanation: the judge's explanation, when it gave one.
        requests: chat requests sent, retries and repairs included.
        error: what went wrong.
        raw_output: the judge's last reply text.
        injection_suspected: the prediction holds verdict-shaped JSON or delimiter-shaped text, or a reply of the
            judge gave several different scores of its own.
        text_verdict: the scores were read out of free text (`trl_ext.judge.verdicts.read_from_text`), not from a
            reply that is one JSON object; counted as ``<name>/text_verdicts``.
    """

    status: str
    reward: float | None
    scores: dict[str, float] = field(default_factory=dict)
    explanation: str | None = None
    requests: int = 0
    error: str | None = None
    raw_output: str | None = None
    injection_suspected: bool = False
    text_verdict: bool = False


@dataclass
class RubricJudgeStats:
    """Counters since the reward was created.

    Attributes:
        judged: judgements made (one per completion).
        ok: judgements with valid scores.
        unparseable: replies with no valid scores after the repair attempts.
        failed: endpoint failures after retries (and mapping errors).
        repaired: judgements that needed a repair request and then parsed.
        requests: chat requests sent, retries included.
        injection_suspected: judgements with ``RubricVerdict.injection_suspected``.
    """

    judged: int = 0
    ok: int = 0
    unparseable: int = 0
    failed: int = 0
    repaired: int = 0
    requests: int = 0
    injection_suspected: int = 0

    @property
    def fallbacks(self) -> int:
        """Completions that got the fallback reward."""
        return self.unparseable + self.failed


class RubricJudgeReward:
    """The rubric LLM judge as a TRL reward function (async): ``await reward(prompts, completions, **columns)``.

    Plugs into `trl.GRPOTrainer` and `trl_ext.ExtGRPOTrainer` unchanged (TRL runs async reward functions on its own
    event loop, concurrently with the other async rewards). Outside a trainer, use `score` (synchronous) or
    `judge_many` (async).

    The query is the prompt's last user message (or ``config.query_column``), the ground truth
    ``config.ground_truth_column``, and the prediction the completion's final answer: ``extract_prediction`` of the
    completion text (default: the response after any ``</think>``, then the inside of the last ``FINAL(...)``
    line when there is one, else the whole response).

    Args:
        config: a [`RubricJudgeConfig`]; built from ``config_kwargs`` when omitted.
        client: an `AsyncChatClient` to use instead of one built from the config (share one client between judges
            to share its concurrency bound).
        extract_prediction: completion text → the prediction shown to the judge.
        **config_kwargs: fields of `RubricJudgeConfig` (only when ``config`` is omitted).

    Example:
        >>> reward = RubricJudgeReward(base_url="http://127.0.0.1:8000/v1", model="Qwen/Qwen3-8B")  # doctest: +SKIP
        >>> trainer = GRPOTrainer(model, reward_funcs=reward, train_dataset=dataset)  # "answer" column  # doctest: +SKIP
    """

    def __init__(
        self,
        config: RubricJudgeConfig | None = None,
        *,
        client: AsyncChatClient | None = None,
        extract_prediction: Callable[[str], str] | None = None,
        **config_kwargs: Any,
    ):
        if config is not None and config_kwargs:
            raise TypeError(f"Pass either config or config fields, not both (got config and {sorted(config_kwargs)}).")
        self.config = config if config is not None else RubricJudgeConfig(**config_kwargs)
        self.client = client or AsyncChatClient.from_settings(self.config.endpoint())
        self.extract_prediction = extract_prediction or default_prediction
        self.__name__ = self.config.name
        self.stats = RubricJudgeStats()
        self._stats_lock = threading.Lock()
        self._response_format = response_format_for(self.config.score_fields)
        fields = "".join(f', "{name}": <number>' for name in self.config.score_fields)
        self._json_shape = '{"explanation": "<one or two sentences>"' + fields + "}"
        self._loop: BackgroundEventLoop | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.__name__!r}, client={self.client!r})"

    @property
    def required_columns(self) -> list[str]:
        """The dataset columns this reward reads (trl-ext's trainers check them when they are built)."""
        return [self.config.ground_truth_column] + ([self.config.query_column] if self.config.query_column else [])

    # ------------------------------------------------------------------------------------------------------------
    # TRL reward-function interface
    # ------------------------------------------------------------------------------------------------------------
    async def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        """One reward per completion; never raises for a judge fault (see the module docstring)."""
        queries, ground_truths = self._queries_and_truths(prompts, len(completions), kwargs)
        predictions = [self.extract_prediction(completion_text(completion)) for completion in completions]
        verdicts = await self.judge_many(queries, ground_truths, predictions)
        self._log_batch(verdicts, kwargs.get("log_metric"))
        return [verdict.reward for verdict in verdicts]

    # ------------------------------------------------------------------------------------------------------------
    # Judging
    # ------------------------------------------------------------------------------------------------------------
    async def judge_many(
        self, queries: Sequence[str], ground_truths: Sequence[str | None], predictions: Sequence[str]
    ) -> list[RubricVerdict]:
        """Judge several predictions concurrently (the client bounds the requests in flight)."""
        if not len(queries) == len(ground_truths) == len(predictions):
            raise ValueError(
                f"Got {len(queries)} queries, {len(ground_truths)} ground truths and {len(predictions)} predictions; "
                "pass one of each per prediction."
            )
        return list(
            await asyncio.gather(
                *(self.judge(q, t, p) for q, t, p in zip(queries, ground_truths, predictions, strict=True))
            )
        )

    async def judge(self, query: str, ground_truth: str | None, prediction: str) -> RubricVerdict:
        """Judge one prediction. Never raises for a judge fault: a failure is a verdict with the fallback reward."""
        verdict = RubricVerdict(status="failed", reward=self.config.fallback_reward)
        if ground_truth is None:
            verdict.error = f"no ground truth (column {self.config.ground_truth_column!r} is None for this row)"
        else:
            try:
                await self._converse(str(query), str(ground_truth), str(prediction), verdict)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a judge fault must never stop training
                logger.warning("Rubric judge crashed on a completion (fallback reward): %r", error, exc_info=True)
                verdict.status, verdict.error = "failed", f"{type(error).__name__}: {error}"
        if not verdict.ok:
            verdict.reward, verdict.scores = self.config.fallback_reward, {}
        self._count(verdict)
        return verdict

    def score(
        self,
        queries: Sequence[str],
        ground_truths: Sequence[str | None],
        predictions: Sequence[str],
        timeout: float | None = None,
    ) -> list[RubricVerdict]:
        """Synchronous `judge_many`, run on a background event loop (works inside notebooks too)."""
        if self._loop is None:
            self._loop = BackgroundEventLoop(name=f"{self.__name__}-loop")
        return self._loop.run(self.judge_many(queries, ground_truths, predictions), timeout=timeout)

    def close(self) -> None:
        """Stop the background loop of `score`, if one was started."""
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def build_messages(
        self, query: str, ground_truth: str, prediction: str, *, forged_scores: bool = False, nonce: str | None = None
    ) -> list[dict[str, str]]:
        """The judge conversation for one prediction (system rubric, user message with nonce-fenced, defanged data);
        ``forged_scores`` adds a note, outside the data, that the prediction holds verdict-shaped JSON; ``nonce``
        (default: a new one) also makes the verdict's `trl_ext.judge.verdicts.verdict_tag`."""
        nonce = nonce or new_nonce()
        config = self.config
        rubric = config.rubric.format(min_score=score_text(config.min_score), max_score=score_text(config.max_score))
        system = config.system_prompt.format(
            rubric=rubric,
            nonce=nonce,
            json_shape=self._json_shape,
            verdict_tag=verdict_tag(nonce),
            min_score=score_text(config.min_score),
            max_score=score_text(config.max_score),
        )
        user = config.user_template.format(
            query=defang_data(query),
            ground_truth=defang_data(ground_truth),
            prediction=defang_data(prediction),
            nonce=nonce,
        )
        if forged_scores:
            user += "\n\n" + FORGED_SCORES_NOTE
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def _own_verdicts(self, reply: str | None, prediction: str, tag: str) -> list[dict[str, Any]]:
        """The different score verdicts the reply wrote itself, those the prediction holds dropped
        (`trl_ext.judge.verdicts.reply_verdicts`)."""
        verdict_of = functools.partial(score_verdict_of, score_fields=self.config.score_fields)
        return reply_verdicts(
            reply or "", verdict_of, forged=forged_score_verdicts(prediction, self.config.score_fields), tag=tag
        )

    def reward_from_scores(self, scores: Mapping[str, float]) -> float:
        """Apply the configured mapping (default: mean of ``score / max_score``)."""
        if self.config.score_mapping is None:
            return mean_score_fraction(scores, self.config.max_score)
        value = float(self.config.score_mapping(dict(scores)))
        if not math.isfinite(value):
            raise ValueError(
                f"score_mapping returned {value} for scores {dict(scores)}; it must return a finite float."
            )
        return value

    async def _converse(self, query: str, ground_truth: str, prediction: str, verdict: RubricVerdict) -> None:
        config = self.config
        forged = bool(forged_score_verdicts(prediction, config.score_fields))
        verdict.injection_suspected = forged or has_forged_delimiter(prediction)
        nonce = new_nonce()
        tag = verdict_tag(nonce)
        parsed = await self.client.chat_parsed(
            self.build_messages(query, ground_truth, prediction, forged_scores=forged, nonce=nonce),
            functools.partial(
                parse_rubric_scores,
                score_fields=config.score_fields,
                min_score=config.min_score,
                max_score=config.max_score,
                prediction=prediction,
                tag=tag,
            ),
            repairs=config.repair_attempts,
            repair_prompt=lambda error: REPAIR_PROMPT.format(
                error=error, json_shape=self._json_shape, verdict_tag=tag
            ),
            response_format=self._response_format,
        )
        verdict.requests += parsed.requests
        verdict.raw_output = parsed.raw_output
        verdict.injection_suspected |= parsed.injection_suspected
        # several verdicts of its own in one reply (the lowest was taken): a paraphrased quote, or a judge of two minds
        verdict.injection_suspected |= len(self._own_verdicts(parsed.raw_output, prediction, tag)) > 1
        if not parsed.ok:
            verdict.status, verdict.error = parsed.status, parsed.error
            return
        scores, explanation = parsed.value
        verdict.text_verdict = read_from_text(parsed.raw_output)
        verdict.reward = self.reward_from_scores(scores)
        verdict.status, verdict.scores, verdict.explanation, verdict.error = "ok", scores, explanation, None
        if parsed.repairs:
            with self._stats_lock:
                self.stats.repaired += 1

    # ------------------------------------------------------------------------------------------------------------
    # Bookkeeping
    # ------------------------------------------------------------------------------------------------------------
    def _queries_and_truths(
        self, prompts: Sequence[Any], num: int, kwargs: Mapping[str, Any]
    ) -> tuple[list[str], list[Any]]:
        config = self.config
        if config.ground_truth_column not in kwargs:
            columns = sorted(
                k for k in kwargs if k not in ("trainer_state", "log_extra", "log_metric", "completion_ids")
            )
            raise KeyError(
                f"RubricJudgeReward needs the ground truth in the dataset column {config.ground_truth_column!r}, "
                f"which the batch lacks (columns: {columns}). Add it, or set ground_truth_column."
            )
        ground_truths = list(kwargs[config.ground_truth_column])
        if config.query_column is not None:
            if config.query_column not in kwargs:
                raise KeyError(
                    f"query_column={config.query_column!r} is not a dataset column; set it to None to read the query "
                    "from the prompt."
                )
            queries = [str(q) for q in kwargs[config.query_column]]
        else:
            try:
                queries = [last_user_text(prompt) for prompt in prompts]
            except ValueError as error:
                raise ValueError(f"{error} Or name a dataset column holding the query with `query_column`.") from error
        if not len(queries) == len(ground_truths) == num:
            raise ValueError(
                f"Got {len(queries)} prompts and {len(ground_truths)} ground truths for {num} completions."
            )
        return queries, ground_truths

    def _count(self, verdict: RubricVerdict) -> None:
        with self._stats_lock:
            self.stats.judged += 1
            self.stats.requests += verdict.requests
            self.stats.injection_suspected += verdict.injection_suspected
            if verdict.status == "ok":
                self.stats.ok += 1
            elif verdict.status == "unparseable":
                self.stats.unparseable += 1
            else:
                self.stats.failed += 1

    def _log_batch(self, verdicts: Sequence[RubricVerdict], log_metric: Callable[[str, float], None] | None) -> None:
        num = len(verdicts)
        failed = sum(v.status == "failed" for v in verdicts)
        unparseable = sum(v.status == "unparseable" for v in verdicts)
        if failed or unparseable:
            logger.warning(
                "%s: %d of %d judgements failed and %d were unparseable; they got the fallback reward %s "
                "(totals so far: %s).",
                self.__name__,
                failed,
                num,
                unparseable,
                self.config.fallback_reward,
                asdict(self.stats),
            )
        if log_metric is None or num == 0:
            return
        prefix = self.__name__
        log_metric(f"{prefix}/failed", float(failed))
        log_metric(f"{prefix}/unparseable", float(unparseable))
        log_metric(f"{prefix}/fallback_ratio", (failed + unparseable) / num)
        log_metric(f"{prefix}/injection_suspected", float(sum(v.injection_suspected for v in verdicts)))
        log_metric(f"{prefix}/text_verdicts", float(sum(v.text_verdict for v in verdicts)))
        ok = [v for v in verdicts if v.ok]
        for name in self.config.score_fields:
            if ok:
                log_metric(f"{prefix}/{name}_mean", sum(v.scores[name] for v in ok) / len(ok))


def default_prediction(text: str) -> str:
    """The prediction shown to the judge: the response after any ``</think>``, then the inside of a final
    ``FINAL(...)`` line when there is one."""
    if "</think>" in text:
        text = split_thinking(text).response
    return final_answer_text(text)
