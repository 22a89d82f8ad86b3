"""Shared-prefix packing: rows that share a prefix are encoded once, as a tree in one packed sequence (docs/packing.md).

Causal attention makes this exact: the keys and values of a prefix do not depend on what follows it. A packed row
lays out a trunk once and the rest of each row as a *branch* after it; every token attends to the tokens on its own
row's path (its branch causally, and the trunk up to the branch point), and its position id is its depth on that
path. The G completions of a GRPO prompt become G branches of one prompt; the turns of a stepwise RLM node become
branches of the node's history.

The layout is pure (lists of token ids in, index tensors out); `packed_logps_and_entropies` runs a model on it
through TRL's fused LM head and returns the same ``(B, T)`` per-token tensors as unpacked rows. The policy of when
a log-prob pass is packed is pure too (`packing_obstacle`, `worth_packing`), and so is the re-split of a generation
batch that keeps each prefix group in one micro-batch (`group_micro_batches`, with a generator of its own).

Layout of a packed row of length L:

- ``input_ids``/``position_ids`` ``(L,)``: tokens and their depth on their path;
- ``labels`` ``(L,)``: the token each position predicts where a row scores it, else -100 (a position predicts at
  most one token: where rows diverge right after a scored position, the diverging row repeats that token in its own
  branch, with the same position id and the same visible context, hence the same output);
- ``segment_ids`` ``(L,)`` and ``visible_end`` ``(S, S)``: token ``kv`` is visible to token ``q`` iff
  ``kv <= q`` and ``kv < visible_end[segment(q), segment(kv)]`` (a segment is a run of tokens laid out together;
  ``visible_end`` is the end of the part of an ancestor segment on the path, a large value for the segment itself
  and -1 for the rest).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from .attention import base_attention, use_tree_attention

__all__ = [
    "MAX_PACKED_TOKEN_RATIO",
    "MIN_SAVED_TOKENS",
    "PACKABLE_ATTENTION",
    "Packing",
    "PackedRow",
    "PackedBatch",
    "TreeSequence",
    "VARLEN_ATTENTION",
    "group_micro_batches",
    "pack_rows",
    "packed_logps_and_entropies",
    "packing_obstacle",
    "rows_from_padded",
    "tree_mask",
    "worth_packing",
]

_SELF = np.iinfo(np.int32).max  # visible_end of a segment for itself: limited by causality only

# Attention implementations that take the packed rows' tree mask (flash attention takes no custom mask).
PACKABLE_ATTENTION = ("sdpa", "eager", "flex_attention")
# On the CPU, SDPA runs packed rows as one sequence through `trl_ext.attention.tree_attention` (`TreeSequence`): each
# segment attends to its own path, no L x L mask is built. On a GPU, SDPA and eager get the dense mask (FlexAttention,
# its block mask: the implementation to use there), and so does eager on the CPU.
VARLEN_ATTENTION = ("sdpa",)
# "auto" packs a log-prob pass only when it processes at most this fraction of the padded rows' tokens and saves at
# least this many tokens (below that, laying out and masking cost more than the forward saves).
MAX_PACKED_TOKEN_RATIO = 0.8
MIN_SAVED_TOKENS = 1024


def packing_obstacle(*, multimodal: bool, router_loss: bool, sharded: bool, attention: str | None) -> str | None:
    """Why a log-prob pass cannot be packed (a sentence for the log), or None when it can.

    Args:
        multimodal: the pass has image or per-token processor inputs (not indexed by packed position).
        router_loss: the pass computes an MoE router loss (it counts every token, padding included).
        sharded: FSDP or DeepSpeed (every rank must run the same number of forwards).
        attention: the model's attention implementation.
    """
    if multimodal:
        return "the batch has multimodal inputs"
    if router_loss:
        return "the MoE router loss counts every token"
    if sharded:
        return "FSDP and DeepSpeed ranks would run different numbers of forwards"
    if base_attention(attention) not in PACKABLE_ATTENTION:
        return f"attention implementation {attention!r} takes no custom mask (use one of {list(PACKABLE_ATTENTION)})"
    return None


def worth_packing(mode: str, padded_tokens: int, packed_tokens: int) -> bool:
    """Whether ``prefix_sharing=mode`` packs a pass of ``padded_tokens`` (B × (P + T)) laid out in ``packed_tokens``:
    ``"on"`` always, ``"auto"`` when that is at most `MAX_PACKED_TOKEN_RATIO` of the padded tokens and saves at
    least `MIN_SAVED_TOKENS`, ``"off"`` never."""
    if mode == "auto":
        saved = padded_tokens - packed_tokens
        return packed_tokens / padded_tokens <= MAX_PACKED_TOKEN_RATIO and saved >= MIN_SAVED_TOKENS
    return mode == "on"


@dataclass
class PackedRow:
    """One packed sequence (see the module docstring for the layout)."""

    input_ids: torch.Tensor  # (L,)
    position_ids: torch.Tensor  # (L,)
    labels: torch.Tensor  # (L,), -100 where nothing is scored
    segment_ids: torch.Tensor  # (L,)
    visible_end: torch.Tensor  # (S, S)
    rows: list[int]  # the batch rows packed here
    scored: list[torch.Tensor]  # per packed batch row: the packed positions predicting its completion tokens

    def __len__(self) -> int:
        return self.input_ids.numel()


@dataclass
class Packing:
    """A batch of ``num_rows`` rows laid out in packed rows.

    Attributes:
        packed: the packed rows.
        num_rows: B, the batch rows.
        completion_length: T, the width of the ``(B, T)`` per-token tensors.
        real_tokens: tokens of the rows unpacked (prompt + completion, padding excluded).
    """

    packed: list[PackedRow]
    num_rows: int
    completion_length: int
    real_tokens: int = 0

    @property
    def packed_tokens(self) -> int:
        """Tokens the model processes packed."""
        return sum(len(row) for row in self.packed)

    def unpack(self, per_position: list[torch.Tensor]) -> torch.Tensor:
        """``(B, T)`` tensor of per-token values from one ``(L,)`` tensor per packed row (0 beyond a completion)."""
        first = per_position[0]
        out = first.new_zeros((self.num_rows, self.completion_length))
        rows, cols, values = [], [], []
        for packed, values_of_row in zip(self.packed, per_position):
            for row, positions in zip(packed.rows, packed.scored):
                rows.append(torch.full((positions.numel(),), row, dtype=torch.long))
                cols.append(torch.arange(positions.numel()))
                values.append(values_of_row[positions.to(values_of_row.device)])
        if not values:
            return out
        index = (torch.cat(rows).to(out.device), torch.cat(cols).to(out.device))
        # index_put (not in-place on a leaf): keeps the autograd graph of every value
        return out.index_put(index, torch.cat(values))


def rows_from_padded(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int
) -> tuple[list[list[int]], list[int]] | None:
    """Each row's real tokens and prompt length from TRL's padded rows; None when the padding is not TRL's.

    Args:
        input_ids: ``(B, P + T)``: left-padded prompts, then right-padded completions.
        attention_mask: ``(B, P + T)``: 1 on real tokens.
        logits_to_keep: T, the completion width.

    Returns:
        ``(sequences, prompt_lengths)``: per row, its prompt tokens followed by its completion tokens, and the number
        of prompt tokens; None if a prompt mask is not left-aligned ones, a completion mask is not a prefix of ones,
        or a row has no prompt token (nothing would predict its first completion token).
    """
    mask = attention_mask.detach().to("cpu", torch.bool).numpy()
    ids = input_ids.detach().to("cpu").numpy()
    width = ids.shape[1] - logits_to_keep
    sequences, prompt_lengths = [], []
    for row_ids, row_mask in zip(ids, mask):
        prompt_mask, completion_mask = row_mask[:width], row_mask[width:]
        prompt_length, completion_length = int(prompt_mask.sum()), int(completion_mask.sum())
        if prompt_length == 0:
            return None
        if not prompt_mask[width - prompt_length :].all() or not completion_mask[:completion_length].all():
            return None
        sequences.append(row_ids[width - prompt_length : width + completion_length].tolist())
        prompt_lengths.append(prompt_length)
    return sequences, prompt_lengths


class _Bin:
    """The packed row being built: a token tree laid out in insertion order (ancestors before descendants)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.positions: list[int] = []
        self.labels: list[int] = []
        self.segments: list[int] = []
        self.segment_start: list[int] = []
        self.segment_parent: list[int] = []  # -1 for a root segment
        self.segment_visible: list[int] = []  # the tokens of the parent segment on the path (from its start)
        self.sequences: list[np.ndarray] = []  # of the rows placed here
        self.paths: list[np.ndarray] = []  # per placed row: the packed position of each of its tokens
        self.rows: list[int] = []
        self.scored: list[np.ndarray] = []

    def branch_point(self, sequence: np.ndarray, prompt_length: int) -> tuple[int, int]:
        """``(placed, shared)``: the placed row this row branches from (-1: none) and how many of its first tokens
        it reuses from that row's path."""
        best, best_shared = -1, 0
        for index, placed in enumerate(self.sequences):
            shared = _common_prefix(placed, sequence)
            if shared > best_shared:
                best, best_shared = index, shared
        if best < 0:
            return -1, 0
        return best, self._usable_prefix(best, best_shared, sequence, prompt_length)

    def _usable_prefix(self, placed: int, shared: int, sequence: np.ndarray, prompt_length: int) -> int:
        """How much of ``shared`` this row can reuse: up to the first position it scores whose label another row
        already set to a different token (the row then repeats that token in its own branch)."""
        first, last = max(prompt_length - 1, 0), min(shared, len(sequence) - 1)  # scored depths in the shared part
        if first >= last:
            return shared
        existing = np.array([self.labels[p] for p in self.paths[placed][first:last].tolist()], dtype=np.int64)
        conflict = np.nonzero((existing != -100) & (existing != sequence[first + 1 : last + 1]))[0]
        return first + int(conflict[0]) if conflict.size else shared

    def add(self, row: int, sequence: np.ndarray, prompt_length: int, placed: int, shared: int) -> None:
        """Place a row that reuses the first ``shared`` tokens of placed row ``placed``'s path (see `branch_point`)."""
        path = np.empty(len(sequence), dtype=np.int64)
        path[:shared] = self.paths[placed][:shared] if shared else []
        if shared < len(sequence):
            segment = len(self.segment_start)
            start = len(self.tokens)
            if shared:
                attach = int(path[shared - 1])  # the last shared token: the branch sees its segment up to it
                parent = self.segments[attach]
                self.segment_parent.append(parent)
                self.segment_visible.append(attach - self.segment_start[parent] + 1)
            else:
                self.segment_parent.append(-1)
                self.segment_visible.append(0)
            self.segment_start.append(start)
            new = len(sequence) - shared
            path[shared:] = np.arange(start, start + new)
            self.tokens.extend(sequence[shared:].tolist())
            self.positions.extend(range(shared, len(sequence)))
            self.labels.extend([-100] * new)
            self.segments.extend([segment] * new)
        scored = path[prompt_length - 1 : len(sequence) - 1]
        for position, target in zip(scored.tolist(), sequence[prompt_length:].tolist()):
            self.labels[position] = target
        self.sequences.append(sequence)
        self.paths.append(path)
        self.rows.append(row)
        self.scored.append(scored)

    def finish(self) -> PackedRow:
        num_segments = len(self.segment_start)
        visible_end = np.full((num_segments, num_segments), -1, dtype=np.int64)
        for segment in range(num_segments):
            visible_end[segment, segment] = _SELF
            child, parent = segment, self.segment_parent[segment]
            while parent >= 0:
                visible_end[segment, parent] = self.segment_start[parent] + self.segment_visible[child]
                child, parent = parent, self.segment_parent[parent]
        return PackedRow(
            input_ids=torch.tensor(self.tokens, dtype=torch.long),
            position_ids=torch.tensor(self.positions, dtype=torch.long),
            labels=torch.tensor(self.labels, dtype=torch.long),
            segment_ids=torch.tensor(self.segments, dtype=torch.long),
            visible_end=torch.from_numpy(visible_end),
            rows=list(self.rows),
            scored=[torch.from_numpy(s.copy()) for s in self.scored],
        )


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.nonzero(a[:n] != b[:n])[0]
    return int(differ[0]) if differ.size else n


