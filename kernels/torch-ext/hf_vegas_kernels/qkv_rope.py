"""A fused layer's q/k/v projection, rotary embedding and cache write in one launch (`hf_vegas.fused_layers`),
and for weights too large for that launch the same after a projection of its own.

Separately these were two launches per layer (`linear_ops.qkv_linear`, then a rotary + cache-write kernel): 5.9 us at a
SmolLM2 draft step of 64 rows on an H100 against 4.9 for this one (`benchmarks/projections.py`, commit c911040).
Here a program owns one head (of the queries, keys or values) for `BLOCK_M` rows: it computes the head's two halves
as two products that share each input tile, normalises the query and key heads where the model has per-head RMSNorms
(Qwen3's `q_norm`, `k_norm`), rotates them in fp32 (the `rotate_half` convention:
`(x1 cos1 - x2 sin1, x2 cos2 + x1 sin2)`), and stores the queries to the output and the keys and values into their
cache slots.

A program per head and row block is few programs for large weights: Qwen3-8B's 48 heads at 16 rows would each stream
1 MB of weights, on 48 of an H200's 132 SMs. There the projection runs as `linear_ops.qkv_linear` (192 column blocks)
and `rope_write_kv` does the rest, one program per head and row block reading the product (`hf_vegas.fused_layers`
picks by the weights' size).

The projection is never rounded before the rotation in the one launch (the model rounds it once to its dtype, and
again after its head norms), so half-precision results may differ from the model's by that rounding: a draft's keys
and values are rewritten by the verification with the model's own layers, and drafts only decide how many tokens are
accepted. Semantics: `naive.qkv_rope_write` and `naive.rope_write_kv` (in fp32 they agree with the model's layers to
summation order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._pdl import lines, prefetch_rows, release_dependents, wait_for_inputs
from .linear import _row_scale, check_row_sumsq


@triton.jit
def _head_operands(
    head, rows, m_ok, j, j_ok, T, QNorm, KNorm, Cos, Sin, Slots, stride_cb, stride_ct, stride_sb, stride_st,
    stride_slot_b, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, HEAD_NORM: tl.constexpr,
):
    """What finishing head `head` of rows `rows` reads besides the head itself: the rotary tables' halves (queries
    and keys), the head norm's weight halves (with `HEAD_NORM`) and the rows' cache slots (keys and values), each
    masked off where the head does not use it. Loaded on their own so that `_qkv_rope_write` can ask for them before
    its main loop, whose latency then hides theirs."""
    b = (rows // T).to(tl.int64)
    t = rows % T
    # (as blocks, not scalars: masks must be tensors of the load's shape or broadcastable ones, in the interpreter too)
    turns = j_ok & ((j * 0 + head) < Q_HEADS + KV_HEADS)  # queries and keys turn; values do not
    ok = m_ok[:, None] & turns[None, :]
    cos = Cos + b[:, None] * stride_cb + t[:, None] * stride_ct + j[None, :]
    sin = Sin + b[:, None] * stride_sb + t[:, None] * stride_st + j[None, :]
    cos1 = tl.load(cos, mask=ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cos + HALF, mask=ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sin, mask=ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sin + HALF, mask=ok, other=0.0).to(tl.float32)
    norm1 = j.to(tl.float32) * 0.0
    norm2 = norm1
    if HEAD_NORM:  # the model's RMSNorm over each query and key head
        if head < Q_HEADS:
            NormW = QNorm
        else:
            NormW = KNorm
        norm1 = tl.load(NormW + j, mask=turns, other=0.0).to(tl.float32)
        norm2 = tl.load(NormW + HALF + j, mask=turns, other=0.0).to(tl.float32)
    slot = tl.load(Slots + b * stride_slot_b + t, mask=m_ok & ((rows * 0 + head) >= Q_HEADS), other=0).to(tl.int64)
    return cos1, cos2, sin1, sin2, norm1, norm2, slot


@triton.jit
def _finish_head(
    acc1, acc2, head, h, rows, m_ok, j, j_ok, T, head_eps, cos1, cos2, sin1, sin2, norm1, norm2, slot, QOut, KCache,
    VCache, stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HEAD_NORM: tl.constexpr,
):
    """Head `head` (the `h`-th of its kind) of rows `rows`, as fp32 halves `acc1`, `acc2` `(BLOCK_M, BLOCK_HALF)`,
    zero beyond `HALF`, with `_head_operands`' operands: normalise (queries and keys, with `HEAD_NORM`), rotate
    (queries and keys) and store, the queries to `QOut`, the keys and values into their cache slots."""
    b = (rows // T).to(tl.int64)
    t = rows % T
    ok = m_ok[:, None] & j_ok[None, :]
    if head < Q_HEADS + KV_HEADS:  # queries and keys turn; values do not
        if HEAD_NORM:  # the model's RMSNorm over each head (in fp32), before the rotation
            mean_square = (tl.sum(acc1 * acc1, axis=1) + tl.sum(acc2 * acc2, axis=1)) / HEAD_DIM
            factor = tl.rsqrt(mean_square + head_eps)[:, None]
            acc1 *= factor * norm1[None, :]
            acc2 *= factor * norm2[None, :]
        out1, out2 = acc1 * cos1 - acc2 * sin1, acc2 * cos2 + acc1 * sin2
    else:
        out1, out2 = acc1, acc2
    if head < Q_HEADS:
        dest = QOut + b * stride_qb + t * stride_qt + h * stride_qh
    elif head < Q_HEADS + KV_HEADS:
        dest = KCache + b * stride_kb + slot * stride_ks + h * stride_kh
    else:
        dest = VCache + b * stride_vb + slot * stride_vs + h * stride_vh
    tl.store(dest[:, None] + j[None, :], out1.to(dest.dtype.element_ty), mask=ok)
    tl.store(dest[:, None] + HALF + j[None, :], out2.to(dest.dtype.element_ty), mask=ok)


@triton.jit
def _qkv_rope_write(
    X, WQ, WK, WV, BQ, BK, BV, QNorm, KNorm, Cos, Sin, QOut, KCache, VCache, Slots, SumSq, M, K, T, eps, head_eps,
    parts, stride_xm, stride_sm, stride_wq, stride_wk, stride_wv, stride_cb, stride_ct, stride_sb, stride_st,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_slot_b,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROW_SCALE: tl.constexpr, HEAD_NORM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
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
    # What the epilogue reads, asked for before the main loop so that its latency hides behind it (after the loop,
    # these were one more memory round trip on the critical path of a draft layer's chain of launches).
    cos1, cos2, sin1, sin2, norm1, norm2, slot = _head_operands(
        head, rows, m_ok, j, j_ok, T, QNorm, KNorm, Cos, Sin, Slots, stride_cb, stride_ct, stride_sb, stride_st,
        stride_slot_b, Q_HEADS, KV_HEADS, HALF, HEAD_NORM)
    if ROW_SCALE:  # the input was `x * norm_weight`: the RMSNorm's per-row factor scales the projection
        scale = _row_scale(SumSq, rows, m_ok, K, eps, stride_sm, parts, BLOCK_P)[:, None]
    if HAS_BIAS:
        bias1 = tl.load(B + cols, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        bias2 = tl.load(B + cols + HALF, mask=j_ok, other=0.0).to(tl.float32)[None, :]
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
    if ROW_SCALE:
        acc1, acc2 = acc1 * scale, acc2 * scale
    if HAS_BIAS:
        acc1 += bias1
        acc2 += bias2
    _finish_head(acc1, acc2, head, h, rows, m_ok, j, j_ok, T, head_eps, cos1, cos2, sin1, sin2, norm1, norm2, slot,
                 QOut, KCache, VCache, stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb,
                 stride_vs, stride_vh, Q_HEADS, KV_HEADS, HEAD_DIM, HALF, HEAD_NORM)


@triton.jit
def _rope_write_kv(
    QKV, QNorm, KNorm, Cos, Sin, QOut, KCache, VCache, Slots, M, T, head_eps, stride_xm, stride_cb, stride_ct,
    stride_sb, stride_st, stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
    stride_vh, stride_slot_b,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HEAD_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr, USE_GDC: tl.constexpr,
):
    head = tl.program_id(0)  # queries, then keys, then values: the product's column blocks of HEAD_DIM
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rows < M
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    if head < Q_HEADS:
        h = head
    elif head < Q_HEADS + KV_HEADS:
        h = head - Q_HEADS
    else:
        h = head - Q_HEADS - KV_HEADS
    wait_for_inputs(USE_GDC, True)  # the product is the projection's output; nothing here to overlap
    ok = m_ok[:, None] & j_ok[None, :]
    first = QKV + rows[:, None] * stride_xm + head * HEAD_DIM + j[None, :]
    acc1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    acc2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    cos1, cos2, sin1, sin2, norm1, norm2, slot = _head_operands(
        head, rows, m_ok, j, j_ok, T, QNorm, KNorm, Cos, Sin, Slots, stride_cb, stride_ct, stride_sb, stride_st,
        stride_slot_b, Q_HEADS, KV_HEADS, HALF, HEAD_NORM)
    _finish_head(acc1, acc2, head, h, rows, m_ok, j, j_ok, T, head_eps, cos1, cos2, sin1, sin2, norm1, norm2, slot,
                 QOut, KCache, VCache, stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb,
                 stride_vs, stride_vh, Q_HEADS, KV_HEADS, HEAD_DIM, HALF, HEAD_NORM)


def _check_heads(name: str, batch: int, tokens: int, head_dim: int, cos, sin, q_norm, k_norm) -> None:
    if cos.shape != (batch, tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"{name}: cos and sin must be ({batch}, {tokens}, {head_dim}), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    # (one dtype: the kernel picks either pointer at run time, and a compiled kernel's branches need one type)
    if (q_norm is None) != (k_norm is None) or any(
            w is not None and (w.shape != (head_dim,) or w.stride(-1) != 1) for w in (q_norm, k_norm)) or (
            q_norm is not None and (q_norm.dtype, q_norm.device) != (k_norm.dtype, k_norm.device)):
        got = [None if w is None else (tuple(w.shape), w.dtype) for w in (q_norm, k_norm)]
        raise ValueError(f"{name}: q_norm and k_norm must both be contiguous ({head_dim},) head norm weights of one "
                         f"dtype, or both None; got {got}")


def _row_block(rows: int) -> int:
    """Rows per program of either launch (a program per head and row block): no wider than the rows need."""
    return min(_launch.LINEAR_TUNING["qkv_rope"]["block_m"], max(16, triton.next_power_of_2(rows)))


def _stages(rows: int) -> int:
    """Pipeline stages of `qkv_rope_write`: a tall launch (more than `_launch.LINEAR_TALL_ROWS` rows) may take its
    own, for more programs per SM (the stages change when a tile's loads are issued, not the order of any sum)."""
    setting = _launch.LINEAR_TUNING["qkv_rope"]
    tall = rows > _launch.LINEAR_TALL_ROWS and setting.get("tall_num_stages", 0)
    return tall or setting["num_stages"]


def _cache_strides(q, k_cache, v_cache, slots) -> tuple:
    return (q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), slots.stride(0))


