"""`TrainingSample`: one trained sequence, the record every trl-ext method's rollouts become, whatever the runtime
(as SkyRL's ``GeneratorOutput``): the prompt ids the sampler saw, the sampled completion with its log-probs, the
advantage it inherits, and what a method adds to the loss (a judge's per-token credit, a tree node's loss weight).

A method builds samples (`trl_ext.rlm.method.StepwiseRLM.training_samples`: one per trained turn of a tree; the
judge-credit and plain GRPO workers: one per completion), and each runtime converts them in one place:

- TRL's asynchronous trainer: `trl_ext.trainers.async_seam.to_rollout_sample` (TRL's ``RolloutSample``, the credit
  and weights in its ``metrics``, which trl-ext's collators turn into per-token advantages and loss weights);
- TRL's synchronous trainer: `padded_rows` (the padded ``prompt_ids``/``completion_ids`` tensors and their masks, as
  `GRPOTrainer` builds its batch), where a method replaces TRL's rows (stepwise RLM).

The synchronous batch those rows join is `ScoredBatch`, what `ExtGRPOTrainer.process_scored_batch` receives and
returns, with its pure functions of the batch and of row counts: `check_scored_batch` (the invariants TRL's shuffle
and split rely on), `padding_rows` (how many rows to add so that every rank holds the same multiple of the
micro-batch count), `pad_batch` (adds them as zero-loss copies of real rows) and `loss_mask`.

Pure: imports torch only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
from torch.nn.utils.rnn import pad_sequence

__all__ = [
    "ZEROED_ON_PADDING",
    "ScoredBatch",
    "TrainingSample",
    "check_scored_batch",
    "loss_mask",
    "pad_batch",
    "padded_rows",
    "padding_rows",
]


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


# ---------------------------------------------------------------------------------- the synchronous batch
class ScoredBatch(TypedDict, total=False):
    """This rank's scored generation batch of B rows (T completion tokens, P prompt tokens), as a dict.

    TRL builds it (rewards and group advantages are final, computed over all ranks); `process_scored_batch` may
    change it and return any number N of rows, where every value is an N-row tensor, a 0-dim tensor, a length-N list
    or None. Rows are then padded (zero loss) so that N is a multiple of ``steps_per_generation`` and equal on every
    rank, and ``num_items_in_batch`` is recomputed. Log-prob tensors must describe the rows they go with: recompute
    them when a row's prompt is not a token-exact prefix of the old one.

    Image fields come per row, as TRL's ``split_pixel_values_by_grid`` gives them: ``pixel_values`` (and
    ``image_grid_thw``, ``image_sizes``, ... where the model's layout is flat over images) is a length-B list of each
    row's tensor, ``num_images`` a length-B list; they are joined back after the padding, as TRL keeps them.
    """

    prompt_ids: torch.Tensor  # (B, P) left-padded (the first value: TRL reads the row count from it)
    prompt_mask: torch.Tensor  # (B, P)
    completion_ids: torch.Tensor  # (B, T) right-padded
    completion_mask: torch.Tensor  # (B, T)
    # (B,) group advantages, or (B, T) per-token ones aligned with completion_ids
    advantages: torch.Tensor
    # (B, T) >= 0, optional: multiplies each token's policy loss (folded into the advantages for TRL's loss types,
    # exact for their policy term, which is linear in the advantage; trl-ext's registered losses such as "ipo"
    # weight each token's whole loss, their tau penalty included; the beta*KL term stays unweighted)
    loss_weights: torch.Tensor
    rewards: torch.Tensor  # (B,) this rank's weighted total reward (added by trl-ext; NaN where unscorable)
    num_items_in_batch: torch.Tensor  # 0-dim: loss tokens over all ranks (recomputed after the hook)
    old_per_token_logps: torch.Tensor  # (B, T), optional
    ref_per_token_logps: torch.Tensor  # (B, T), optional
    sampling_per_token_logps: torch.Tensor  # (B, T), optional: the sampler's (vLLM's) log-probs
    importance_sampling_ratio: torch.Tensor  # (B, T) or (B, 1), optional
    tool_mask: torch.Tensor  # (B, T), optional: 0 on tool-output tokens (not trained)
    prefix_group: torch.Tensor  # (B,) integer: rows of one group share a prompt prefix (shared-prefix packing)
    is_padding_row: torch.Tensor  # (B,) bool: set by the padding


# Per-row values that must be zero on a padding row so that it carries no loss and no advantage.
ZEROED_ON_PADDING = ("completion_mask", "advantages", "loss_weights", "rewards")


def _is_shared(value: Any) -> bool:
    """A batch value that is not per row: None or a 0-dim tensor."""
    return value is None or (isinstance(value, torch.Tensor) and value.dim() == 0)


def check_scored_batch(batch: dict[str, Any]) -> int:
    """Check the invariants TRL's shuffle and split rely on (see `ScoredBatch`); return the row count N."""
    missing = [key for key in ("prompt_ids", "completion_ids", "advantages") if key not in batch]
    if missing:
        raise ValueError(
            f"The batch must keep {missing} (TRL's loss reads 'prompt_ids', 'completion_ids' and 'advantages')."
        )
    first_key, first = next((key, value) for key, value in batch.items() if value is not None)
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise ValueError(
            f"The first batch value that is not None ({first_key!r}) is not a row-indexed tensor; TRL reads the row "
            "count from it: put a row-indexed tensor (e.g. 'prompt_ids') first."
        )
    num_rows = batch["prompt_ids"].shape[0]
    for key, value in batch.items():
        if not _is_shared(value) and len(value) != num_rows:
            raise ValueError(
                f"batch[{key!r}] has {len(value)} rows but 'prompt_ids' has {num_rows}: every value must be an "
                "N-row tensor, a 0-dim tensor, a length-N list or None."
            )
    completion_shape = batch["completion_ids"].shape
    advantages = batch["advantages"]
    if advantages.shape not in ((num_rows,), completion_shape):
        raise ValueError(
            f"advantages must be (N,) or (N, T) = {tuple(completion_shape)} (aligned with completion_ids); got "
            f"{tuple(advantages.shape)}."
        )
    weights = batch.get("loss_weights")
    if weights is not None:
        if weights.shape != completion_shape:
            raise ValueError(
                f"loss_weights must be (N, T) = {tuple(completion_shape)} like completion_ids; got "
                f"{tuple(weights.shape)}."
            )
        if not torch.isfinite(weights).all() or (weights < 0).any():
            raise ValueError("loss_weights must be finite and >= 0 (a weight multiplies a token's policy loss).")
    return num_rows


