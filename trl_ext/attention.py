"""Variable-length attention in plain torch (any device), with flash-attn's ``flash_attn_varlen_func`` signature.

`flash_attn_varlen_cpu` is what TRL's tree-packed asynchronous training runs off CUDA (the asynchronous seam
installs it in place of TRL's FlashAttention-3 fetch, `trl_ext.trainers.async_seam.cpu`); `attention_allowed` is the
mask of one segment in flash-attn's convention.

Shapes, as flash-attn's ``flash_attn_varlen_func``: ``Tq`` query tokens, ``Tk`` key/value rows, ``S`` segments,
``H`` query heads, ``Hkv`` key/value heads (``H % Hkv == 0``: grouped-query attention), ``D`` the head dim.

Pure: imports torch only.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["attention_allowed", "flash_attn_varlen_cpu"]


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