def pack_rows(
    sequences: list[list[int]], prompt_lengths: list[int], completion_length: int, max_packed_tokens: int
) -> Packing:
    """Lay out rows as token trees in packed rows of at most ``max_packed_tokens`` tokens.

    Rows are placed in order; each branches from the placed row of its packed row with which it shares the longest
    prefix, and a new packed row starts when the next row would overflow the budget (a row longer than the budget
    gets a packed row of its own). No row is dropped.

    Args:
        sequences: per row, its real tokens (prompt then completion).
        prompt_lengths: per row, the number of prompt tokens (>= 1); the rest are scored.
        completion_length: T, the width of the ``(B, T)`` tensors `Packing.unpack` returns (>= every completion).
        max_packed_tokens: the token budget of one packed row.

    Returns:
        The `Packing`.
    """
    if max_packed_tokens < 1:
        raise ValueError(f"max_packed_tokens={max_packed_tokens} must be >= 1.")
    bins: list[_Bin] = []
    current = _Bin()
    used = 0
    for row, (tokens, prompt_length) in enumerate(zip(sequences, prompt_lengths)):
        if not 1 <= prompt_length <= len(tokens) or len(tokens) - prompt_length > completion_length:
            raise ValueError(
                f"row {row}: prompt length {prompt_length} and {len(tokens)} tokens do not fit a completion width "
                f"of {completion_length} with at least one prompt token."
            )
        sequence = np.asarray(tokens, dtype=np.int64)
        placed, shared = current.branch_point(sequence, prompt_length)
        if current.rows and used + len(sequence) - shared > max_packed_tokens:
            bins.append(current)
            current, used = _Bin(), 0
            placed, shared = -1, 0
        current.add(row, sequence, prompt_length, placed, shared)
        used += len(sequence) - shared
    if current.rows:
        bins.append(current)
    return Packing(
        packed=[b.finish() for b in bins],
        num_rows=len(sequences),
        completion_length=completion_length,
        real_tokens=sum(len(s) for s in sequences),
    )


