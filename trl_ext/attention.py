"""Variable-length attention in plain torch (any device), with flash-attn's ``flash_attn_varlen_func`` signature.

`flash_attn_varlen_cpu` is what TRL's tree-packed asynchronous training runs off CUDA (the asynchronous seam
installs it in place of TRL's FlashAttention-3 fetch, `trl_ext.trainers.async_seam.cpu`); `attention_allowed` is the
mask of one segment in flash-attn's convention.

`tree_attention` is the same kernel as a transformers attention function: the synchronous trainer's shared-prefix
packing runs its packed rows on the CPU through it (`trl_ext.packing.TreeSequence`), so no ``L x L`` mask is built
and each segment attends to the keys of its own path only. `use_tree_attention` gives a model an attention
implementation that runs `tree_attention` for a forward that carries the tree's index tensors and the model's own
(SDPA) for any other, so generation and unpacked passes are unchanged, and gradient checkpointing, which replays a
layer's forward during the backward with the same arguments, replays the tree attention too.

Shapes, as flash-attn's ``flash_attn_varlen_func``: ``Tq`` query tokens, ``Tk`` key/value rows, ``S`` segments,
``H`` query heads, ``Hkv`` key/value heads (``H % Hkv == 0``: grouped-query attention), ``D`` the head dim.

Pure tensor functions (torch); `register_tree_attention` registers one with transformers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = [
    "TREE_ATTENTION",
    "attention_allowed",
    "base_attention",
    "flash_attn_varlen_cpu",
    "tree_attention",
    "use_tree_attention",
]

TREE_ATTENTION = "trl_ext_tree"  # `use_tree_attention` names a model's implementation "trl_ext_tree:<its own>"


def attention_allowed(
    query_length: int,
    key_length: int,
    *,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    device: torch.device | str | None = None,
) -> Tensor:
    """Which keys each query of one segment may attend to, in flash-attn's convention.

    The causal mask is aligned to the bottom-right corner: query ``i`` sits at key position
    ``i + key_length - query_length`` (the segment's queries are the last tokens of its key path). With
    ``window_size=(left, right)``, query ``i`` sees keys ``[i + offset - left, i + offset + right]`` (``-1``: no
    limit on that side; ``causal`` sets ``right`` to 0).

    Returns:
        ``(query_length, key_length)`` bool tensor, True where attention is allowed.
    """
    offset = key_length - query_length
    rows = torch.arange(query_length, device=device).unsqueeze(1) + offset  # each query's own key position
    cols = torch.arange(key_length, device=device).unsqueeze(0)
    left, right = window_size
    allowed = torch.ones(query_length, key_length, dtype=torch.bool, device=device)
    if causal:
        right = 0
    if right >= 0:
        allowed &= cols <= rows + right
    if left >= 0:
        allowed &= cols >= rows - left
    return allowed


def flash_attn_varlen_cpu(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> Tensor:
    """Variable-length attention with flash-attn's ``flash_attn_varlen_func`` signature, in plain torch (any device).

    Segment ``s`` attends its queries ``q[cu_seqlens_q[s]:cu_seqlens_q[s+1]]`` to the keys and values
    ``k/v[cu_seqlens_k[s]:cu_seqlens_k[s+1]]``; in TRL's tree packing those are the root-to-segment path gathered
    by ``tree_kv_index``. Computed in float32, returned in ``q``'s dtype; a query that sees no key gets zeros.

    Args:
        q: ``(Tq, H, D)`` queries.
        k, v: ``(Tk, Hkv, D)`` keys and values; each key/value head serves ``H // Hkv`` query heads.
        cu_seqlens_q: ``(S + 1,)`` segment boundaries in ``q``; cu_seqlens_k: ``(S + 1,)`` in ``k``/``v``.
        max_seqlen_q, max_seqlen_k: the longest segment (unused: flash-attn sizes its grid with them).
        softmax_scale: the scores' scale; default ``D ** -0.5``.
        causal: bottom-right causal mask (see `attention_allowed`).
        window_size: ``(left, right)`` local attention, ``-1`` for no limit.
        softcap: when > 0, scores become ``softcap * tanh(scores / softcap)`` before the softmax.

    Returns:
        ``(Tq, H, D)`` attention output.
    """
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q must be (Tq, H, D) and k, v (Tk, Hkv, D); got {tuple(q.shape)}, {tuple(k.shape)}.")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads.")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q {cu_seqlens_q.numel()} and cu_seqlens_k {cu_seqlens_k.numel()} differ.")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for (q_start, q_end), (k_start, k_end) in zip(
        zip(bounds_q[:-1], bounds_q[1:]), zip(bounds_k[:-1], bounds_k[1:]), strict=True
    ):
        if q_end == q_start:
            continue
        queries = q[q_start:q_end].float().transpose(0, 1)  # (H, Lq, D)
        keys = k[k_start:k_end].float().transpose(0, 1).repeat_interleave(groups, dim=0)  # (H, Lk, D)
        values = v[k_start:k_end].float().transpose(0, 1).repeat_interleave(groups, dim=0)
        scores = queries @ keys.transpose(1, 2) * scale  # (H, Lq, Lk)
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        allowed = attention_allowed(
            q_end - q_start, k_end - k_start, causal=causal, window_size=tuple(window_size), device=q.device
        )
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
        out[q_start:q_end] = (probs @ values).transpose(0, 1).to(q.dtype)
    return out


def tree_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    tree_kv_index: Tensor,
    tree_cu_seqlens_q: Tensor,
    tree_cu_seqlens_k: Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """A transformers attention function (``AttentionInterface``) over one sequence of packed token trees.

    Args:
        module: the attention layer (unused).
        query: ``(1, H, N, D)``; key, value: ``(1, Hkv, N, D)``: the ``N`` tokens of the sequence.
        attention_mask: ignored (the tree is given by the index tensors).
        tree_kv_index: ``(K,)`` the position of every key/value row each segment sees, segment after segment: its
            path (the visible part of each ancestor segment, root first) then itself.
        tree_cu_seqlens_q: ``(S + 1,)`` the segments' boundaries in the sequence; tree_cu_seqlens_k: ``(S + 1,)``
            their paths' boundaries in ``tree_kv_index``.
        scaling, sliding_window, softcap: the layer's (`flash_attn_varlen_cpu`).
        dropout: must be 0 (the kernel has no dropout).

    Returns:
        ``((1, N, H, D), None)``.
    """
    if dropout:
        raise ValueError(f"tree attention has no dropout (got {dropout}): set the model's attention_dropout to 0.")
    query, key, value = (x.transpose(1, 2)[0] for x in (query, key, value))
    out = flash_attn_varlen_cpu(
        query,
        key.index_select(0, tree_kv_index),
        value.index_select(0, tree_kv_index),
        tree_cu_seqlens_q,
        tree_cu_seqlens_k,
        softmax_scale=scaling,
        causal=True,
        window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
        softcap=softcap or 0.0,
    )
    return out.unsqueeze(0), None


def base_attention(name: str | None) -> str | None:
    """The model's own attention implementation behind ``name`` (``"trl_ext_tree:sdpa"`` -> ``"sdpa"``)."""
    prefix = f"{TREE_ATTENTION}:"
    return name[len(prefix) :] if name is not None and name.startswith(prefix) else name


def use_tree_attention(config: Any) -> None:
    """Switch a model's attention implementation (its ``config``) from ``base`` (``"sdpa"``) to
    ``"trl_ext_tree:<base>"``: `tree_attention` where the forward passes ``tree_kv_index``, ``base`` with ``base``'s
    masks otherwise. Idempotent; raises for an implementation transformers does not register (e.g. ``"eager"``,
    which each model defines itself)."""
    base = config._attn_implementation
    if base_attention(base) != base:
        return
    if base not in ALL_ATTENTION_FUNCTIONS or base not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"tree attention wraps a registered attention implementation, not {base!r}.")
    inner = ALL_ATTENTION_FUNCTIONS[base]

    def dispatch(module, query, key, value, attention_mask, **kwargs):
        if "tree_kv_index" in kwargs:
            return tree_attention(module, query, key, value, attention_mask, **kwargs)
        return inner(module, query, key, value, attention_mask, **kwargs)

    name = f"{TREE_ATTENTION}:{base}"
    AttentionInterface.register(name, dispatch)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    config._attn_implementation = name
