"""Prefill attention without a `(B, T, S)` mask: one causal SDPA call per row.

A prefill writes each row's real tokens into slots `[0, length)` of an empty cache, after `left_pad` pad queries.
Row `b`'s real queries and its keys are then a square causal problem, which SDPA solves with `is_causal=True` and
its fastest kernels; the reference `dense_attention` builds a boolean mask of `B * T * S` elements instead, which at
batch 64 x 8K prompts is gigabytes. A sliding window gives each row a banded `(T, T)` mask, one row at a time. Same
semantics: pad queries, whose outputs nothing reads, get zeros.
"""

from __future__ import annotations

import torch


def causal_per_row(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, left_pad: list[int],
                   scaling: float, window: int | None = None) -> torch.Tensor:
    """`q` `(B, Hq, T, D)`, caches `(B, S, Hkv, D)` holding row `b`'s tokens in slots `[0, T - left_pad[b])`;
    `window`: a sliding window (a query sees the `window` slots up to its own), or None.

    Returns `(B, T, Hq, Dv)` in `q.dtype`.
    """
    batch, q_heads, tokens, _ = q.shape
    groups = q_heads // k_cache.shape[2]
    out = q.new_zeros(batch, tokens, q_heads, v_cache.shape[-1])
    for b, pad in enumerate(left_pad):
        n = tokens - pad
        k = k_cache[b : b + 1, :n].transpose(1, 2).to(q.dtype)
        v = v_cache[b : b + 1, :n].transpose(1, 2).to(q.dtype)
        band = None
        if window is not None and window < n:
            position = torch.arange(n, device=q.device)
            distance = position[:, None] - position[None, :]
            band = (distance >= 0) & (distance < window)  # transformers' convention: kv > q - window
        rows = torch.nn.functional.scaled_dot_product_attention(
            q[b : b + 1, :, pad:], k, v, attn_mask=band, is_causal=band is None, scale=scaling,
            enable_gqa=groups > 1,
        )
        out[b, pad:] = rows[0].transpose(0, 1)
    return out