def tree_mask(
    batch: torch.Tensor,
    q_idx: torch.Tensor,
    kv_idx: torch.Tensor,
    segment_ids: torch.Tensor,
    visible_end: torch.Tensor,
) -> torch.Tensor:
    """True where token ``kv_idx`` of packed row ``batch`` is visible to its token ``q_idx`` (indices broadcast).

    The definition of the mask and FlexAttention's ``mask_mod``; `PackedBatch.dense_mask` fills the same mask block
    by block (tests/test_packing.py checks that the two agree).

    Args:
        batch, q_idx, kv_idx: integer index tensors (broadcastable).
        segment_ids: ``(R, L)`` segment of each token.
        visible_end: ``(R, S, S)`` see the module docstring.
    """
    return (kv_idx <= q_idx) & (kv_idx < visible_end[batch, segment_ids[batch, q_idx], segment_ids[batch, kv_idx]])


@dataclass
class PackedBatch:
    """Packed rows stacked for one forward, right-padded to the longest (padding sees only padding)."""

    input_ids: torch.Tensor  # (R, L)
    position_ids: torch.Tensor  # (R, L)
    labels: torch.Tensor  # (R, L)
    segment_ids: torch.Tensor  # (R, L)
    visible_end: torch.Tensor  # (R, S, S)

    @classmethod
    def collate(cls, rows: list[PackedRow], device: torch.device | str) -> PackedBatch:
        length = max(len(row) for row in rows)
        num_segments = max(row.visible_end.shape[0] for row in rows) + 1  # + the padding segment
        pad_segment = num_segments - 1
        input_ids = torch.zeros((len(rows), length), dtype=torch.long)
        position_ids = torch.zeros_like(input_ids)
        labels = torch.full_like(input_ids, -100)
        segment_ids = torch.full_like(input_ids, pad_segment)
        visible_end = torch.full((len(rows), num_segments, num_segments), -1, dtype=torch.long)
        visible_end[:, pad_segment, pad_segment] = int(_SELF)
        for index, row in enumerate(rows):
            n, s = len(row), row.visible_end.shape[0]
            input_ids[index, :n] = row.input_ids
            position_ids[index, :n] = row.position_ids
            labels[index, :n] = row.labels
            segment_ids[index, :n] = row.segment_ids
            visible_end[index, :s, :s] = row.visible_end
        return cls(*(t.to(device) for t in (input_ids, position_ids, labels, segment_ids, visible_end)))

    def dense_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """``(R, 1, L, L)`` additive mask (0 where visible, the dtype's minimum elsewhere): SDPA and eager attention.

        The same mask as `tree_mask`, filled block by block (a segment's rows see a causal triangle of itself and a
        leading part of each ancestor segment) instead of gathering ``visible_end`` for each of the L² pairs.
        """
        rows, length = self.input_ids.shape
        device = self.input_ids.device
        mask = torch.full((rows, 1, length, length), torch.finfo(dtype).min, dtype=dtype, device=device)
        causal = torch.ones((length, length), dtype=torch.bool, device=device).tril()
        for index in range(rows):
            segments, counts = torch.unique_consecutive(self.segment_ids[index], return_counts=True)
            starts = [0, *torch.cumsum(counts, 0).tolist()]
            start_of = dict(zip(segments.tolist(), starts))
            visible_end = self.visible_end[index].tolist()
            for segment, start, end in zip(segments.tolist(), starts, starts[1:]):
                block = mask[index, 0, start:end]
                block[:, start:end].masked_fill_(causal[: end - start, : end - start], 0)
                for ancestor, limit in enumerate(visible_end[segment]):
                    if ancestor != segment and limit >= 0:
                        block[:, start_of[ancestor] : limit] = 0
        return mask

    def block_mask(self):
        """FlexAttention ``BlockMask`` of the same mask: block-sparse, what scales to long packed rows on GPU."""
        from torch.nn.attention.flex_attention import create_block_mask

        segment_ids, visible_end = self.segment_ids, self.visible_end

        def mask_mod(batch, head, q_idx, kv_idx):
            return tree_mask(batch, q_idx, kv_idx, segment_ids, visible_end)

        rows, length = self.input_ids.shape
        return create_block_mask(mask_mod, rows, None, length, length, device=self.input_ids.device)