def qkv_rope_write(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, bq, bk, bv,
                   cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int, row_sumsq=None,
                   eps: float = 0.0, q_norm=None, k_norm=None, head_eps: float = 0.0) -> torch.Tensor:
    """Project `x` `(B, T, K)` with `wq`, `wk`, `wv` (and biases `bq`, `bk`, `bv`, or None), rotate the queries and
    keys by `cos`, `sin` `(B, T, D)`, write the keys and values of token `t` of row `b` into slot `slots[b, t]` of the
    `(B, S, Hkv, D)` caches (in place) and return the rotated queries `(B, T, Hq, D)`. With `row_sumsq` `(B * T, P)`
    (`linear_ops.linear_residual_norm`'s), `x` is an RMSNorm's input times its weight and the norm's row factor scales
    the projections before their biases (`linear.gated_linear` explains). With `q_norm` and `k_norm` `(D,)`, each
    query and key head is RMS-normalised (epsilon `head_eps`) and scaled by them before its rotation (Qwen3)."""
    batch, tokens, width = x.shape
    if head_dim % 2 or wq.shape != (q_heads * head_dim, width) or wk.shape != (kv_heads * head_dim, width) \
            or wv.shape != wk.shape:
        raise ValueError(f"qkv_rope_write: weights ({q_heads} x {head_dim}, {width}) and twice ({kv_heads} x "
                         f"{head_dim}, {width}) with an even head_dim, got {[tuple(w.shape) for w in (wq, wk, wv)]}")
    _check_heads("qkv_rope_write", batch, tokens, head_dim, cos, sin, q_norm, k_norm)
    if any(t.stride(-1) != 1 for t in (x, wq, wk, wv, cos, sin, slots, k_cache, v_cache)):
        raise ValueError("qkv_rope_write: every tensor needs a contiguous last dimension")
    check_row_sumsq("qkv_rope_write", row_sumsq, batch * tokens)
    has_bias = bq is not None
    x2 = x.reshape(batch * tokens, width)
    sumsq = row_sumsq if row_sumsq is not None else x2[:, :1]  # (unread without the row scale)
    q = _launch.empty(batch, tokens, q_heads, head_dim, dtype=x.dtype, device=x.device)
    setting = _launch.LINEAR_TUNING["qkv_rope"]
    block_m = _row_block(batch * tokens)
    half = head_dim // 2
    _qkv_rope_write[(q_heads + 2 * kv_heads, triton.cdiv(batch * tokens, block_m))](
        x2, wq, wk, wv, *((bq, bk, bv) if has_bias else (x2, x2, x2)),
        *((q_norm, k_norm) if q_norm is not None else (x2, x2)), cos, sin, q, k_cache, v_cache, slots, sumsq,
        batch * tokens, width, tokens, float(eps), float(head_eps), sumsq.shape[1], x2.stride(0), sumsq.stride(0),
        wq.stride(0), wk.stride(0), wv.stride(0), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        *_cache_strides(q, k_cache, v_cache, slots),
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, HALF=half, HAS_BIAS=has_bias,
        ROW_SCALE=row_sumsq is not None, HEAD_NORM=q_norm is not None,
        BLOCK_P=max(2, triton.next_power_of_2(sumsq.shape[1])), BLOCK_M=block_m,
        BLOCK_HALF=max(16, triton.next_power_of_2(half)), BLOCK_K=setting["block_k"],
        PRECISION=_launch.dot_precision(x.dtype), USE_GDC=_launch.pdl(x.device),
        EARLY_TRIGGER=_launch.pdl_option(x.device, "early_trigger"),
        PREFETCH=_launch.prefetch_weights(x.device, (wq, wk, wv)),
        K_LINES=lines(width, wq.element_size()),
        num_warps=setting["num_warps"], num_stages=_stages(batch * tokens), **_launch.pdl_launch(x.device),
    )
    return q


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int,
                  q_norm=None, k_norm=None, head_eps: float = 0.0) -> torch.Tensor:
    """`qkv_rope_write` after its projection: `qkv` `(B, T, (Hq + 2 Hkv) * D)` is one forward's queries, keys and
    values (`linear_ops.qkv_linear`'s product). Normalises the query and key heads (with `q_norm`, `k_norm`), rotates
    them, writes the keys and values at `slots` and returns the queries `(B, T, Hq, D)`."""
    batch, tokens, width = qkv.shape
    if head_dim % 2 or width != (q_heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"rope_write_kv: qkv must hold {q_heads} + 2 x {kv_heads} heads of an even head_dim "
                         f"{head_dim}, got width {width}")
    _check_heads("rope_write_kv", batch, tokens, head_dim, cos, sin, q_norm, k_norm)
    if any(t.stride(-1) != 1 for t in (qkv, cos, sin, slots, k_cache, v_cache)):
        raise ValueError("rope_write_kv: every tensor needs a contiguous last dimension")
    x2 = qkv.reshape(batch * tokens, width)
    q = _launch.empty(batch, tokens, q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    setting = _launch.LINEAR_TUNING["qkv_rope"]
    block_m = _row_block(batch * tokens)
    half = head_dim // 2
    _rope_write_kv[(q_heads + 2 * kv_heads, triton.cdiv(batch * tokens, block_m))](
        x2, *((q_norm, k_norm) if q_norm is not None else (x2, x2)), cos, sin, q, k_cache, v_cache, slots,
        batch * tokens, tokens, float(head_eps), x2.stride(0), cos.stride(0), cos.stride(1), sin.stride(0),
        sin.stride(1), *_cache_strides(q, k_cache, v_cache, slots),
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, HALF=half, HEAD_NORM=q_norm is not None,
        BLOCK_M=block_m, BLOCK_HALF=max(16, triton.next_power_of_2(half)), USE_GDC=_launch.pdl(qkv.device),
        num_warps=setting["num_warps"], **_launch.pdl_launch(qkv.device),
    )
    return q
