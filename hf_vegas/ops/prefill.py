"""Prefill attention without a `(B, T, S)` mask: one SDPA call per row.

A prefill writes each row's real tokens into slots `[start, start + n)` after the `start` tokens the row already
holds (0 for a fresh prompt; a user's prefix cache, or the chunks before this one of a chunked prefill), after
`left_pad` pad queries. Into an empty cache, row `b`'s real queries and its keys are a square causal problem, which
SDPA solves with `is_causal=True` and its fastest kernels. After `start` cached tokens (or inside a sliding window)
the row gets its own `(n, start + n)` boolean mask, one row at a time: the naive `dense_attention` builds a mask
and logits of `B * T * S` elements instead, which at batch 64 x 8K prompts is gigabytes. Same semantics: pad
queries, whose outputs nothing reads, get zeros.
"""

from __future__ import annotations

import torch


def causal_per_row(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, left_pad: list[int],
                   scaling: float, window: int | None = None, start: list[int] | None = None) -> torch.Tensor:
    """`q` `(B, Hq, T, D)`, caches `(B, S, Hkv, D)` holding row `b`'s earlier tokens in slots `[0, start[b])` and
    this forward's in `[start[b], start[b] + T - left_pad[b])` (`start` None: all 0); `window`: a sliding window (a
    query sees the `window` slots up to its own), or None.

    Returns `(B, T, Hq, Dv)` in `q.dtype`.
    """
    batch, q_heads, tokens, _ = q.shape
    groups = q_heads // k_cache.shape[2]
    out = q.new_zeros(batch, tokens, q_heads, v_cache.shape[-1])
    for b, pad in enumerate(left_pad):
        n = tokens - pad
        if n <= 0:  # a chunk of a chunked prefill that holds only this row's pads
            continue
        first = start[b] if start is not None else 0
        total = first + n
        k = k_cache[b : b + 1, :total].transpose(1, 2).to(q.dtype)
        v = v_cache[b : b + 1, :total].transpose(1, 2).to(q.dtype)
        mask = None
        if first or (window is not None and window < total):
            distance = (first + torch.arange(n, device=q.device))[:, None] - torch.arange(total, device=q.device)
            mask = distance >= 0
            if window is not None:
                mask &= distance < window  # transformers' convention: kv > q - window
        gqa = groups > 1
        if mask is not None and gqa:
            # SDPA's memory-efficient CUDA kernel takes a mask but not GQA, and flash takes no mask: with both, SDPA
            # would fall back to the math path and its (Hq, n, start + n) scores. Repeating the keys and values to
            # the query heads costs (start + n) * Hq * D per row instead.
            k, v, gqa = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), False
        rows = torch.nn.functional.scaled_dot_product_attention(
            q[b : b + 1, :, pad:], k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=gqa,
        )
        out[b, pad:] = rows[0].transpose(0, 1)
    return out
