"""Small-holdout cold-start SFT for RLM training (docs/cold_start.md).

A small model scores pass@16 = 0 on the RLM scaffold without SFT. What works (the RLM blog): SFT on teacher traces
of a **small held-out part** of the RL data (a few dozen examples), keeping only clean traces. SFT on the whole RL
set collapsed entropy, spiked the KL and then the reward. The pipeline, in order:

1. `split_cold_start`: hold out ``n`` examples for SFT; the rest is the RL set (disjoint, deterministic).
2. `generate_teacher_traces`: an OpenAI-compatible teacher plays the policy in the RLM scaffold (`trl_ext.rlm`):
   every turn it receives the rebuilt per-turn prompt as chat messages, exactly as the policy will.
3. `filter_traces`: drop traces with a REPL error (any node, any turn), a failed teacher call, no final answer,
   or a reward of zero (default: char-span F1 of the final answer against the gold evidence).
4. `traces_to_sft_rows`: one row per turn (root and children), prompt = that turn's messages, completion = the
   action, as a conversational prompt/completion `datasets.Dataset`: TRL's `SFTTrainer` then trains on the action
   only (``completion_only_loss``).

`warn_if_large_sft_set` (called by steps 1 and 4) warns when the SFT set is not small next to the RL set.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import random
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .judge.client import AsyncChatClient, ChatCallError
from .judge.event_loop import BackgroundEventLoop
from .rewards.span_f1 import CharSpanF1Reward
from .rlm import Completion, RLMEngine, RLMScaffoldConfig, RLMTask, RolloutTree
from .text import last_user_text

logger = logging.getLogger(__name__)

# Above either bound the cold-start set is no longer "a few dozen held-out examples" (docs/cold_start.md).
DEFAULT_MAX_SFT_FRACTION = 0.1
DEFAULT_MAX_SFT_EXAMPLES = 128

DROP_REASONS = ("teacher_error", "repl_error", "no_final_answer", "zero_reward")


# ----------------------------------------------------------------------------------------------------------------
# 1. The split
# ----------------------------------------------------------------------------------------------------------------
def split_cold_start(dataset: Any, n: int = 32, seed: int = 0) -> tuple[Any, Any]:
    """Hold out ``n`` examples for cold-start SFT; the rest is the RL set.

    The held-out rows are ``n`` distinct indices drawn with ``random.Random(seed)``; both splits keep the
    dataset's order. Same dataset, ``n`` and ``seed`` → same split, on any machine (no global RNG is touched).

    Args:
        dataset: a `datasets.Dataset` (anything with ``len`` and ``select``).
        n: examples in the SFT split; ``1 <= n < len(dataset)``.
        seed: seeds the draw.

    Returns:
        ``(sft_split, rl_split)``, disjoint, together the whole dataset.

    Raises:
        ValueError: ``n`` out of range.
    """
    size = len(dataset)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < size:
        raise ValueError(
            f"n={n!r} must be an int with 1 <= n < len(dataset) = {size}: hold out a few dozen examples and keep "
            "the rest for RL (the default is 32; see docs/cold_start.md)."
        )
    held_out = sorted(random.Random(seed).sample(range(size), n))
    held_out_set = set(held_out)
    rest = [i for i in range(size) if i not in held_out_set]
    warn_if_large_sft_set(n, len(rest))
    return dataset.select(held_out), dataset.select(rest)


def warn_if_large_sft_set(
    num_sft_examples: int,
    num_rl_examples: int,
    *,
    max_fraction: float = DEFAULT_MAX_SFT_FRACTION,
    max_examples: int = DEFAULT_MAX_SFT_EXAMPLES,
) -> bool:
    """Log a warning (and return True) when the cold-start SFT set is large next to the RL set.

    Large means more than ``max_fraction`` of the RL examples, or more than ``max_examples`` examples. Counts are
    *examples* (tasks), not SFT rows (one per turn).
    """
    if num_sft_examples < 0 or num_rl_examples < 0:
        raise ValueError(f"Example counts must be >= 0, got {num_sft_examples} and {num_rl_examples}.")
    too_many = num_sft_examples > max_examples
    too_large = num_sft_examples > max_fraction * num_rl_examples
    if too_many or too_large:
        logger.warning(
            "Cold-start SFT set: %d examples for %d RL examples (limits: %d examples, %.0f%% of the RL set). SFT on a "
            "large part of the RL data collapsed entropy, spiked the KL and then the reward in the RLM blog's runs; "
            "hold out a few dozen examples (split_cold_start(dataset, n=32)).",
            num_sft_examples,
            num_rl_examples,
            max_examples,
            100 * max_fraction,
        )
    return too_many or too_large


# ----------------------------------------------------------------------------------------------------------------
# 2. Teacher traces
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class TraceStep:
    """One turn of a teacher trace: the messages the teacher was given and the action it wrote."""

    node: int
    turn: int
    depth: int
    messages: list[dict[str, str]]
    action: str
    repl_error: str | None = None


@dataclass
class TeacherTrace:
    """One teacher rollout of one example.

    Attributes:
        example_index: the row of the dataset it solved.
        sample: which of the example's samples it is.
        tree: the whole rollout tree (`trl_ext.rlm.RolloutTree`; its token ids are internal keys, not tokens).
        steps: every turn of every node in pre-order, with the exact messages the teacher saw.
        teacher_errors: teacher calls that failed after their retries (they became empty actions).
        row: the dataset row (all its columns).
        reward: filled by `filter_traces`.
    """

    example_index: int
    sample: int
    tree: RolloutTree
    steps: list[TraceStep]
    teacher_errors: int = 0
    row: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None

    @property
    def final_answer(self) -> str | None:
        return self.tree.final_answer

    @property
    def repl_errors(self) -> int:
        """Turns (any node) whose REPL cell raised, timed out or crashed."""
        return sum(step.repl_error is not None for step in self.steps)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (for saving traces as JSONL)."""
        return {
            "example_index": self.example_index,
            "sample": self.sample,
            "final_answer": self.final_answer,
            "teacher_errors": self.teacher_errors,
            "reward": self.reward,
            "steps": [asdict(step) for step in self.steps],
            "tree": self.tree.to_dict(),
            "row": self.row,
        }