def padding_rows(num_rows: int, max_rows: int, num_micro_batches: int) -> int:
    """How many rows a rank holding ``num_rows`` adds so that every rank holds the same multiple of
    ``num_micro_batches`` (TRL splits the batch into that many equal micro-batches and would drop the rest).

    Args:
        num_rows: this rank's rows.
        max_rows: the most rows any rank holds.
        num_micro_batches: ``steps_per_generation`` in training, 1 in evaluation.
    """
    target = -(-max_rows // num_micro_batches) * num_micro_batches  # max_rows rounded up to a multiple
    if target > num_rows and num_rows == 0:
        raise ValueError(
            "process_scored_batch returned 0 rows on this rank: return at least one row (rows are padded by copying "
            "real rows with their loss masked)."
        )
    return target - num_rows


def pad_batch(batch: dict[str, Any], num_rows: int, num_padding: int) -> dict[str, Any]:
    """Append ``num_padding`` copies of the ``num_rows`` real rows (cyclically) with their loss masked out.

    Copies of real rows, not blank rows: a row whose attention mask is all zeros gives NaN log-probs, and
    NaN × 0 is NaN in the loss sum. The values of `ZEROED_ON_PADDING` are zero on the copies.
    """
    source = torch.arange(num_padding) % num_rows
    padded: dict[str, Any] = {}
    for key, value in batch.items():
        if _is_shared(value):
            padded[key] = value
        elif isinstance(value, torch.Tensor):
            extra = value[source.to(value.device)].clone()
            if key in ZEROED_ON_PADDING:
                extra.zero_()
            padded[key] = torch.cat([value, extra])
        else:
            padded[key] = list(value) + [value[i] for i in source.tolist()]
    return padded


def loss_mask(batch: dict[str, Any]) -> torch.Tensor:
    """``(B, T)`` the tokens the loss counts: ``completion_mask``, times ``tool_mask`` where there is one."""
    mask = batch["completion_mask"]
    return mask if batch.get("tool_mask") is None else mask * batch["tool_mask"]
