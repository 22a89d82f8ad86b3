"""A method's rollouts, whatever runs them: the `RolloutMethod` interface, what it may use of the runtime that drives
it (`RolloutRuntime`), a scored group of completions (`ScoredGroup`) and TRL's reward-function interface.

One rollout worker serves every method (`trl_ext.trainers.async_worker.RolloutWorker`, a thread of TRL's
asynchronous trainer): it owns the thread, the queues, the policy versions, the reward functions and the errors, and
on each run asks its method for the samples of a few dataset rows: ``method.rollout(rows, runtime, version) ->
list[TrainingSample]``. Each method writes that step once, in its own package:

- plain GRPO: `GRPOGroups` (here): one sample per completion of each group;
- judge credit: `trl_ext.judge.method.JudgeCredit` (the group's completions judged, the capped credit per token);
- RLMT: `trl_ext.rewards.rlmt.method.RLMT` (RLMT prompts, completions cut at the stop strings);
- stepwise RLM: `trl_ext.rlm.method.StepwiseRLM` (one engine run, one sample per trained turn).

Pure: imports nothing of trl-ext's trainers (a method never sees the loop, only `RolloutRuntime`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from .advantages import async_group_advantages
from .samples import TrainingSample

__all__ = [
    "GRPOGroups",
    "RolloutMethod",
    "RolloutRuntime",
    "ScoredGroup",
    "as_completions",
    "checked_reward_weights",
    "group_metrics",
    "population_std",
    "reward_func_names",
    "reward_name",
    "reward_table",
]


class RolloutRuntime(Protocol):
    """What a method's `RolloutMethod.rollout` may use of the worker that runs it."""

    tokenizer: Any  # the policy's tokenizer
    num_generations: int  # rollouts per prompt (one group)
    reward_func_names: list[str]
    chat_template_kwargs: dict[str, Any]

    @property
    def policy(self) -> Any:
        """The policy's sampler (`trl_ext.rlm.Generator`), ticking the worker's heartbeat around every call."""

    def sample_groups(self, rows: Sequence[dict[str, Any]]) -> list[ScoredGroup]:
        """``num_generations`` completions of each row in one sampler call, through the method's `prompt_ids` and
        `finish_completions`, each group scored (rewards, advantages, a group id)."""

    def call_rewards(
        self, row: dict[str, Any], texts: list[str], ids: list[list[int]], **extra: list[Any]
    ) -> list[list[float]]:
        """``(functions, G)`` rewards of ``G`` completions of ``row``'s prompt, NaN where a function gave None."""

    def summed_rewards(self, per_func: Sequence[Sequence[float]], unscored: float = 0.0) -> list[float]:
        """``(G,)`` the rewards weighted by ``reward_weights`` and summed (NaN skipped; ``unscored`` where all are)."""

    def group_advantages(self, rewards: Sequence[float]) -> list[float]:
        """``(G,)`` advantages of one group under ``scale_rewards`` (`GRPOTrainer`'s)."""

    def next_group_id(self) -> int:
        """A new group id (they count up over the run; a resumed run continues the count)."""

    def push_metrics(self, metrics: dict[str, Any]) -> None:
        """Metrics for the trainer's log: a value, or a ``(numerator, denominator)`` rate."""

    def tick(self) -> None:
        """The heartbeat: a long call in progress is not a hang."""

    def step(self) -> int:
        """The trainer's global step (for records such as the judge's audit log)."""