class TeacherChatGenerator:
    """A `trl_ext.rlm.Generator` whose "policy" is an OpenAI-compatible chat endpoint (the teacher).

    `RLMEngine` renders each prompt with its tokenizer and hands the generator token ids. A chat endpoint needs
    messages, so the engine is given `MessageCodec` as tokenizer: a prompt's "ids" are a key to the exact messages
    the scaffold built, and an action's "ids" a key to the teacher's text. Nothing is tokenized.

    A teacher call that fails after the client's retries, or returns an empty reply, becomes an empty action whose
    key is in `failed_keys`; `filter_traces` drops the traces that contain one.
    """

    def __init__(self, client: AsyncChatClient, codec: MessageCodec, **request_params: Any):
        self.client = client
        self.codec = codec
        self.request_params = request_params
        self.failed_keys: set[int] = set()
        self._loop = BackgroundEventLoop(name="trl-ext-teacher-loop")

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        conversations = [self.codec.messages(list(ids)) for ids in prompts]

        async def ask(messages: list[dict[str, str]]) -> str | None:
            try:
                result = await self.client.chat(messages, **self.request_params)
            except ChatCallError as error:
                logger.warning("Teacher call failed (empty action; the trace will be dropped): %s", error)
                return None
            return result.content or None  # an empty reply is as useless as a failed one

        async def ask_all() -> list[str | None]:
            return list(await asyncio.gather(*(ask(m) for m in conversations)))

        completions = []
        for text in self._loop.run(ask_all()):
            key = self.codec.encode_text(text or "")
            if text is None:
                self.failed_keys.add(key)
            completions.append(Completion(token_ids=[key], logprobs=[0.0]))
        return completions

    def close(self) -> None:
        self._loop.close()


class MessageCodec:
    """A stand-in tokenizer for `RLMEngine` that keeps texts whole: every text gets one integer key.

    ``apply_chat_template(messages)`` returns the messages as JSON; calling the codec on a text returns
    ``{"input_ids": [key]}``; ``decode([key, ...])`` returns the texts joined. `messages` reads a prompt back.
    """

    chat_template = "trl-ext message codec (JSON messages)"
    eos_token_id = None
    pad_token_id = None

    def __init__(self) -> None:
        self._texts: list[str] = []
        self._keys: dict[str, int] = {}
        self._lock = threading.Lock()

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], tokenize: bool = False, **_: Any) -> Any:
        text = json.dumps([dict(m) for m in messages], ensure_ascii=False)
        return [self.encode_text(text)] if tokenize else text

    def __call__(self, text: str, add_special_tokens: bool = False, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": [self.encode_text(text)]}

    def encode_text(self, text: str) -> int:
        with self._lock:
            key = self._keys.get(text)
            if key is None:
                key = self._keys[text] = len(self._texts)
                self._texts.append(text)
            return key

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, **_: Any) -> str:
        with self._lock:
            return "".join(self._texts[i] for i in ids)

    def messages(self, ids: Sequence[int]) -> list[dict[str, str]]:
        return json.loads(self.decode(ids))


