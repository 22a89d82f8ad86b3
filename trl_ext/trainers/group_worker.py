"""`GroupRolloutWorker`: plain GRPO rollouts for TRL's asynchronous trainer from any `trl_ext.rlm.Generator`.

TRL's own rollout worker samples from ``vllm serve`` in a spawned process. This one is a thread of the trainer
process (`ThreadedRolloutWorker`) that samples from the generator it is given: `LocalPolicy` (no server) or the
served policy. One run, for ``groups_per_run`` prompts of the dataset (in order, cycling): ``num_generations``
completions each in one generator call; the reward functions called with TRL's keyword lists (the rewards of
several functions summed; None skipped); the group advantages (``advantage_fn``: TRL's asynchronous worker's by
default, `async_group_advantages`); one `RolloutSample` per completion. It is what `ExtAsyncGRPOTrainer` trains on when it is
given a ``generator=``, and the group scoring the judge-credit worker builds on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..rlm.generators import Completion
from .async_worker import ThreadedRolloutWorker, as_completions, group_metrics, reward_table, rollout_sample

__all__ = ["GroupRolloutWorker", "ScoredGroup", "async_group_advantages"]


def async_group_advantages(rewards: Sequence[float]) -> list[float]:
    """The group advantages of TRL's asynchronous rollout worker: ``(r − mean) / (std + 1e-8)``, population std.

    Args:
        rewards: ``(G,)`` one prompt's rewards (finite).

    Returns:
        ``(G,)`` advantages.
    """
    values = np.asarray(rewards, dtype=np.float64)
    if values.ndim != 1 or values.size == 0 or not np.isfinite(values).all():
        raise ValueError(f"rewards must be a non-empty sequence of finite numbers, got {list(rewards)}.")
    return [float(value) for value in (values - values.mean()) / (values.std() + 1e-8)]


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


class GroupRolloutWorker(ThreadedRolloutWorker):
    """GRPO rollouts for TRL's asynchronous trainer (``rollout_worker=``), in a thread of this process.

    Args:
        dataset: rows with a ``prompt`` (a string, or chat messages); every other column is passed to the reward
            functions as TRL does.
        reward_funcs: TRL reward functions (``prompts``, ``completions``, ``completion_ids`` and the dataset columns
            as keyword lists).
        tokenizer: the policy's tokenizer, with a chat template.
        generator: the policy's sampler (`trl_ext.rlm.Generator`; `LocalPolicy`, or the served policy); when it has
            ``update_model_version``, the worker forwards each new version to it.
        num_generations: completions per prompt (one group).
        groups_per_run: prompts sampled together (one generator call).
        advantage_fn: a group's ``(G,)`` rewards to its advantages (default `async_group_advantages`, TRL's
            asynchronous worker's; the method workers pass `group_advantages`, ``GRPOTrainer``'s).
        queue_maxsize: bound of ``rollout_buffer`` (0: unbounded).
        max_consecutive_errors: failed runs in a row that stop the worker.
        chat_template_kwargs: for ``apply_chat_template``.
    """

    worker_name = "GRPO"
    metric_prefix = "rollout"
    stale_advice = ": the generator may hang"

    def __init__(
        self,
        *,
        dataset: Any,
        reward_funcs: Sequence[Callable[..., Any]],
        tokenizer: Any,
        generator: Any = None,
        num_generations: int = 8,
        groups_per_run: int = 1,
        advantage_fn: Callable[[Sequence[float]], list[float]] = async_group_advantages,
        queue_maxsize: int = 0,
        max_consecutive_errors: int = 3,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self._init_worker(
            dataset=dataset,
            reward_funcs=reward_funcs,
            tokenizer=tokenizer,
            generator=generator,
            num_generations=num_generations,
            groups_per_run=groups_per_run,
            queue_maxsize=queue_maxsize,
            max_consecutive_errors=max_consecutive_errors,
        )
        self.advantage_fn = advantage_fn
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    # ------------------------------------------------------------------------------ one run
    def rollout(self, rows: Sequence[dict[str, Any]]) -> list[Any]:
        """``num_generations`` completions of each of ``rows``, scored, as `RolloutSample` s."""
        version = self.model_version  # the version the completions are sampled from
        samples = []
        for group in self.sample_groups(rows):
            for index, completion in enumerate(group.completions):
                samples.append(
                    rollout_sample(
                        group.prompt_ids,
                        completion.token_ids,
                        completion.logprobs,
                        advantage=group.advantages[index],
                        model_version=version,
                        group_id=group.group_id,
                        metrics=group.metrics(index, self.reward_func_names),
                        prompt=group.row["prompt"],
                        completion=group.texts[index],
                    )
                )
        return samples

    def sample_groups(self, rows: Sequence[dict[str, Any]]) -> list[ScoredGroup]:
        """One generator call for ``num_generations`` completions of each row, then each group scored."""
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
        return [
            self.score_group(row, ids, completions[index * self.num_generations : (index + 1) * self.num_generations])
            for index, (row, ids) in enumerate(zip(rows, prompt_ids, strict=True))
        ]

    def prompt_ids(self, prompt: Any) -> list[int]:
        """The prompt's token ids through the chat template (a string is one user message), generation prompt added."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def score_group(self, row: dict[str, Any], prompt_ids: list[int], group: list[Completion]) -> ScoredGroup:
        """The group's rewards (summed over the functions, None skipped: 0 where all are None, as ``GRPOTrainer``'s
        ``nansum``) and advantages; takes a group id."""
        texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in group]
        per_func = self.rewards(row, texts, [list(c.token_ids) for c in group])
        rewards = [math.fsum(v for v in values if not math.isnan(v)) for values in zip(*per_func, strict=True)]
        mean = sum(rewards) / len(rewards)
        reward_std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        group_id, self.groups = self.groups, self.groups + 1
        return ScoredGroup(
            row=row,
            prompt_ids=prompt_ids,
            completions=list(group),
            texts=texts,
            per_func=per_func,
            rewards=rewards,
            advantages=self.advantage_fn(rewards),
            reward_std=reward_std,
            group_id=group_id,
        )

    def rewards(self, row: dict[str, Any], texts: list[str], ids: list[list[int]]) -> list[list[float]]:
        """``(functions, G)`` rewards (None -> NaN); the prompt's columns passed as TRL does."""
        size = len(texts)
        columns = {key: [value] * size for key, value in row.items() if key != "prompt"}
        kwargs = dict(
            prompts=[row["prompt"]] * size,
            completions=as_completions(row["prompt"], texts),
            completion_ids=ids,
            **columns,
        )
        return reward_table(self.reward_funcs, self.reward_func_names, kwargs, size)