@dataclass
class TreeSequence:
    """Packed rows laid end to end as one sequence for varlen tree attention (`trl_ext.attention.tree_attention`): no
    padding and no ``L x L`` mask; each segment's queries attend to the keys of its path, as `tree_mask` says.

    Attributes:
        input_ids, position_ids, labels: ``(1, N)``, the rows' tokens one after the other.
        kv_index: ``(K,)`` per segment, the positions of its path: the visible part of each ancestor (root first),
            then the segment itself (the attention's ``tree_kv_index``).
        cu_seqlens_q, cu_seqlens_k: ``(S + 1,)`` int32: the segments' boundaries in the sequence, their paths' in
            ``kv_index``.
        offsets: where each packed row starts in the sequence.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    kv_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    offsets: list[int]

    @classmethod
    def collate(cls, rows: list[PackedRow], device: torch.device | str) -> TreeSequence:
        paths: list[np.ndarray] = []
        cu_q, cu_k, offsets, offset = [0], [0], [], 0
        for row in rows:
            offsets.append(offset)
            segments, counts = np.unique(row.segment_ids.numpy(), return_counts=True)  # in order: laid out in turn
            starts = np.concatenate([[0], np.cumsum(counts)])
            visible_end = row.visible_end.numpy()
            for segment, start, end in zip(segments.tolist(), starts[:-1].tolist(), starts[1:].tolist()):
                ancestors = [a for a in np.nonzero(visible_end[segment] >= 0)[0].tolist() if a != segment]
                pieces = [np.arange(starts[a], visible_end[segment, a]) for a in ancestors]  # root first
                paths.append(np.concatenate([*pieces, np.arange(start, end)]) + offset)
                cu_q.append(offset + end)
                cu_k.append(cu_k[-1] + len(paths[-1]))
            offset += len(row)

        def joined(name: str) -> torch.Tensor:
            return torch.cat([getattr(row, name) for row in rows]).unsqueeze(0).to(device)

        return cls(
            input_ids=joined("input_ids"),
            position_ids=joined("position_ids"),
            labels=joined("labels"),
            kv_index=torch.from_numpy(np.concatenate(paths)).to(device),
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
            cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
            offsets=offsets,
        )

    def attention_kwargs(self) -> dict[str, torch.Tensor]:
        """What the model's forward passes on to `trl_ext.attention.tree_attention`."""
        return {
            "tree_kv_index": self.kv_index,
            "tree_cu_seqlens_q": self.cu_seqlens_q,
            "tree_cu_seqlens_k": self.cu_seqlens_k,
        }