def generate_teacher_traces(
    dataset: Any,
    teacher: AsyncChatClient,
    *,
    prompt_column: str = "prompt",
    context_column: str | None = "context",
    scaffold_config: RLMScaffoldConfig | None = None,
    num_samples: int = 1,
    request_params: dict[str, Any] | None = None,
) -> list[TeacherTrace]:
    """Run the RLM scaffold with an OpenAI-compatible teacher as the policy, ``num_samples`` times per example.

    The teacher answers every generation the policy would: the turns of root and child rollouts (each prompt
    rebuilt from scratch, sent as chat messages) and the ``llm_query`` completions. The REPL is the real sandboxed
    one (`trl_ext.rlm.PythonREPL`). Rollouts of all examples run concurrently; the client bounds the requests in
    flight.

    Args:
        dataset: rows with the task in ``prompt_column`` (a string, or a conversation whose last user message is the
            task) and the REPL's ``context`` in ``context_column`` (``None``: the prompt is the context).
        teacher: the teacher endpoint (`trl_ext.judge.AsyncChatClient`, with its retries and concurrency bound).
        scaffold_config: limits, sandbox and prompt templates of the scaffold; use the same as for RL training.
        num_samples: traces per example (more samples, more chances of a clean trace).
        request_params: per-request parameters for the teacher (e.g. ``{"temperature": 0.7}``).

    Returns:
        One `TeacherTrace` per (example, sample), in dataset order.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be >= 1.")
    columns = list(getattr(dataset, "column_names", []) or [])
    for name in (prompt_column, context_column):
        if name is not None and columns and name not in columns:
            raise KeyError(f"The dataset has no {name!r} column (columns: {columns}).")
    rows = [dict(row) for row in dataset]
    tasks, owners = [], []
    for index, row in enumerate(rows):
        prompt = row[prompt_column]
        task = last_user_text(prompt)
        context = row.get(context_column) if context_column is not None else None
        for sample in range(num_samples):
            tasks.append(RLMTask(prompt=task, context=context))
            owners.append((index, sample))
    codec = MessageCodec()
    generator = TeacherChatGenerator(teacher, codec, **(request_params or {}))
    try:
        trees = RLMEngine(generator, codec, scaffold_config).run(tasks)
    finally:
        generator.close()
    traces = []
    for (index, sample), tree in zip(owners, trees, strict=True):
        steps, teacher_errors = [], 0
        for node, turn_index, turn in tree.iter_turns():
            result = turn.repl_result
            error = None
            if result is not None and (result.error is not None or result.timed_out or result.crashed):
                error = result.error or ("timed out" if result.timed_out else "crashed")
            if set(turn.action_ids) & generator.failed_keys:
                teacher_errors += 1
            steps.append(
                TraceStep(
                    node=node.id,
                    turn=turn_index,
                    depth=node.depth,
                    messages=codec.messages(turn.prompt_ids),
                    action=turn.action,
                    repl_error=error,
                )
            )
            teacher_errors += sum(bool(set(call.completion_ids) & generator.failed_keys) for call in turn.llm_calls)
        traces.append(TeacherTrace(index, sample, tree, steps, teacher_errors, rows[index]))
    logger.info(
        "Teacher traces: %d rollouts of %d examples; %d with a final answer, %d with REPL errors.",
        len(traces),
        len(rows),
        sum(t.final_answer is not None for t in traces),
        sum(t.repl_errors > 0 for t in traces),
    )
    return traces


# ----------------------------------------------------------------------------------------------------------------
# 3. Filtering
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class TraceFilterReport:
    """What `filter_traces` kept and why it dropped the rest (one reason per trace, first that applies)."""

    kept: int
    dropped: dict[str, int]
    examples_kept: int


def filter_traces(
    traces: Sequence[TeacherTrace],
    reward_fn: Callable[..., Any] | None = None,
    *,
    min_reward: float = 0.0,
    max_per_example: int | None = 1,
    prompt_column: str = "prompt",
) -> tuple[list[TeacherTrace], TraceFilterReport]:
    """Keep the clean teacher traces.

    A trace is dropped, for the first reason that applies: ``"teacher_error"`` (a teacher call failed or came back empty),
    ``"repl_error"`` (a REPL cell of any node raised, timed out or crashed), ``"no_final_answer"`` (the root ended
    without one), ``"zero_reward"`` (its reward is ``<= min_reward``, e.g. char-span F1 = 0). Of the survivors,
    at most ``max_per_example`` per example are kept, highest reward first (ties: earliest sample).

    Args:
        traces: from `generate_teacher_traces`.
        reward_fn: a TRL-style reward function (``prompts``, ``completions`` and the dataset columns as keyword
            arguments; sync or async), called once with the final answers as completions. Default: char-span F1
            against the ``evidence`` column, quotes located in the ``context`` column (`CharSpanF1Reward`).
        min_reward: a trace needs a reward strictly above it.
        max_per_example: traces kept per example (``None``: all).
        prompt_column: the dataset column passed to ``reward_fn`` as ``prompts``.

    Returns:
        ``(kept traces, report)``; every trace's ``reward`` is set when it was scored.
    """
    reward_fn = reward_fn if reward_fn is not None else CharSpanF1Reward()
    dropped: Counter[str] = Counter()
    candidates = []
    for trace in traces:
        if trace.teacher_errors:
            dropped["teacher_error"] += 1
        elif trace.repl_errors:
            dropped["repl_error"] += 1
        elif trace.final_answer is None:
            dropped["no_final_answer"] += 1
        else:
            candidates.append(trace)
    if candidates:
        columns: dict[str, list[Any]] = {}
        for key in candidates[0].row:
            if key not in (prompt_column, "prompt", "completion", "completion_ids"):
                columns[key] = [trace.row.get(key) for trace in candidates]
        rewards = reward_fn(
            prompts=[trace.row.get(prompt_column) for trace in candidates],
            completions=[trace.final_answer for trace in candidates],
            completion_ids=None,
            **columns,
        )
        if inspect.isawaitable(rewards):
            loop = BackgroundEventLoop(name="trl-ext-filter-loop")
            try:
                rewards = loop.run(rewards)
            finally:
                loop.close()
        if len(rewards) != len(candidates):
            raise ValueError(f"reward_fn returned {len(rewards)} rewards for {len(candidates)} traces.")
        for trace, reward in zip(candidates, rewards, strict=True):
            trace.reward = None if reward is None else float(reward)
    survivors = []
    for trace in candidates:
        if trace.reward is None or not trace.reward > min_reward:
            dropped["zero_reward"] += 1
        else:
            survivors.append(trace)
    by_example: dict[int, list[TeacherTrace]] = {}
    for trace in survivors:
        by_example.setdefault(trace.example_index, []).append(trace)
    kept = []
    for example in sorted(by_example):
        ranked = sorted(by_example[example], key=lambda t: (-(t.reward or 0.0), t.sample))
        kept.extend(ranked if max_per_example is None else ranked[:max_per_example])
    report = TraceFilterReport(
        kept=len(kept),
        dropped={reason: dropped.get(reason, 0) for reason in DROP_REASONS},
        examples_kept=len(by_example),
    )
    logger.info(
        "Teacher trace filter: kept %d traces of %d examples; dropped %s.", len(kept), len(by_example), report.dropped
    )
    return kept, report


# ----------------------------------------------------------------------------------------------------------------
# 4. Stepwise SFT rows
# ----------------------------------------------------------------------------------------------------------------
def traces_to_sft_rows(
    traces: Sequence[TeacherTrace],
    *,
    include_children: bool = True,
    num_rl_examples: int | None = None,
) -> Any:
    """One SFT row per turn of every kept trace: stepwise samples (docs/stepwise_rlm.md) with the teacher's actions.

    Each row is ``prompt`` = the turn's messages (system, REPL history, fresh user message), exactly as the
    scaffold rebuilt them, and ``completion`` = ``[{"role": "assistant", "content": action}]``: a conversational
    prompt/completion dataset, so TRL's `SFTTrainer` computes the loss on the action only
    (``completion_only_loss``, on by default for this format). Extra columns: ``example_index``, ``node``,
    ``turn``, ``depth`` (ints; drop them if your collator objects).

    Args:
        traces: kept traces (`filter_traces`).
        include_children: also the turns of child rollouts (the same policy writes them).
        num_rl_examples: size of the RL set; when given, `warn_if_large_sft_set` checks the SFT examples against it.
    """
    from datasets import Dataset

    rows: dict[str, list[Any]] = {
        "prompt": [],
        "completion": [],
        "example_index": [],
        "node": [],
        "turn": [],
        "depth": [],
    }
    for trace in traces:
        for step in trace.steps:
            if step.depth > 0 and not include_children:
                continue
            rows["prompt"].append([dict(m) for m in step.messages])
            rows["completion"].append([{"role": "assistant", "content": step.action}])
            rows["example_index"].append(trace.example_index)
            rows["node"].append(step.node)
            rows["turn"].append(step.turn)
            rows["depth"].append(step.depth)
    if num_rl_examples is not None:
        warn_if_large_sft_set(len({trace.example_index for trace in traces}), num_rl_examples)
    if not rows["prompt"]:
        raise ValueError("No SFT rows: no trace survived the filter. Sample more traces (num_samples) or relax it.")
    return Dataset.from_dict(rows)