class RolloutMethod:
    """What the rollout worker asks of a method (module docstring). A method overrides `rollout` and, where it samples
    groups with `RolloutRuntime.sample_groups`, the hooks that shape them.

    Attributes:
        name: the worker's name in messages ("The <name> rollout worker ...").
        metric_prefix: its counters' prefix (``<prefix>/worker_errors_total``).
        in_flight: what the worker's ``stop`` may still wait for; stale_advice: appended to the no-progress error.
        weighted: the samples carry "subtree" loss weights (`TrainingSample.node_weight`).
        unscored_reward: a completion's reward where every reward function returned None (0: `GRPOTrainer`'s nansum;
            NaN: left out of the group advantage, `trl_ext.advantages.scored_advantages`).
    """

    name: ClassVar[str] = "rollout"
    metric_prefix: ClassVar[str] = "rollout"
    in_flight: ClassVar[str] = "a run is still going"
    stale_advice: ClassVar[str] = ""
    weighted: bool = False
    unscored_reward: ClassVar[float] = 0.0

    def rollout(self, rows: Sequence[dict[str, Any]], runtime: RolloutRuntime, version: int) -> list[TrainingSample]:
        """The samples of ``runtime.num_generations`` rollouts of each of ``rows``, sampled from policy ``version``."""
        raise NotImplementedError(f"{type(self).__name__} must implement rollout(rows, runtime, version).")

    def prompt_ids(self, prompt: Any, runtime: RolloutRuntime) -> list[int]:
        """The prompt's token ids through the chat template (a string is one user message), generation prompt added."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        text = runtime.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **runtime.chat_template_kwargs
        )
        return list(runtime.tokenizer(text, add_special_tokens=False)["input_ids"])

    def finish_completions(self, completions: list[Any], runtime: RolloutRuntime) -> list[Any]:
        """A run's completions as they are scored and trained (a method may cut them); as sampled here."""
        return completions

    def group_advantages(self, rewards: Sequence[float], runtime: RolloutRuntime) -> list[float]:
        """``(G,)`` advantages of one group's rewards: `GRPOTrainer`'s under ``scale_rewards``."""
        return runtime.group_advantages(rewards)

    def close(self) -> None:
        """Called once the worker's thread has ended (close what the runs opened)."""

    def discard_records_after(self, step: int, writer: str) -> None:
        """Drop what ``writer`` (a synchronous trainer's ``rank<k>``) recorded for the steps after ``step``, where a
        resumed run starts (`trl_ext.jsonl.written_after`); nothing recorded here."""


class GRPOGroups(RolloutMethod):
    """Plain GRPO: one sample per completion with at least one token (what `ExtAsyncGRPOTrainer` trains on when it is
    given a ``generator=``).

    Args:
        advantage_fn: a group's ``(G,)`` rewards to its advantages (default `async_group_advantages`, TRL's
            asynchronous worker's; None: `GRPOTrainer`'s under ``scale_rewards``).
    """

    name = "GRPO"
    stale_advice = ": the generator may hang"

    def __init__(self, advantage_fn: Callable[[Sequence[float]], list[float]] | None = async_group_advantages) -> None:
        self.advantage_fn = advantage_fn
        self.last_groups: list[ScoredGroup] = []  # the groups of the last run (for inspection)

    def group_advantages(self, rewards: Sequence[float], runtime: RolloutRuntime) -> list[float]:
        if self.advantage_fn is None:
            return runtime.group_advantages(rewards)
        return self.advantage_fn(rewards)

    def rollout(self, rows: Sequence[dict[str, Any]], runtime: RolloutRuntime, version: int) -> list[TrainingSample]:
        self.last_groups = runtime.sample_groups(rows)
        return [
            group.training_sample(index, runtime.reward_func_names)
            for group in self.last_groups
            for index, completion in enumerate(group.completions)
            if completion.token_ids
        ]


@dataclass
class ScoredGroup:
    """One prompt's ``G`` completions, scored.

    Attributes:
        row: the dataset row; prompt_ids: its ``(P,)`` token ids; completions: the ``G`` completions (`Completion`).
        texts: the completions decoded (special tokens skipped); per_func: ``(functions, G)`` rewards (NaN: None).
        rewards: ``(G,)`` the sums (None skipped); advantages: ``(G,)`` the group advantages; reward_std: the rewards' std
            (population); group_id: the group's id (counts up over the run).
    """

    row: dict[str, Any]
    prompt_ids: list[int]
    completions: list[Any]
    texts: list[str]
    per_func: list[list[float]]
    rewards: list[float]
    advantages: list[float]
    reward_std: float
    group_id: int

    def metrics(self, index: int, names: Sequence[str]) -> dict[str, float]:
        """The metrics rollout ``index`` carries (`group_metrics`)."""
        return group_metrics(index, self.rewards[index], self.reward_std, names, self.per_func)

    def training_sample(self, index: int, names: Sequence[str], **fields: Any) -> TrainingSample:
        """Completion ``index`` as a `TrainingSample`: the prompt ids, its ids and log-probs, its group advantage,
        its metrics (``names``: the reward functions'), the prompt and the completion as TRL shows them; ``fields``:
        what a method adds (``token_credit``)."""
        completion = self.completions[index]
        return TrainingSample(
            prompt_ids=list(self.prompt_ids),
            completion_ids=list(completion.token_ids),
            logprobs=list(completion.logprobs),
            advantage=self.advantages[index],
            group_id=self.group_id,
            metrics=self.metrics(index, names),
            prompt=self.row["prompt"],
            completion=as_completions(self.row["prompt"], [self.texts[index]])[0],
            **fields,
        )


