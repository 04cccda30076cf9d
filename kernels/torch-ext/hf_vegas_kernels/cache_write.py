"""Write a forward's new keys and values into the cache: one launch for both, instead of two `index_put`s.

A draft step writes one token per row per layer; as two advanced-indexing assignments that is two kernels of ~4 us
each per layer at batch 64 (a seventh of a SmolLM2 draft step). One program per (row, token) copies the token's keys
and values for every KV head, converting to the cache's dtype. Semantics: `naive.write_kv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv(
    K, V, KCache, VCache, Slots, T,
    stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh, stride_sb,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    program = tl.program_id(0)
    b = (program // T).to(tl.int64)
    t = program % T
    slot = tl.load(Slots + b * stride_sb + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    ok = (h[:, None] < HEADS) & (d[None, :] < HEAD_DIM)
    k = tl.load(K + b * stride_kb + h[:, None] * stride_kh + t * stride_kt + d[None, :], mask=ok)
    tl.store(KCache + b * stride_cb + slot * stride_cs + h[:, None] * stride_ch + d[None, :],
             k.to(KCache.dtype.element_ty), mask=ok)
    dv = tl.arange(0, BLOCK_DV)
    ok_v = (h[:, None] < HEADS) & (dv[None, :] < V_DIM)
    v = tl.load(V + b * stride_vb + h[:, None] * stride_vh + t * stride_vt + dv[None, :], mask=ok_v)
    tl.store(VCache + b * stride_db + slot * stride_ds + h[:, None] * stride_dh + dv[None, :],
             v.to(VCache.dtype.element_ty), mask=ok_v)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slots: torch.Tensor) -> None:
    """`k_cache[b, slots[b, t]] = key[b, :, t]` (and values) for every row `b` and token `t`, in place.

    Caches `(B, S, H, D)` / `(B, S, H, Dv)`, `key` `(B, H, T, D)`, `value` `(B, H, T, Dv)` (any strides but a
    contiguous last dimension), `slots` `(B, T)` int64.
    """
    batch, heads, tokens, head_dim = key.shape
    v_dim = value.shape[-1]
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or slots.stride(-1) != 1:
        raise ValueError("write_kv: the caches' and slots' last dimensions must be contiguous")
    _write_kv[(batch * tokens,)](
        key, value, k_cache, v_cache, slots, tokens,
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), slots.stride(0),
        HEADS=heads, HEAD_DIM=head_dim, V_DIM=v_dim, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_DV=triton.next_power_of_2(v_dim), num_warps=2,
    )
