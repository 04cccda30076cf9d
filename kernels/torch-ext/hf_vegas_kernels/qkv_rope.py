"""A fused draft layer's q/k/v projection, rotary embedding and cache write in one launch (`hf_vegas.draft_layers`).

Separately these were two launches per layer (`linear_ops.qkv_linear`, then a rotary + cache-write kernel): 5.9 us at a
SmolLM2 draft step of 64 rows on an H100 against 4.9 for this one (`benchmarks/projections.py`, commit c911040).
Here a program owns one head (of the queries, keys or values) for `BLOCK_M` rows: it computes the head's two halves
as two products that share each input tile, rotates them in fp32 (the `rotate_half` convention:
`(x1 cos1 - x2 sin1, x2 cos2 + x1 sin2)`), and stores the queries to the output and the keys and values into their
cache slots.

The projection is never rounded before the rotation (the model rounds it once to its dtype), so half-precision
results may differ from the model's by that rounding: a draft's keys and values are rewritten by the verification
with the model's own layers, and drafts only decide how many tokens are accepted. Semantics:
`naive.qkv_rope_write` (in fp32 it agrees with the model's layers to summation order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._pdl import lines, prefetch_rows, release_dependents, wait_for_inputs
from .linear import _row_scale, check_row_sumsq


@triton.jit
def _qkv_rope_write(
    X, WQ, WK, WV, BQ, BK, BV, Cos, Sin, QOut, KCache, VCache, Slots, SumSq, M, K, T, eps, parts,
    stride_xm, stride_sm, stride_wq, stride_wk, stride_wv, stride_cb, stride_ct, stride_sb, stride_st,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_slot_b,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROW_SCALE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr, EARLY_TRIGGER: tl.constexpr, PREFETCH: tl.constexpr, K_LINES: tl.constexpr,
):
    head = tl.program_id(0)  # queries, then keys, then values
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # row m = b * T + t
    m_ok = rows < M
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    if head < Q_HEADS:
        W, B, stride_w, h = WQ, BQ, stride_wq, head
    elif head < Q_HEADS + KV_HEADS:
        W, B, stride_w, h = WK, BK, stride_wk, head - Q_HEADS
    else:
        W, B, stride_w, h = WV, BV, stride_wv, head - Q_HEADS - KV_HEADS
    cols = h * HEAD_DIM + j  # the head's first half; the second is HALF further
    if PREFETCH:  # the weights are no earlier kernel's output: L2 fetches the head's rows while the kernel before runs
        prefetch_rows(W, h * HEAD_DIM + tl.arange(0, 2 * BLOCK_HALF), tl.arange(0, 2 * BLOCK_HALF) < HEAD_DIM,
                      stride_w, K, K_LINES, tl.program_id(1), tl.num_programs(1))
    wait_for_inputs(USE_GDC, EARLY_TRIGGER)  # the input is the previous kernel's output
    acc1 = tl.zeros([BLOCK_M, BLOCK_HALF], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_HALF], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = j_ok[None, :] & k_ok[:, None]
        w1 = tl.load(W + cols[None, :] * stride_w + k[:, None], mask=w_ok, other=0.0)
        w2 = tl.load(W + (cols + HALF)[None, :] * stride_w + k[:, None], mask=w_ok, other=0.0)
        acc1 += tl.dot(x, w1.to(x.dtype), input_precision=PRECISION)
        acc2 += tl.dot(x, w2.to(x.dtype), input_precision=PRECISION)
    release_dependents(USE_GDC, EARLY_TRIGGER)
    if ROW_SCALE:  # the input was `x * norm_weight`: the RMSNorm's per-row factor scales the projection
        scale = _row_scale(SumSq, rows, m_ok, K, eps, stride_sm, parts, BLOCK_P)[:, None]
        acc1, acc2 = acc1 * scale, acc2 * scale
    if HAS_BIAS:
        acc1 += tl.load(B + cols, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        acc2 += tl.load(B + cols + HALF, mask=j_ok, other=0.0).to(tl.float32)[None, :]

    b = (rows // T).to(tl.int64)
    t = rows % T
    ok = m_ok[:, None] & j_ok[None, :]
    if head < Q_HEADS + KV_HEADS:  # queries and keys turn; values do not
        cos = Cos + b[:, None] * stride_cb + t[:, None] * stride_ct + j[None, :]
        sin = Sin + b[:, None] * stride_sb + t[:, None] * stride_st + j[None, :]
        cos1 = tl.load(cos, mask=ok, other=0.0).to(tl.float32)
        cos2 = tl.load(cos + HALF, mask=ok, other=0.0).to(tl.float32)
        sin1 = tl.load(sin, mask=ok, other=0.0).to(tl.float32)
        sin2 = tl.load(sin + HALF, mask=ok, other=0.0).to(tl.float32)
        out1, out2 = acc1 * cos1 - acc2 * sin1, acc2 * cos2 + acc1 * sin2
    else:
        out1, out2 = acc1, acc2
    if head < Q_HEADS:
        dest = QOut + b * stride_qb + t * stride_qt + h * stride_qh
    else:
        slot = tl.load(Slots + b * stride_slot_b + t, mask=m_ok, other=0).to(tl.int64)
        if head < Q_HEADS + KV_HEADS:
            dest = KCache + b * stride_kb + slot * stride_ks + h * stride_kh
        else:
            dest = VCache + b * stride_vb + slot * stride_vs + h * stride_vh
    tl.store(dest[:, None] + j[None, :], out1.to(dest.dtype.element_ty), mask=ok)
    tl.store(dest[:, None] + HALF + j[None, :], out2.to(dest.dtype.element_ty), mask=ok)


def qkv_rope_write(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, bq, bk, bv,
                   cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int, row_sumsq=None,
                   eps: float = 0.0) -> torch.Tensor:
    """Project `x` `(B, T, K)` with `wq`, `wk`, `wv` (and biases `bq`, `bk`, `bv`, or None), rotate the queries and
    keys by `cos`, `sin` `(B, T, D)`, write the keys and values of token `t` of row `b` into slot `slots[b, t]` of the
    `(B, S, Hkv, D)` caches (in place) and return the rotated queries `(B, T, Hq, D)`. With `row_sumsq` `(B * T, P)`
    (`linear_ops.linear_residual_norm`'s), `x` is an RMSNorm's input times its weight and the norm's row factor scales
    the projections before their biases (`linear.gated_linear` explains)."""
    batch, tokens, width = x.shape
    if head_dim % 2 or wq.shape != (q_heads * head_dim, width) or wk.shape != (kv_heads * head_dim, width) \
            or wv.shape != wk.shape:
        raise ValueError(f"qkv_rope_write: weights ({q_heads} x {head_dim}, {width}) and twice ({kv_heads} x "
                         f"{head_dim}, {width}) with an even head_dim, got {[tuple(w.shape) for w in (wq, wk, wv)]}")
    if cos.shape != (batch, tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"qkv_rope_write: cos and sin must be ({batch}, {tokens}, {head_dim}), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if any(t.stride(-1) != 1 for t in (x, wq, wk, wv, cos, sin, slots, k_cache, v_cache)):
        raise ValueError("qkv_rope_write: every tensor needs a contiguous last dimension")
    check_row_sumsq("qkv_rope_write", row_sumsq, batch * tokens)
    has_bias = bq is not None
    x2 = x.reshape(batch * tokens, width)
    sumsq = row_sumsq if row_sumsq is not None else x2[:, :1]  # (unread without the row scale)
    q = _launch.empty(batch, tokens, q_heads, head_dim, dtype=x.dtype, device=x.device)
    setting = _launch.LINEAR_TUNING["qkv_rope"]
    block_m = min(setting["block_m"], max(16, triton.next_power_of_2(batch * tokens)))
    half = head_dim // 2
    _qkv_rope_write[(q_heads + 2 * kv_heads, triton.cdiv(batch * tokens, block_m))](
        x2, wq, wk, wv, *((bq, bk, bv) if has_bias else (x2, x2, x2)), cos, sin, q, k_cache, v_cache, slots, sumsq,
        batch * tokens, width, tokens, float(eps), sumsq.shape[1], x2.stride(0), sumsq.stride(0), wq.stride(0),
        wk.stride(0), wv.stride(0),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), slots.stride(0),
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, HALF=half, HAS_BIAS=has_bias,
        ROW_SCALE=row_sumsq is not None, BLOCK_P=max(2, triton.next_power_of_2(sumsq.shape[1])), BLOCK_M=block_m,
        BLOCK_HALF=max(16, triton.next_power_of_2(half)), BLOCK_K=setting["block_k"],
        PRECISION=_launch.dot_precision(x.dtype), USE_GDC=_launch.pdl(x.device),
        EARLY_TRIGGER=_launch.pdl_option(x.device, "early_trigger"),
        PREFETCH=_launch.prefetch_weights(x.device, (wq, wk, wv)),
        K_LINES=lines(width, wq.element_size()),
        num_warps=setting["num_warps"], num_stages=setting["num_stages"], **_launch.pdl_launch(x.device),
    )
    return q
