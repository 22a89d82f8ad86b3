"""`RLMTRolloutWorker`: TRL's ``RolloutWorkerProtocol`` producing RLMT samples (docs/rlmt.md, docs/async.md).

A background thread of the trainer process takes the dataset's prompts in order (cycling), ``groups_per_run`` at a
time, and for each:

1. renders the prompt: a conversation ("instruct") through the policy's chat template, a plain string ("zero",
   a base model's prefix prompt) as text, as `GRPOTrainer` does;
2. samples ``num_generations`` completions in one generator call (``vllm serve`` with the stop strings as the
   sampling ``stop``: `ServedPolicyGenerator`);
3. cuts every completion after the token completing its first stop string (`cut_at_stop`): a sampler may run past
   it, and what follows is neither scored nor trained;
4. scores the completions with the reward functions (TRL's interface: ``prompts``, ``completions`` (conversational
   for a conversational prompt), ``completion_ids``, every dataset column such as ``rlmt_original_prompt``, and
   ``log_metric``); an RLMT scorer gives the reward model the original prompt and the response only;
5. pushes one `RolloutSample` per completion (`completion_sample`), with the group advantage (`scored_advantages`).

Every sample of a run is tagged with the policy version live when its generator call was made. A failing run (the
generator, a reward function) is logged, counted in ``rlmt/worker_errors_total`` and retried with the next prompts;
``max_consecutive_errors`` failures in a row stop the thread, and `check_health` (called by the trainer while it waits
for samples) raises with the cause.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...rlm.generators import Generator
from ..async_worker import ThreadedRolloutWorker, as_completions, group_metrics, reward_table
from .samples import completion_sample, cut_at_stop, scored_advantages

logger = logging.getLogger(__name__)

__all__ = ["RLMTRolloutWorker"]

# Dataset columns not passed to the reward functions (TRL's rule): the worker passes its own values under these names.
_RESERVED_COLUMNS = ("prompt", "completion", "completion_ids")


class RLMTRolloutWorker(ThreadedRolloutWorker):
    """RLMT rollouts for TRL's asynchronous trainer (``rollout_worker=``), in a thread of this process.

    Args:
        dataset: rows with a ``prompt`` already in the RLMT format (`trl_ext.rewards.rlmt.rlmt_format_dataset`); every
            other column is passed to the reward functions.
        reward_funcs: TRL reward functions, sync or async (``async def``: e.g. `ServedRewardModelScorer`); the
            rewards of several functions are summed, None counting as missing.
        tokenizer: the policy's tokenizer (a chat template for conversational prompts).
        generator: the policy's sampler (`trl_ext.rlm.Generator`: token-id prompts in, ids and log-probs out); when
            it has ``update_model_version`` (`ServedPolicyGenerator`), each new version is forwarded to it.
        num_generations: completions per prompt (one group).
        groups_per_run: prompts sampled in one generator call.
        stop_strings: completions end after the first of these (cut here too, whatever the sampler did).
        scale_rewards: ``"group"`` or ``"none"`` (`scored_advantages`).
        queue_maxsize: bound of ``rollout_buffer`` (0: unbounded).
        max_consecutive_errors: failed runs in a row that stop the worker.
        chat_template_kwargs: for ``apply_chat_template``.

    Attributes:
        rollout_buffer, metrics_queue: what TRL's trainer drains (``RolloutWorkerProtocol``).
        model_version: the version last published by the trainer.
        errors: failed runs so far; groups: groups scored so far.
        last_completions: ``(completion ids, text, reward)`` of every completion of the last run (for inspection).
    """

    worker_name = "RLMT"
    metric_prefix = "rlmt"
    in_flight = "a generator call is still going"

    def __init__(
        self,
        *,
        dataset: Any,
        reward_funcs: Sequence[Callable[..., Any]],
        tokenizer: Any,
        generator: Generator | None,
        num_generations: int,
        groups_per_run: int = 1,
        stop_strings: Sequence[str] = (),
        scale_rewards: str = "group",
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
        self.stop_strings = [stop for stop in stop_strings if stop]
        self.scale_rewards = scale_rewards
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.last_completions: list[tuple[list[int], str, float]] = []
        self._event_loop: asyncio.AbstractEventLoop | None = None  # for async reward functions, one per worker

    def _before_start(self) -> None:
        if self.generator is None:
            raise RuntimeError("The RLMT rollout worker has no generator: give it one before training starts.")

    def _on_thread_exit(self) -> None:
        """Close the event loop of the async reward functions (it belongs to the thread)."""
        if self._event_loop is not None:
            self._event_loop.close()
            self._event_loop = None

    # ------------------------------------------------------------------------------ one run
    def prompt_ids(self, prompt: Any) -> list[int]:
        """The policy's prompt ids: a conversation through the chat template (with the generation prompt), a plain
        string (the "zero" format) tokenized as `GRPOTrainer` tokenizes text prompts."""
        if isinstance(prompt, str):
            return list(self.tokenizer(text=prompt)["input_ids"])
        text = self.tokenizer.apply_chat_template(
            list(prompt), tokenize=False, add_generation_prompt=True, **self.chat_template_kwargs
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def rollout(self, rows: Sequence[dict[str, Any]]) -> list[Any]:
        """Sample, cut, score and turn into samples ``num_generations`` completions of each of ``rows``."""
        version = self.model_version
        prompts = [self.prompt_ids(row["prompt"]) for row in rows]
        requests = [ids for ids in prompts for _ in range(self.num_generations)]
        completions = self.generator.generate(requests)
        self._tick()
        if len(completions) != len(requests):
            raise RuntimeError(f"The generator returned {len(completions)} completions for {len(requests)} prompts.")
        cuts = [cut_at_stop(c.token_ids, c.logprobs, self.tokenizer, self.stop_strings) for c in completions]
        samples: list[Any] = []
        self.last_completions = []
        for index, (row, prompt_ids) in enumerate(zip(rows, prompts, strict=True)):
            group = cuts[index * self.num_generations : (index + 1) * self.num_generations]
            samples += self._group_samples(row, prompt_ids, group, version)
        run_metrics: dict[str, Any] = {
            "completions/mean_length": (float(sum(len(ids) for ids, _, _ in cuts)), float(len(cuts)))
        }
        if self.stop_strings:
            run_metrics["rlmt/stop_cut_ratio"] = (float(sum(cut for _, _, cut in cuts)), float(len(cuts)))
        self._push_metrics(run_metrics)
        return samples

    def _group_samples(
        self,
        row: dict[str, Any],
        prompt_ids: list[int],
        group: list[tuple[list[int], list[float], bool]],
        version: int,
    ) -> list[Any]:
        completion_ids = [ids for ids, _, _ in group]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        completions = as_completions(row["prompt"], texts)
        per_func = self._rewards(row, completions, completion_ids)
        table = np.asarray(per_func, dtype=np.float64)  # (functions, G)
        unscored = np.isnan(table).all(axis=0)
        rewards = np.where(unscored, np.nan, np.nansum(table, axis=0))
        advantages = scored_advantages(rewards.tolist(), self.scale_rewards)
        reward_std = float(np.nanstd(rewards)) if not unscored.all() else float("nan")
        group_id, self.groups = self.groups, self.groups + 1
        samples = []
        for index, ((ids, logprobs, _), completion) in enumerate(zip(group, completions, strict=True)):
            self.last_completions.append((ids, texts[index], float(rewards[index])))
            if not ids:
                continue
            metrics = group_metrics(index, float(rewards[index]), reward_std, self.reward_func_names, per_func)
            samples.append(
                completion_sample(
                    prompt_ids,
                    ids,
                    logprobs,
                    advantage=advantages[index],
                    model_version=version,
                    group_id=group_id,
                    metrics=metrics,
                    prompt=row["prompt"],
                    completion=completion,
                )
            )
        return samples

    def _rewards(
        self, row: dict[str, Any], completions: list[Any], completion_ids: list[list[int]]
    ) -> list[list[float]]:
        """``(functions, G)`` rewards (None -> NaN); the prompt's columns passed as TRL does, plus ``log_metric``."""
        size = len(completions)
        columns = {key: [value] * size for key, value in row.items() if key not in _RESERVED_COLUMNS}
        kwargs = dict(
            prompts=[row["prompt"]] * size,
            completions=completions,
            completion_ids=completion_ids,
            log_metric=self._reward_metric,
            **columns,
        )
        return reward_table(self.reward_funcs, self.reward_func_names, kwargs, size, resolve=self._resolve)

    def _resolve(self, values: Any) -> Any:
        """An async reward function's rewards, awaited on the worker's own event loop."""
        if not inspect.isawaitable(values):
            return values
        if self._event_loop is None:
            self._event_loop = asyncio.new_event_loop()
        return self._event_loop.run_until_complete(values)

    def _reward_metric(self, name: str, value: float) -> None:
        """A reward function's metric (TRL's ``log_metric``): logged as the mean over the logging window."""
        self._push_metrics({name: float(value)})
