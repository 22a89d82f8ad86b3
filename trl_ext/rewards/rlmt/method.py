"""RLMT's rollouts as one object both trainers use (docs/rlmt.md): `RLMT` renders the prompts as the policy reads
them and cuts every completion after its first stop string, and nothing of the training loop.

`RLMTTrainer` (on TRL's ``GRPOTrainer``) cuts TRL's completions with `RLMT.cut` in its ``postprocess_samples``; on
TRL's asynchronous trainer the rollout worker samples groups through `RLMT.prompt_ids` and
`RLMT.finish_completions` (the same cut) and trains one sample per completion with at least one token. What the
reward model sees (the original prompt and the response only) is the scorers' (`trl_ext.rewards.rlmt.scorers`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ...rlm.generators import Completion
from ...rollouts import GRPOGroups, RolloutRuntime
from .formats import cut_at_stop

__all__ = ["RLMT"]


class RLMT(GRPOGroups):
    """RLMT's prompts and stop-string cut (module docstring).

    Args:
        stop_strings: completions end after the first of these (cut, whatever the sampler did; empty ones ignored).

    Attributes:
        last_groups: the scored groups of the last asynchronous run (for inspection; `last_completions`).
    """

    name = "RLMT"
    metric_prefix = "rlmt"
    in_flight = "a generator call is still going"
    unscored_reward = math.nan  # no advantage (`scored_advantages`), as in TRL's asynchronous worker

    def __init__(self, stop_strings: Sequence[str] = ()) -> None:
        super().__init__(advantage_fn=None)  # GRPOTrainer's advantages under scale_rewards
        self.stop_strings = [stop for stop in stop_strings if stop]

    def cut(
        self, completion_ids: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]] | None, tokenizer: Any
    ) -> tuple[list[list[int]], list[list[float]] | None, int]:
        """Every completion cut after the token completing its first stop string (`cut_at_stop`), with its
        log-probs (None without); the third value counts the completions sampled past a stop string."""
        cuts = [
            cut_at_stop(ids, None if logprobs is None else logprobs[row], tokenizer, self.stop_strings)
            for row, ids in enumerate(completion_ids)
        ]
        kept_logprobs = None if logprobs is None else [row for _, row, _ in cuts]
        return [ids for ids, _, _ in cuts], kept_logprobs, sum(cut for _, _, cut in cuts)

    @property
    def last_completions(self) -> list[tuple[list[int], str, float]]:
        """``(completion ids, text, reward)`` of every completion of the last asynchronous run (for inspection)."""
        return [
            (list(completion.token_ids), text, reward)
            for group in self.last_groups
            for completion, text, reward in zip(group.completions, group.texts, group.rewards, strict=True)
        ]

    def prompt_ids(self, prompt: Any, runtime: RolloutRuntime) -> list[int]:
        """The policy's prompt ids: a conversation through the chat template (with the generation prompt), a plain
        string (the "zero" format, a base model's prefix prompt) tokenized as `GRPOTrainer` tokenizes text prompts."""
        if isinstance(prompt, str):
            return list(runtime.tokenizer(text=prompt)["input_ids"])
        return super().prompt_ids(prompt, runtime)

    def finish_completions(self, completions: list[Completion], runtime: RolloutRuntime) -> list[Completion]:
        """Every completion cut (`cut`); logs ``completions/mean_length`` and ``rlmt/stop_cut_ratio`` (the share of
        completions sampled past a stop string; with stop strings)."""
        ids, logprobs, cut = self.cut(
            [c.token_ids for c in completions], [c.logprobs for c in completions], runtime.tokenizer
        )
        metrics: dict[str, Any] = {"completions/mean_length": (float(sum(len(row) for row in ids)), float(len(ids)))}
        if self.stop_strings:
            metrics["rlmt/stop_cut_ratio"] = (float(cut), float(len(ids)))
        runtime.push_metrics(metrics)
        return [Completion(row_ids, row_logprobs) for row_ids, row_logprobs in zip(ids, logprobs, strict=True)]
