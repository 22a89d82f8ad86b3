"""`TrainingSample`: one trained sequence, the record every trl-ext method's rollouts become, whatever the runtime
(as SkyRL's ``GeneratorOutput``): the prompt ids the sampler saw, the sampled completion with its log-probs, the
advantage it inherits, and what a method adds to the loss (a judge's per-token credit, a tree node's loss weight).

A method builds samples (`trl_ext.rlm.method.StepwiseRLM.training_samples`: one per trained turn of a tree; the
judge-credit and plain GRPO workers: one per completion), and each runtime converts them in one place:

- TRL's asynchronous trainer: `trl_ext.trainers.async_seam.to_rollout_sample` (TRL's ``RolloutSample``, the credit
  and weights in its ``metrics``, which trl-ext's collators turn into per-token advantages and loss weights);
- TRL's synchronous trainer: `padded_rows` (the padded ``prompt_ids``/``completion_ids`` tensors and their masks, as
  `GRPOTrainer` builds its batch), where a method replaces TRL's rows (stepwise RLM).

Pure: imports torch only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

__all__ = ["TrainingSample", "padded_rows"]


@dataclass
class TrainingSample:
    """One trained sequence: ``P`` prompt tokens (not trained, ``P >= 1``) and ``C`` completion tokens (trained).

    Attributes:
        prompt_ids: ``(P,)`` the exact ids the sampler was given.
        completion_ids: ``(C,)`` the sampled ids.
        logprobs: ``(C,)`` the sampler's log-prob of each (p_old of the asynchronous trainer and of the IPO loss).
        advantage: the outcome advantage every completion token inherits.
        group_id: the samples that share a prompt (a GRPO group; a tree's turns), packed together.
        token_credit: ``(C,)`` per-token credit added to the advantage (judge credit ``cap_λ(c)``), or None.
        node_weight, node_tokens: under stepwise RLM's "subtree" normalisation, ``W(v)`` of the sample's tree node
            and ``n_v``, the action tokens of all its trained turns (each token weighs ``W(v)/n_v``); None otherwise.
        root_share: the sample's share of its root rollout, ``W(v)/n_v · C / Σ_u W(u)`` (a tree's samples sum to 1).
        metrics: logged with the sample (``reward``, ``rewards/<name>``, ...).
        prompt, completion: what the traces show (the task, the answer).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    advantage: float
    group_id: int = 0
    token_credit: list[float] | None = None
    node_weight: float | None = None
    node_tokens: int | None = None
    root_share: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    prompt: Any = None
    completion: Any = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("A training sample needs its prompt ids: a token is trained from the one before it.")
        num = len(self.completion_ids)
        if len(self.logprobs) != num:
            raise ValueError(
                f"{num} completion tokens but {len(self.logprobs)} log-probs: the sampler must return one log-prob "
                "per sampled token."
            )
        if self.token_credit is not None and len(self.token_credit) != num:
            raise ValueError(
                f"{num} completion tokens but {len(self.token_credit)} credit values: give one per token."
            )
        if self.token_credit is not None and not all(math.isfinite(value) for value in self.token_credit):
            raise ValueError("token credit must be finite numbers.")
        if (self.node_weight is None) != (self.node_tokens is None):
            raise ValueError("node_weight and node_tokens go together (the 'subtree' loss weight W(v)/n_v).")
        if self.node_tokens is not None and self.node_tokens <= 0:
            raise ValueError(f"node_tokens must be > 0 (the node's trained action tokens), got {self.node_tokens}.")

    @property
    def token_weight(self) -> float | None:
        """``W(v)/n_v``, each completion token's loss weight under the "subtree" normalisation (None without)."""
        return None if self.node_weight is None else self.node_weight / self.node_tokens


def padded_rows(samples: Sequence[TrainingSample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """The samples as `GRPOTrainer`'s padded rows, ``N`` = len(samples).

    Returns:
        ``prompt_ids``, ``prompt_mask`` ``(N, P_max)`` (left-padded), ``completion_ids``, ``completion_mask``
        ``(N, C_max)`` (right-padded), ``sampling_per_token_logps`` ``(N, C_max)`` float32 (0 at padding), on the CPU.
    """
    if not samples:
        raise ValueError("No training sample to pad: a batch needs at least one.")

    def stack(values: list[torch.Tensor], padding_value: float, side: str = "right") -> torch.Tensor:
        return pad_sequence(values, batch_first=True, padding_value=padding_value, padding_side=side)

    prompts = [torch.tensor(sample.prompt_ids, dtype=torch.long) for sample in samples]
    completions = [torch.tensor(sample.completion_ids, dtype=torch.long) for sample in samples]
    return {
        "prompt_ids": stack(prompts, pad_token_id, "left"),
        "prompt_mask": stack([torch.ones_like(ids) for ids in prompts], 0, "left"),
        "completion_ids": stack(completions, pad_token_id),
        "completion_mask": stack([torch.ones_like(ids) for ids in completions], 0),
        "sampling_per_token_logps": stack(
            [torch.tensor(sample.logprobs, dtype=torch.float32) for sample in samples], 0.0
        ),
    }
