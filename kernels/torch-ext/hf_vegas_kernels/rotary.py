"""A fused draft layer's rotary embedding and cache write in one launch (`hf_vegas.draft_layers`).

A draft step's q/k/v projection leaves one `(B, T, (Hq + 2 Hkv) * D)` row per token. The model would then rotate the
queries and the keys (two kernels even when compiled) and the cache would write keys and values (a third): at a
SmolLM2 draft step each is a ~1.3 us launch whose bytes are a few hundred kilobytes. Here one program per (row, token)
rotates that token's query heads into the output and its key heads into their cache slot, and copies its value heads
there too, in fp32 with one rounding (the model's own rotation rounds after each product).

Rotation is the `rotate_half` convention of Llama and its kin: for the halves `x1, x2` of a head,
`(x1 cos1 - x2 sin1, x2 cos2 + x1 sin2)`. Semantics: `hf_vegas.ops.reference.rope_write_kv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch


@triton.jit
def _rotated_halves(X, heads, j, ok, cos1, cos2, sin1, sin2, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    x1 = tl.load(X + heads[:, None] * HEAD_DIM + j[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(X + heads[:, None] * HEAD_DIM + HALF + j[None, :], mask=ok, other=0.0).to(tl.float32)
    return x1 * cos1[None, :] - x2 * sin1[None, :], x2 * cos2[None, :] + x1 * sin2[None, :]


@triton.jit
def _rope_write(
    QKV, Cos, Sin, QOut, KCache, VCache, Slots, T,
    stride_xb, stride_xt, stride_cb, stride_ct, stride_sb, stride_st, stride_qb, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_slot_b,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    program = tl.program_id(0)
    b = (program // T).to(tl.int64)
    t = program % T
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    cos = Cos + b * stride_cb + t * stride_ct
    sin = Sin + b * stride_sb + t * stride_st
    cos1 = tl.load(cos + j, mask=j_ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cos + HALF + j, mask=j_ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sin + j, mask=j_ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sin + HALF + j, mask=j_ok, other=0.0).to(tl.float32)
    row = QKV + b * stride_xb + t * stride_xt

    hq = tl.arange(0, BLOCK_HQ)
    ok = (hq < Q_HEADS)[:, None] & j_ok[None, :]
    o1, o2 = _rotated_halves(row, hq, j, ok, cos1, cos2, sin1, sin2, HEAD_DIM, HALF)
    q_out = QOut + b * stride_qb + t * stride_qt + hq[:, None] * stride_qh + j[None, :]
    tl.store(q_out, o1.to(QOut.dtype.element_ty), mask=ok)
    tl.store(q_out + HALF, o2.to(QOut.dtype.element_ty), mask=ok)

    slot = tl.load(Slots + b * stride_slot_b + t).to(tl.int64)
    hk = tl.arange(0, BLOCK_HK)
    ok = (hk < KV_HEADS)[:, None] & j_ok[None, :]
    k1, k2 = _rotated_halves(row + Q_HEADS * HEAD_DIM, hk, j, ok, cos1, cos2, sin1, sin2, HEAD_DIM, HALF)
    k_out = KCache + b * stride_kb + slot * stride_ks + hk[:, None] * stride_kh + j[None, :]
    tl.store(k_out, k1.to(KCache.dtype.element_ty), mask=ok)
    tl.store(k_out + HALF, k2.to(KCache.dtype.element_ty), mask=ok)
    v_in = row + (Q_HEADS + KV_HEADS) * HEAD_DIM + hk[:, None] * HEAD_DIM + j[None, :]
    v_out = VCache + b * stride_vb + slot * stride_vs + hk[:, None] * stride_vh + j[None, :]
    tl.store(v_out, tl.load(v_in, mask=ok).to(VCache.dtype.element_ty), mask=ok)
    tl.store(v_out + HALF, tl.load(v_in + HALF, mask=ok).to(VCache.dtype.element_ty), mask=ok)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, q_heads: int, kv_heads: int,
                  head_dim: int) -> torch.Tensor:
    """Rotate and store one forward's projections: returns the rotated queries `(B, T, Hq, D)`; writes the rotated
    keys and the values of token `t` of row `b` into slot `slots[b, t]` of the `(B, S, Hkv, D)` caches, in place.

    `qkv` `(B, T, (Hq + 2 Hkv) * D)`: queries, then keys, then values, each head's `D` values contiguous;
    `cos`, `sin` `(B, T, D)` (the model's position embeddings); `slots` `(B, T)` int64.
    """
    batch, tokens, width = qkv.shape
    if head_dim % 2 or width != (q_heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"rope_write_kv: qkv of width (q_heads + 2 kv_heads) * head_dim with an even head_dim, got "
                         f"width {width} for {q_heads}/{kv_heads} heads of {head_dim}")
    if cos.shape != (batch, tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"rope_write_kv: cos and sin must be ({batch}, {tokens}, {head_dim}), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if qkv.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 or slots.stride(-1) != 1:
        raise ValueError("rope_write_kv: qkv, cos, sin and slots need a contiguous last dimension")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("rope_write_kv: the caches' last dimension must be contiguous")
    q = _launch.empty(batch, tokens, q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    half = head_dim // 2
    _rope_write[(batch * tokens,)](
        qkv, cos, sin, q, k_cache, v_cache, slots, tokens,
        qkv.stride(0), qkv.stride(1), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), slots.stride(0),
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, HALF=half, BLOCK_HQ=triton.next_power_of_2(q_heads),
        BLOCK_HK=triton.next_power_of_2(kv_heads), BLOCK_HALF=triton.next_power_of_2(half), num_warps=2,
    )
    return q
