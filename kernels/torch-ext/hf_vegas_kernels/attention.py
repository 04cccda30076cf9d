"""Split-K ("flash-decoding") attention over a per-row list of cache slots, for a few query rows per sequence.

One kernel serves three ops of `hf_vegas.ops.reference`:

- sparse draft attention: the list is `sel_idx[b, :sel_count[b]]` followed by the tail `[sel_end[b], kv_len[b])`;
- verification / dense decode attention: the list is `[tail_start[b], kv_len[b])` (`tail_start` is 0, or the
  start of the sliding window), optionally emitting the Collect-2-Query logits of chosen query rows;
- both causal per query row (`slot <= q_slot[b, t]`), and windowed for sliding layers.

A program owns one (split, row, KV head) and all `groups * T` query rows that share that KV head (GQA), so each
key and value it gathers is read once for all of them. Partial softmax states go to fp32 scratch and
`_combine_splits` merges them; it also returns the log-sum-exp, which turns emitted logits into softmax weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch

# Emission modes: none, logits summed over the query heads of a KV head, logits per query head.
EMIT_NONE, EMIT_GROUP_SUM, EMIT_PER_HEAD = 0, 1, 2


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _attend_list(
    Q, K, V, QSlot, KvLen, SelIdx, SelCount, TailStart, ScoreRows, MPart, LPart, OPart, Emit,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_sb, stride_eb, stride_er, stride_eh,
    T, chunk, scaling, softcap, window,
    KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPARSE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    EMIT: tl.constexpr, NUM_SCORE_ROWS: tl.constexpr, PRECISION: tl.constexpr,
):
    split = tl.program_id(0)
    row_head = tl.program_id(1)
    num_splits = tl.num_programs(0)
    b = row_head // KV_HEADS
    kvh = row_head % KV_HEADS

    m = tl.arange(0, BLOCK_M)  # query row m = t * GROUPS + g: token t, query head kvh * GROUPS + g
    t = m // GROUPS
    g = m % GROUPS
    row_ok = t < T
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + b * stride_qb + (kvh * GROUPS + g)[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :],
        mask=row_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0,
    )
    q_slot = tl.load(QSlot + b * T + t, mask=row_ok, other=-1)

    kv_len = tl.load(KvLen + b)
    tail_start = tl.load(TailStart + b)
    n = tl.maximum(kv_len - tail_start, 0)
    if SPARSE:
        count = tl.load(SelCount + b)
        n += count
    start = split.to(tl.int64) * chunk
    # The last split runs to the end of the list, so a too-small length hint costs balance, never tokens.
    end = tl.where(split == num_splits - 1, n, tl.minimum(start + chunk, n))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for p0 in range(start, end, BLOCK_N):
        p = p0 + tl.arange(0, BLOCK_N)
        in_list = p < end
        if SPARSE:
            chosen = p < count
            picked = tl.load(SelIdx + b * stride_sb + p, mask=in_list & chosen, other=0)
            slot = tl.where(chosen, picked, tail_start + p - count)
        else:
            slot = tail_start + p
        k = tl.load(
            K + b * stride_kb + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
            mask=in_list[:, None] & (d[None, :] < HEAD_DIM), other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling
        if HAS_SOFTCAP:
            s = _tanh(s / softcap) * softcap
        if EMIT == 1:  # logits summed over the KV head's query heads, per scored token row
            for r in tl.static_range(NUM_SCORE_ROWS):
                t_r = tl.load(ScoreRows + r)
                emitted = tl.sum(tl.where((t == t_r)[:, None], s, 0.0), axis=0)
                tl.store(Emit + b * stride_eb + r * stride_er + kvh * stride_eh + slot, emitted, mask=in_list)
        if EMIT == 2:  # logits of every query head: softmax weights need each head's own log-sum-exp
            for r in tl.static_range(NUM_SCORE_ROWS):
                t_r = tl.load(ScoreRows + r)
                for gg in tl.static_range(GROUPS):
                    emitted = tl.sum(tl.where((m == t_r * GROUPS + gg)[:, None], s, 0.0), axis=0)
                    head = kvh * GROUPS + gg
                    tl.store(Emit + b * stride_eb + r * stride_er + head * stride_eh + slot, emitted, mask=in_list)
        visible = in_list[None, :] & (slot[None, :] <= q_slot[:, None])
        if HAS_WINDOW:
            visible = visible & (slot[None, :] > q_slot[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet stay at zero
        alpha = tl.exp(m_i - m_safe)
        probs = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(probs, axis=1)
        v = tl.load(
            V + b * stride_vb + slot[:, None] * stride_vs + kvh * stride_vh + dv[None, :],
            mask=in_list[:, None] & (dv[None, :] < V_DIM), other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    part = (row_head * num_splits + split) * BLOCK_M + m
    tl.store(MPart + part, m_i)
    tl.store(LPart + part, l_i)
    tl.store(OPart + part[:, None] * BLOCK_DV + dv[None, :], acc)


@triton.jit
def _combine_splits(
    MPart, LPart, OPart, Out, Lse, num_splits,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    T, KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    row_head = tl.program_id(0)
    b = row_head // KV_HEADS
    kvh = row_head % KV_HEADS
    m = tl.arange(0, BLOCK_M)
    dv = tl.arange(0, BLOCK_DV)
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for split in range(num_splits):
        part = (row_head * num_splits + split) * BLOCK_M + m
        m_s = tl.load(MPart + part)
        l_s = tl.load(LPart + part)
        o_s = tl.load(OPart + part[:, None] * BLOCK_DV + dv[None, :])
        m_new = tl.maximum(m_run, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        old, new = tl.exp(m_run - m_safe), tl.exp(m_s - m_safe)
        l_run = l_run * old + l_s * new
        acc = acc * old[:, None] + o_s * new[:, None]
        m_run = m_new
    t = m // GROUPS
    head = kvh * GROUPS + m % GROUPS
    row_ok = t < T
    seen = l_run > 0  # a padding query row sees nothing: zero output, log-sum-exp -inf
    out = acc / tl.where(seen, l_run, 1.0)[:, None]
    tl.store(
        Out + b * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :],
        out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < V_DIM),
    )
    lse = tl.where(seen, m_run + tl.log(tl.where(seen, l_run, 1.0)), float("-inf"))
    tl.store(Lse + b * stride_lb + t * stride_lt + head, lse, mask=row_ok)


def _num_splits(list_len: int, programs: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """(splits, chunk): enough programs to fill the GPU about four times, each chunk a multiple of the block."""
    blocks = max(triton.cdiv(max(list_len, 1), block_n), 1)
    want = max(triton.cdiv(4 * _launch.device_sm_count(device), programs), 1)
    splits = min(want, blocks)
    chunk = triton.cdiv(blocks, splits) * block_n
    return triton.cdiv(blocks * block_n, chunk), chunk


def attend(
    q, k_cache, v_cache, q_slot, kv_len, scaling: float, *, tail_start, list_len: int,
    sel_idx=None, sel_count=None, softcap=None, window=None, score_rows=None, emit: int = EMIT_NONE,
):
    """Attention of `q` `(B, Hq, T, D)` over each row's slot list. Returns `(out (B, T, Hq, Dv), lse (B, T, Hq),
    emitted)`; `emitted` is `(B, R, heads, S)` fp32 logits of the `score_rows` (R of them), indexed by slot, or None.

    `list_len` is a host-side bound on the list length used to size the splits (a wrong bound is only slower).
    """
    batch, q_heads, num_tokens, head_dim = q.shape
    _, num_slots, kv_heads, _ = k_cache.shape
    v_dim = v_cache.shape[-1]
    groups = q_heads // kv_heads
    block_m = max(16, triton.next_power_of_2(groups * num_tokens))
    block_d, block_dv = triton.next_power_of_2(head_dim), triton.next_power_of_2(v_dim)
    block_n = 64 if max(block_d, block_dv) <= 128 else 32
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("attend: the cache's last dimension must be contiguous")
    q = q if q.stride(-1) == 1 else q.contiguous()
    device = q.device
    splits, chunk = _num_splits(list_len, batch * kv_heads, block_n, device)

    f32 = {"dtype": torch.float32, "device": device}
    m_part = _launch.empty(batch * kv_heads * splits * block_m, **f32)
    l_part = _launch.empty(batch * kv_heads * splits * block_m, **f32)
    o_part = _launch.empty(batch * kv_heads * splits * block_m * block_dv, **f32)
    sparse = sel_idx is not None
    if emit != EMIT_NONE:
        heads = kv_heads if emit == EMIT_GROUP_SUM else q_heads
        emitted = _launch.empty(batch, score_rows.numel(), heads, num_slots, **f32)
        rows = score_rows
    else:
        emitted, rows = m_part, q_slot  # unused placeholders: the kernel never touches them
    _attend_list[(splits, batch * kv_heads)](
        q, k_cache, v_cache, q_slot.contiguous(), kv_len, sel_idx if sparse else kv_len,
        sel_count if sparse else kv_len, tail_start, rows, m_part, l_part, o_part, emitted,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        sel_idx.stride(0) if sparse else 0,
        *(emitted.stride()[:3] if emit != EMIT_NONE else (0, 0, 0)),
        num_tokens, chunk, float(scaling), float(softcap or 1.0), int(window or 0),
        KV_HEADS=kv_heads, GROUPS=groups, HEAD_DIM=head_dim, V_DIM=v_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        SPARSE=sparse, HAS_SOFTCAP=softcap is not None, HAS_WINDOW=window is not None,
        EMIT=emit, NUM_SCORE_ROWS=rows.numel() if emit != EMIT_NONE else 0,
        PRECISION=_launch.dot_precision(q.dtype), num_warps=4, num_stages=2,
    )
    out = _launch.empty(batch, num_tokens, q_heads, v_dim, dtype=q.dtype, device=device)
    lse = _launch.empty(batch, num_tokens, q_heads, **f32)
    _combine_splits[(batch * kv_heads,)](
        m_part, l_part, o_part, out, lse, splits,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        num_tokens, KV_HEADS=kv_heads, GROUPS=groups, V_DIM=v_dim, BLOCK_M=block_m, BLOCK_DV=block_dv,
        num_warps=4,
    )
    return out, lse, (emitted if emit != EMIT_NONE else None)
