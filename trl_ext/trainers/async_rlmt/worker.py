"""`RLMTRolloutWorker`: TRL's ``RolloutWorkerProtocol`` producing RLMT samples (docs/rlmt.md, docs/async.md).

The group pipeline of `GroupRolloutWorker` (a thread of the trainer process; ``groups_per_run`` prompts of the
dataset at a time, in order, cycling), with what RLMT changes:

1. the prompt is rendered as `GRPOTrainer` does: a conversation ("instruct") through the policy's chat template, a
   plain string ("zero", a base model's prefix prompt) as text;
2. the ``num_generations`` completions (one generator call: ``vllm serve`` with the stop strings as the sampling
   ``stop``, `ServedPolicyGenerator`) are cut after the token completing their first stop string
   (`trl_ext.rewards.rlmt.cut_at_stop`): a sampler may run past it, and what follows is neither scored nor trained;
3. the reward functions are TRL's (an RLMT scorer gives the reward model the original prompt and the response only);
   a completion no function could score gets no advantage (`trl_ext.advantages.scored_advantages`);
4. one `RolloutSample` per completion with at least one token.

Every sample of a run is tagged with the policy version live when its generator call was made. A failing run (the
generator, a reward function) is logged, counted in ``rlmt/worker_errors_total`` and retried with the next prompts;
``max_consecutive_errors`` failures in a row stop the thread, and `check_health` (called by the trainer while it waits
for samples) raises with the cause.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ...rewards.rlmt import cut_at_stop
from ...rlm.generators import Completion
from ..group_worker import GroupRolloutWorker

__all__ = ["RLMTRolloutWorker"]


class RLMTRolloutWorker(GroupRolloutWorker):
    """RLMT rollouts for TRL's asynchronous trainer (``rollout_worker=``), in a thread of this process.

    Args:
        stop_strings: completions end after the first of these (cut here too, whatever the sampler did).
        worker_args: those of `ThreadedRolloutWorker`: ``dataset`` (rows with a ``prompt`` already in the RLMT
            format, `trl_ext.rewards.rlmt.rlmt_format_dataset`), ``reward_funcs`` (sync or async: ``async def``, e.g.
            `ServedRewardModelScorer`), ``tokenizer``, ``generator``, ``num_generations``, ``scale_rewards``, ...

    Attributes:
        rollout_buffer, metrics_queue: what TRL's trainer drains (``RolloutWorkerProtocol``).
        model_version: the version last published by the trainer.
        errors: failed runs so far; groups: groups scored so far; last_groups: the scored groups of the last run.
    """

    worker_name = "RLMT"
    metric_prefix = "rlmt"
    in_flight = "a generator call is still going"
    unscored_reward = math.nan  # no advantage (`scored_advantages`), as in TRL's asynchronous worker

    def __init__(self, *, stop_strings: Sequence[str] = (), **worker_args: Any) -> None:
        super().__init__(advantage_fn=None, **worker_args)
        self.stop_strings = [stop for stop in stop_strings if stop]

    @property
    def last_completions(self) -> list[tuple[list[int], str, float]]:
        """``(completion ids, text, reward)`` of every completion of the last run (for inspection)."""
        return [
            (list(completion.token_ids), text, reward)
            for group in self.last_groups
            for completion, text, reward in zip(group.completions, group.texts, group.rewards, strict=True)
        ]

    def prompt_ids(self, prompt: Any) -> list[int]:
        """The policy's prompt ids: a conversation through the chat template (with the generation prompt), a plain
        string (the "zero" format) tokenized as `GRPOTrainer` tokenizes text prompts."""
        if isinstance(prompt, str):
            return list(self.tokenizer(text=prompt)["input_ids"])
        return super().prompt_ids(prompt)

    def finish_completions(self, completions: list[Completion]) -> list[Completion]:
        """Every completion cut after its first stop string; logs ``completions/mean_length`` and
        ``rlmt/stop_cut_ratio`` (the share of completions sampled past a stop string)."""
        cuts = [cut_at_stop(c.token_ids, c.logprobs, self.tokenizer, self.stop_strings) for c in completions]
        metrics: dict[str, Any] = {
            "completions/mean_length": (float(sum(len(ids) for ids, _, _ in cuts)), float(len(cuts)))
        }
        if self.stop_strings:
            metrics["rlmt/stop_cut_ratio"] = (float(sum(cut for _, _, cut in cuts)), float(len(cuts)))
        self._push_metrics(metrics)
        return [Completion(ids, logprobs) for ids, logprobs, _ in cuts]