def packed_logps_and_entropies(
    model,
    packing: Packing,
    compute_entropy: bool,
    attn_implementation: str,
    autocast=None,
    max_forward_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of the packed rows, unpacked to the batch's ``(B, T)``.

    ``model`` must carry TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`, which `GRPOTrainer` adds): it
    scores the positions of ``labels`` without materialising the logits.

    Args:
        model: the (possibly PEFT- or DDP-wrapped) causal LM with TRL's fused head.
        packing: the layout from `pack_rows`.
        compute_entropy: also return the entropies.
        attn_implementation: the model's attention implementation: ``"flex_attention"`` gets a ``BlockMask``; SDPA
            on the CPU runs the rows as one `TreeSequence` (`VARLEN_ATTENTION`; the model's implementation becomes
            `trl_ext.attention.use_tree_attention`'s), anything else the dense additive mask.
        autocast: a context manager factory for the forward (the trainer's ``accelerator.autocast``), or None.
        max_forward_tokens: without gradients, the packed rows are run in forwards of at most this many (padded)
            tokens (at least one row each); with gradients, always in one forward (DDP needs exactly one, as TRL).

    Returns:
        ``(logps, entropies)``, each ``(B, T)`` (entropies None unless asked), 0 beyond each row's completion.
    """
    parameters = [p for p in model.parameters() if p.is_floating_point()]
    device, dtype = parameters[0].device, parameters[0].dtype
    forwards: list[list[PackedRow]] = [[]]
    for row in packing.packed:
        batch = forwards[-1] + [row]
        padded = len(batch) * max(len(r) for r in batch)
        if forwards[-1] and not torch.is_grad_enabled() and max_forward_tokens and padded > max_forward_tokens:
            forwards.append([row])
        else:
            forwards[-1] = batch
    all_logps, all_entropies = [], []
    attn_implementation = base_attention(attn_implementation)
    config = getattr(model, "module", model).config  # DDP wraps the model; PEFT forwards .config
    # The varlen kernel has no attention dropout: a model that trains with one keeps the dense mask.
    dropout = model.training and getattr(config, "attention_dropout", 0.0)
    varlen = attn_implementation in VARLEN_ATTENTION and device.type == "cpu" and not dropout
    if varlen:  # the model's layers run `tree_attention` where a forward carries the tree, SDPA elsewhere
        use_tree_attention(config)
    for rows in forwards:
        if varlen:
            sequence = TreeSequence.collate(rows, device)
            with autocast() if autocast is not None else contextlib.nullcontext():
                outputs = model(
                    input_ids=sequence.input_ids,
                    position_ids=sequence.position_ids,
                    shift_labels=sequence.labels,
                    fused_lm_head=True,
                    **sequence.attention_kwargs(),
                )
            for row, start in zip(rows, sequence.offsets):
                all_logps.append(outputs.log_probs[0, start : start + len(row)])
                if compute_entropy:
                    all_entropies.append(outputs.entropy[0, start : start + len(row)])
            continue
        batch = PackedBatch.collate(rows, device)
        mask = batch.block_mask() if attn_implementation == "flex_attention" else batch.dense_mask(dtype)
        with autocast() if autocast is not None else contextlib.nullcontext():
            outputs = model(
                input_ids=batch.input_ids,
                attention_mask=mask,
                position_ids=batch.position_ids,
                shift_labels=batch.labels,
                fused_lm_head=True,
            )
        for index, row in enumerate(rows):
            all_logps.append(outputs.log_probs[index, : len(row)])
            if compute_entropy:
                all_entropies.append(outputs.entropy[index, : len(row)])
    logps = packing.unpack(all_logps)
    entropies = packing.unpack(all_entropies) if compute_entropy else None
    return logps, entropies


def group_micro_batches(
    micro_batches: list[dict], *, generator: torch.Generator, group_key: str = "prefix_group"
) -> list[dict]:
    """Re-split micro-batches so that rows of one prefix group sit together (and so can share their prefix).

    The groups are put in a random order drawn from ``generator`` (never the global random stream, which TRL's
    sampling and shuffles draw from), the rows of each group kept together, and the rows split again into as many
    micro-batches of the same size. No row is added or dropped.

    Args:
        micro_batches: TRL's micro-batches: dicts of N-row tensors, lists, 0-dim tensors (kept) and None.
        generator: a CPU generator of its own (the trainer seeds it from the run's seed and step).
        group_key: the ``(N,)`` integer tensor naming each row's group.

    Returns:
        ``len(micro_batches)`` micro-batches of the same sizes.
    """
    if len(micro_batches) < 2 or micro_batches[0].get(group_key) is None:
        return micro_batches
    keys = micro_batches[0].keys()
    merged: dict = {}
    for key in keys:
        values = [batch[key] for batch in micro_batches]
        first = values[0]
        if first is None or (isinstance(first, torch.Tensor) and first.dim() == 0):
            merged[key] = first
        elif isinstance(first, torch.Tensor):
            merged[key] = torch.cat(values)
        else:
            merged[key] = [item for value in values for item in value]
    groups = merged[group_key].cpu()
    unique, inverse = torch.unique(groups, return_inverse=True)
    rank = torch.empty_like(unique)
    rank[torch.randperm(unique.numel(), generator=generator)] = torch.arange(unique.numel())
    order = torch.sort(rank[inverse], stable=True).indices
    size = len(order) // len(micro_batches)
    arranged = []
    for chunk in range(len(micro_batches)):
        index = order[chunk * size : (chunk + 1) * size]
        batch = {}
        for key, value in merged.items():
            if value is None or (isinstance(value, torch.Tensor) and value.dim() == 0):
                batch[key] = value
            elif isinstance(value, torch.Tensor):
                batch[key] = value[index.to(value.device)]
            else:
                batch[key] = [value[i] for i in index.tolist()]
        arranged.append(batch)
    return arranged