# ---------------------------------------------------------------------------------- rewards (TRL's interface)
def reward_name(func: Any) -> str:
    """A reward function's name, as the workers log it (``rewards/<name>``) and a config names it: its ``__name__``,
    else its class's."""
    return getattr(func, "__name__", None) or type(func).__name__


def reward_func_names(funcs: Sequence[Any]) -> list[str]:
    """Each reward function's name (`reward_name`)."""
    return [reward_name(func) for func in funcs]


def checked_reward_weights(reward_weights: Sequence[float] | None, names: Sequence[str]) -> list[float]:
    """``reward_weights`` as floats, one per reward function (None: all 1)."""
    if reward_weights is None:
        return [1.0] * len(names)
    if len(reward_weights) != len(names):
        raise ValueError(
            f"reward_weights={list(reward_weights)} has {len(reward_weights)} weight(s) for {len(names)} reward "
            f"function(s) {list(names)}: give one weight per reward function, in their order, or None (every "
            "weight 1)."
        )
    return [float(weight) for weight in reward_weights]


def population_std(rewards: Sequence[float]) -> float:
    """The population std of the rewards that are not NaN (the ``reward_std`` metric); NaN when none is."""
    values = [value for value in rewards if not math.isnan(value)]
    if not values:
        return math.nan
    mean = sum(values) / len(values)
    return (sum((value - mean) ** 2 for value in values) / len(values)) ** 0.5


def as_completions(prompt: Any, texts: Sequence[str]) -> list[Any]:
    """The ``completions`` TRL passes to reward functions: conversational (one assistant message each) for a
    conversational prompt, the texts for a text prompt."""
    if isinstance(prompt, str):
        return list(texts)
    return [[{"role": "assistant", "content": text}] for text in texts]


def reward_table(
    reward_funcs: Sequence[Callable[..., Any]],
    names: Sequence[str],
    kwargs: Mapping[str, Any],
    size: int,
    resolve: Callable[[Any], Any] | None = None,
) -> list[list[float]]:
    """Every reward function called once with TRL's keyword lists.

    Args:
        reward_funcs, names: the functions and their names (for the error).
        kwargs: ``prompts``, ``completions``, ``completion_ids``, the dataset columns, ... as lists of ``size``.
        size: ``G``, the completions scored.
        resolve: turns a function's return value into its rewards (e.g. awaits an awaitable); None: as returned.

    Returns:
        ``(functions, G)`` floats, NaN where a function returned None.
    """
    table = []
    for func, name in zip(reward_funcs, names, strict=True):
        values = func(**kwargs)
        values = list(values if resolve is None else resolve(values))
        if len(values) != size:
            raise ValueError(f"reward function {name} returned {len(values)} rewards for {size} completions.")
        table.append([math.nan if value is None else float(value) for value in values])
    return table


def group_metrics(
    index: int, reward: float, reward_std: float, names: Sequence[str], per_func: Sequence[Sequence[float]]
) -> dict[str, float]:
    """The metrics every sample of rollout ``index`` carries: ``reward``, ``reward_std`` (the group's),
    ``frac_reward_zero_std`` (1 when the group's rewards are all equal: averaged over the samples, the share of the
    samples that carry no outcome advantage, `GRPOTrainer`'s metric of the same name, which the monitors'
    ``reward_no_signal`` reads) and ``rewards/<function>`` from the ``(functions, G)`` table ``per_func``."""
    return {
        "reward": reward,
        "reward_std": reward_std,
        "frac_reward_zero_std": float(abs(reward_std) <= 1e-8),  # as GRPOTrainer: torch.isclose(std, 0)
        **{f"rewards/{name}": values[index] for name, values in zip(names, per_func)},
    }
