"""`GroupRolloutWorker`: plain GRPO rollouts for TRL's asynchronous trainer from any `trl_ext.rlm.Generator`.

TRL's own rollout worker samples from ``vllm serve`` in a spawned process. This one is a thread of the trainer process
(`ThreadedRolloutWorker`) that samples from the generator it is given: `LocalPolicy` (no server) or the served policy.
One run, for ``groups_per_run`` prompts of the dataset (in order, cycling): ``num_generations`` completions each in one
generator call; the reward functions called with TRL's keyword lists (the rewards of several functions weighted by
``reward_weights`` and summed; None skipped); the group advantages (``advantage_fn``: TRL's asynchronous worker's by
default, `async_group_advantages`); one `RolloutSample` per completion (`ScoredGroup.training_sample`,
`to_rollout_sample`). It is what `ExtAsyncGRPOTrainer` trains on when
it is given a ``generator=``, and the group scoring the judge-credit worker builds on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..advantages import async_group_advantages
from ..rlm.generators import Completion
from ..samples import TrainingSample
from .async_worker import (
    ThreadedRolloutWorker,
    as_completions,
    group_metrics,
    population_std,
    to_rollout_sample,
)

__all__ = ["GroupRolloutWorker", "ScoredGroup"]


@dataclass
class ScoredGroup:
    """One prompt's ``G`` completions, scored.

    Attributes:
        row: the dataset row; prompt_ids: its ``(P,)`` token ids; completions: the ``G`` completions.
        texts: the completions decoded (special tokens skipped); per_func: ``(functions, G)`` rewards (NaN: None).
        rewards: ``(G,)`` the sums (None skipped); advantages: ``(G,)`` the group advantages; reward_std: the rewards' std
            (population); group_id: the group's id (counts up over the run).
    """

    row: dict[str, Any]
    prompt_ids: list[int]
    completions: list[Completion]
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


class GroupRolloutWorker(ThreadedRolloutWorker):
    """GRPO rollouts for TRL's asynchronous trainer (``rollout_worker=``), in a thread of this process.

    Args:
        advantage_fn: a group's ``(G,)`` rewards to its advantages (default `async_group_advantages`, TRL's
            asynchronous worker's; None: `GRPOTrainer`'s under ``scale_rewards``, as the method workers score).
        worker_args: those of `ThreadedRolloutWorker` (``dataset``, ``reward_funcs``, ``tokenizer``, ``generator``,
            ``num_generations``, ...).
    """

    worker_name = "GRPO"
    metric_prefix = "rollout"
    stale_advice = ": the generator may hang"
    unscored_reward = 0.0  # a completion every reward function returned None for (`GRPOTrainer`'s nansum)

    def __init__(
        self,
        *,
        advantage_fn: Callable[[Sequence[float]], list[float]] | None = async_group_advantages,
        **worker_args: Any,
    ) -> None:
        super().__init__(**worker_args)
        self.advantage_fn = self.group_advantages if advantage_fn is None else advantage_fn
        self.last_groups: list[ScoredGroup] = []  # the groups of the last run (for inspection)

    # ------------------------------------------------------------------------------ one run
    def rollout(self, rows: Sequence[dict[str, Any]]) -> list[Any]:
        """``num_generations`` completions of each of ``rows``, scored, as `RolloutSample` s (one per completion
        with at least one token)."""
        version = self.model_version  # the version the completions are sampled from
        self.last_groups = self.sample_groups(rows)
        samples = []
        for group in self.last_groups:
            for index, completion in enumerate(group.completions):
                if not completion.token_ids:
                    continue
                samples.append(to_rollout_sample(group.training_sample(index, self.reward_func_names), version))
        return samples

    def sample_groups(self, rows: Sequence[dict[str, Any]]) -> list[ScoredGroup]:
        """One generator call for ``num_generations`` completions of each row (`finish_completions`), then each
        group scored."""
        if self.generator is None:
            raise RuntimeError(
                f"The {self.worker_name} rollout worker has no generator: pass generator= (or let the trainer set it)."
            )
        prompt_ids = [self.prompt_ids(row["prompt"]) for row in rows]
        size = len(rows) * self.num_generations
        completions = self.generator.generate([ids for ids in prompt_ids for _ in range(self.num_generations)])
        self._tick()
        if len(completions) != size:
            raise RuntimeError(f"The generator returned {len(completions)} completions for {size} prompts.")
        completions = self.finish_completions(completions)
        return [
            self.score_group(row, ids, completions[index * self.num_generations : (index + 1) * self.num_generations])
            for index, (row, ids) in enumerate(zip(rows, prompt_ids, strict=True))
        ]

    def finish_completions(self, completions: list[Completion]) -> list[Completion]:
        """The run's completions as they are scored and trained (a method may cut them); as sampled here."""
        return completions

    def prompt_ids(self, prompt: Any) -> list[int]:
        """The prompt's token ids through the chat template (a string is one user message), generation prompt added."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def score_group(self, row: dict[str, Any], prompt_ids: list[int], group: list[Completion]) -> ScoredGroup:
        """The group's rewards (`summed_rewards`; where every function returned None: `unscored_reward`) and
        advantages; takes a group id."""
        texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in group]
        per_func = self.call_rewards(row, texts, [list(c.token_ids) for c in group])
        rewards = self.summed_rewards(per_func, unscored=self.unscored_reward)
        group_id, self.groups = self.groups, self.groups + 1
        return ScoredGroup(
            row=row,
            prompt_ids=prompt_ids,
            completions=list(group),
            texts=texts,
            per_func=per_func,
            rewards=rewards,
            advantages=self.advantage_fn(rewards),
            reward_std=population_std(rewards),
            group_id=group_id,
        )
