"""Split-K ("flash-decoding") attention over a per-row list of cache slots, for a few query rows per sequence.

One kernel serves three ops of the contract (`naive.py`):

- sparse draft attention: the list is `sel_idx[b, :sel_count[b]]` followed by the tail `[sel_end[b], kv_len[b])`;
- verification / dense decode attention: the list is `[tail_start[b], kv_len[b])` (`tail_start` None for 0, or
  the start of the sliding window), optionally emitting the Collect-2-Query logits of chosen query rows;
- both causal per query row (`slot <= q_slot[b, t]`), and windowed for sliding layers;
- a row of length 0 reads nothing (not even its selection) and gets zeros: the generation loop gives finished rows
  length 0 here.

A program owns one (split, row, KV head) and all `groups * T` query rows that share that KV head (GQA), so each
key and value it gathers is read once for all of them. How lists are split over programs and how the splits'
softmax states merge (in the kernel or by a combine launch) is `attention_splits.py`; the merge also returns the
log-sum-exp, which turns emitted logits into softmax weights. Where one split per (row, KV head) already fills the
GPU (a short draft list at a large batch), the program writes the output and log-sum-exp itself and the combine
launch is skipped (`waves` 0 in `_launch.TUNING`).

Score emission is a second, small product per tile: `emit_q @ k^T`, whose rows are exactly what is stored, so no
tile row has to be extracted by a cross-warp reduction. Without a soft cap, logits are linear in the query, so the
sum over a KV head's query heads is one row, `(sum_g q_g) @ k^T` (mode "group sum"); softmax weights and soft-capped
logits need each head's own row (mode "per head").

A verification's tile (7 tokens x the group's query heads) makes the softmax's elementwise work show past the loads,
so it is kept small: the states are in base 2 (one multiply by scale x log2(e), fused with the max's subtraction,
then exp2), and the blocks that every query row sees whole skip the visibility and list masks. At SmolLM2's shape,
64 x 7.5K on an H200, that took a verification's attention from 118 to 107 us per layer (137 to 118 with per-head
emission) and left the dense one at 98 (`benchmarks/RESULTS.md`, stop 48).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._pdl import release_dependents, wait_for_inputs
# (`attend` calls `_num_splits` by this module's name for it: tests that count splits patch `attention._num_splits`)
from .attention_splits import LOG2E, _num_splits, _split_state_out, _write_result, merge_splits

# Emission modes: none, logits summed over the query heads of a KV head, logits per query head.
EMIT_NONE, EMIT_GROUP_SUM, EMIT_PER_HEAD = 0, 1, 2


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _attend_list(
    Q, K, V, QSlot, KvLen, SelIdx, SelCount, TailStart, ScoreRows, MPart, LPart, OPart, Emit, Out, Lse, Sinks,
    Tickets, stride_qb, stride_qh, stride_qt,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_sb, stride_eb, stride_er, stride_eh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    T, chunk, scaling, softcap, window,
    KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPARSE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    EMIT: tl.constexpr, EMIT_HALF: tl.constexpr, NUM_SCORE_ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
    PRECISION: tl.constexpr,
    SINGLE: tl.constexpr, HAS_SINKS: tl.constexpr, FUSED_COMBINE: tl.constexpr, USE_GDC: tl.constexpr,
    EARLY_TRIGGER: tl.constexpr, HAS_TAIL_START: tl.constexpr, BALANCE: tl.constexpr, OFFSETS_32: tl.constexpr,
):
    split = tl.program_id(0)
    row_head = tl.program_id(1)
    num_splits = tl.num_programs(0)
    b = (row_head // KV_HEADS).to(tl.int64)  # b * stride_kb passes 2**31 elements in large caches
    kvh = row_head % KV_HEADS
    wait_for_inputs(USE_GDC, EARLY_TRIGGER)  # the queries are the previous kernel's output
    rows = T * GROUPS

    m = tl.arange(0, BLOCK_M)  # query row m = t * GROUPS + g: token t, query head kvh * GROUPS + g
    t = m // GROUPS
    g = m % GROUPS
    row_ok = m < rows
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_base = Q + b * stride_qb + kvh * GROUPS * stride_qh
    q = tl.load(q_base + g[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :],
                mask=row_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    q_slot = tl.load(QSlot + b * T + t, mask=row_ok, other=-1)

    if EMIT != 0:
        e = tl.arange(0, BLOCK_E)
        if EMIT == 1:  # row e = score row r: the sum of the KV head's query heads
            e_ok = e < NUM_SCORE_ROWS
            t_e = tl.load(ScoreRows + e, mask=e_ok, other=0)
            emit_q = tl.zeros([BLOCK_E, BLOCK_D], tl.float32)
            for gg in tl.static_range(GROUPS):
                emit_q += tl.load(q_base + gg * stride_qh + t_e[:, None] * stride_qt + d[None, :],
                                  mask=e_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0).to(tl.float32)
            e_row = e
            e_head = tl.zeros([BLOCK_E], tl.int32) + kvh
        else:  # row e = (score row r, head g): each query head on its own
            e_ok = e < NUM_SCORE_ROWS * GROUPS
            t_e = tl.load(ScoreRows + e // GROUPS, mask=e_ok, other=0)
            emit_q = tl.load(q_base + (e % GROUPS)[:, None] * stride_qh + t_e[:, None] * stride_qt + d[None, :],
                             mask=e_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0).to(tl.float32)
            e_row = e // GROUPS
            e_head = kvh * GROUPS + e % GROUPS
        # In the cache's dtype, like the attention product itself: a second fp32 copy of every key tile would cost
        # registers and occupancy. (Group sums are rounded once more: the selection's ranking tolerates it.)
        emit_q = emit_q.to(Q.dtype.element_ty)
        emit_base = Emit + b * stride_eb + e_row[:, None] * stride_er + e_head[:, None] * stride_eh

    kv_len = tl.load(KvLen + b)
    if HAS_TAIL_START:
        tail_start = tl.load(TailStart + b)
    else:
        tail_start = kv_len * 0
    n = tl.maximum(kv_len - tail_start, 0)
    if SPARSE:
        count = tl.load(SelCount + b)
        n += tl.where(kv_len > 0, count, 0)  # a finished row (`StepPlan.attend_lengths` 0) reads nothing
    if BALANCE:  # this row's own list over the splits, in whole blocks: a list shorter than the hint's fills them all
        row_chunk = tl.cdiv(tl.cdiv(n, BLOCK_N), num_splits) * BLOCK_N
    else:
        row_chunk = chunk
    start = split.to(tl.int64) * row_chunk
    # The last split runs to the end of the list, so a too-small length hint costs balance, never tokens.
    end = tl.where(split == num_splits - 1, n, tl.minimum(start + row_chunk, n))

    # Softmax states in base 2 (`m_i` the running max of `logit * log2(e)`): the scale and log2(e) are one multiply,
    # fused with the max's subtraction, before the exp2 the GPU runs anyway.
    if HAS_SOFTCAP:
        qk_scale = LOG2E
    else:
        qk_scale = scaling * LOG2E
    # Blocks that every query row sees whole (up to and including the smallest real query slot, inside this split's
    # share of the list: in a dense or verification step every block but the one or two at the queries) skip the
    # visibility and list masks: in a verification of 7 tokens the softmax's elementwise work, not the loads, is
    # what shows (`benchmarks/RESULTS.md`). A row's result does not depend on where the boundary falls: a whole
    # block computes the same values in either phase (`test_unmasked_blocks_round_as_masked_ones`). Sparse and
    # windowed lists mask every block.
    if SPARSE or HAS_WINDOW:
        full_end = start
    else:
        q_min = tl.min(tl.where(row_ok, q_slot, kv_len), axis=0)
        seen_end = tl.minimum(end, q_min + 1 - tail_start)  # list positions every query row sees
        full_end = start + tl.maximum(seen_end - start, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for phase in tl.static_range(2):  # 0: whole blocks, no mask; 1: the rest, masked
        if phase == 0:
            lo, hi = start, full_end
        else:
            lo, hi = full_end, end
        for p0 in range(lo, hi, BLOCK_N):
            p = p0 + tl.arange(0, BLOCK_N)
            in_list = p < end
            if SPARSE:
                chosen = p < count
                picked = tl.load(SelIdx + b * stride_sb + p, mask=in_list & chosen, other=0)
                slot = tl.where(chosen, picked, tail_start + p - count)
            else:
                slot = tail_start + p
            if phase == 0:  # a whole block: every slot is in the list (a constant mask, folded away)
                listed = tl.full([BLOCK_N], 1, tl.int1)
            else:
                listed = in_list
            # Offsets inside a row's cache in int32 where they fit (`OFFSETS_32`): 64-bit offset tiles cost a gather's
            # address arithmetic and registers (the per-head emission's verification spilled 96 bytes at sm_90, 8
            # with these). SmolLM2 64 x 7.5K, H100: a draft layer's attention 17.8 -> 14.8 us, the verification with
            # per-head logits 150.7 -> 147.5 (`kernel_bandwidth.py`, benchmarks/RESULTS.md stop 52). The head's
            # offset is 64-bit: a (B, H, S, D) view's head stride times the head can pass 2**31 on its own.
            row_slot = slot.to(tl.int32) if OFFSETS_32 else slot
            k = tl.load(K + b * stride_kb + kvh.to(tl.int64) * stride_kh
                        + (row_slot[:, None] * stride_ks + d[None, :]),
                        mask=listed[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            if HAS_SOFTCAP:
                s = _tanh(s * scaling / softcap) * softcap
            if EMIT != 0:
                emitted = tl.dot(emit_q, tl.trans(k), input_precision=PRECISION) * scaling
                if HAS_SOFTCAP:
                    emitted = _tanh(emitted / softcap) * softcap
                if EMIT_HALF:  # fp16 holds +-65504: a larger logit is saturated, not made infinite
                    emitted = tl.minimum(tl.maximum(emitted, -65504.0), 65504.0)
                tl.store(emit_base + slot[None, :], emitted.to(Emit.dtype.element_ty),
                         mask=e_ok[:, None] & in_list[None, :])
            if phase == 0:
                m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
                m_safe = m_new
            else:
                visible = in_list[None, :] & (slot[None, :] <= q_slot[:, None])
                if HAS_WINDOW:
                    visible = visible & (slot[None, :] > q_slot[:, None] - window)
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet stay at zero
            alpha = tl.math.exp2(m_i - m_safe)
            probs = tl.math.exp2(s * qk_scale - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(probs, axis=1)
            v = tl.load(V + b * stride_vb + kvh.to(tl.int64) * stride_vh
                        + (row_slot[:, None] * stride_vs + dv[None, :]),
                        mask=listed[:, None] & (dv[None, :] < V_DIM), other=0.0)
            acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
    release_dependents(USE_GDC, EARLY_TRIGGER)

    out_ptr = Out + b * stride_ob + t[:, None] * stride_ot + (kvh * GROUPS + g)[:, None] * stride_oh + dv[None, :]
    lse_ptr = Lse + b * stride_lb + t * stride_lt + kvh * GROUPS + g
    if SINGLE:  # one split: the program owns the whole list and writes the result itself (no combine launch)
        _write_result(Sinks, kvh * GROUPS + g, row_ok, m_i, l_i, acc, out_ptr, lse_ptr, V_DIM, BLOCK_DV, HAS_SINKS)
        return
    _split_state_out(MPart, LPart, OPart, Tickets, Sinks, row_head, split, num_splits, rows, m, row_ok, m_i, l_i, acc,
                     kvh * GROUPS + g, out_ptr, lse_ptr, V_DIM, BLOCK_M, BLOCK_DV, HAS_SINKS, FUSED_COMBINE)


def _row_offsets_fit_int32(k_cache, v_cache) -> bool:
    """Whether every element offset inside one row of the caches (`(B, S, H, D)`, last dim contiguous) fits int32."""
    return all((c.shape[1] - 1) * c.stride(1) + (c.shape[2] - 1) * c.stride(2) + c.shape[3] < 2**31
               for c in (k_cache, v_cache))


def emit_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """The dtype of emitted logits: fp16 for half-precision queries, else fp32 (exact, as the reference). Emission
    is the largest write of a verification (SmolLM2 at 64 x 7.5K, softmax-weight scores: 36 MB per layer in fp32),
    and its ranking needs no more than fp16's 11 bits (bf16's 8 would move weights by up to ~10 %)."""
    return torch.float16 if q_dtype in (torch.float16, torch.bfloat16) else torch.float32


def attend(
    q, k_cache, v_cache, q_slot, kv_len, scaling: float, *, tail_start, list_len: int,
    sel_idx=None, sel_count=None, softcap=None, window=None, score_rows=None, emit: int = EMIT_NONE, sinks=None,
    split_len: int | None = None,
):
    """Attention of `q` `(B, Hq, T, D)` over each row's slot list (from `tail_start` `(B,)`, or from slot 0 where
    it is None: no zero-filled tensor, whose fill would be a launch of its own in every layer). Returns
    `(out (B, T, Hq, Dv), lse (B, T, Hq), emitted)`; `emitted` is `(B, R, heads, S)` logits of the `score_rows`
    (R of them), indexed by slot, or None, in `emit_dtype(q.dtype)`.
    `sinks` `(Hq,)`: one logit per query head in each softmax's denominator (the log-sum-exp includes it).

    `list_len` is a host-side bound on the list length used to size the splits (a wrong bound is only slower).
    """
    if not scaling > 0:  # the kernel scales after masking: a zero scale would turn masked logits into NaN
        raise ValueError(f"attend: scaling must be positive, got {scaling}")
    if sel_idx is not None and tail_start is None:
        raise ValueError("attend: a sparse list needs tail_start (each row's selection end), got None")
    if emit == EMIT_GROUP_SUM and softcap is not None:
        raise ValueError("attend: a soft cap is not linear in the query; emit per head (EMIT_PER_HEAD) instead")
    batch, q_heads, num_tokens, head_dim = q.shape
    _, num_slots, kv_heads, _ = k_cache.shape
    v_dim = v_cache.shape[-1]
    groups = q_heads // kv_heads
    rows = groups * num_tokens
    block_m = max(16, triton.next_power_of_2(rows))
    block_d, block_dv = triton.next_power_of_2(head_dim), triton.next_power_of_2(v_dim)
    sparse = sel_idx is not None
    if sparse:
        kind = "sparse_wide_head" if block_d >= 128 else "sparse"
    else:  # head_dim 128 lists over many (row, KV head) pairs take settings of their own (`_launch.TUNING`)
        wide = block_d >= 128 and batch * kv_heads >= 32
        kind = ("dense" if num_tokens == 1 else "verify") + ("_wide_head" if wide else "")
    tuning = _launch.TUNING[kind]
    block_n = tuning["block_n"] if max(block_d, block_dv) <= 128 else 32
    stages = tuning["num_stages"]
    if q.element_size() > 2:  # fp32 tiles are twice as large: the half-precision settings may not fit in shared memory
        block_n, stages = min(block_n, 64), min(stages, 2)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("attend: the cache's last dimension must be contiguous")
    q = q if q.stride(-1) == 1 else q.contiguous()
    device = q.device
    splits, chunk = _num_splits(list_len, batch * kv_heads, block_n, tuning["waves"], device,
                                tuning.get("nearest", False), split_len, tuning.get("fill", 0.0))

    f32 = {"dtype": torch.float32, "device": device}
    out = _launch.empty(batch, num_tokens, q_heads, v_dim, dtype=q.dtype, device=device)
    lse = _launch.empty(batch, num_tokens, q_heads, **f32)
    # Sparse drafts of one split write their result in the kernel (measured faster, `_launch.TUNING`); other kinds keep
    # the combine, whose epilogue needs no extra shared memory in the main kernel.
    single = splits == 1 and sparse
    # Several splits: the last one of each (row, KV head) merges them in the kernel where the tuning says so and they
    # are few (its merge loop is sequential), else the combine launch does.
    fused = (not single and tuning.get("fused_combine", False)
             and splits <= tuning.get("fused_combine_max_splits", _launch.FUSED_COMBINE_MAX_SPLITS))
    parts = 1 if single else batch * kv_heads * splits * rows  # split states, for the combine
    m_part = _launch.empty(parts, **f32)
    l_part = _launch.empty(parts, **f32)
    o_part = _launch.empty(parts * v_dim, **f32)
    emitting = emit != EMIT_NONE
    if emitting:
        heads = kv_heads if emit == EMIT_GROUP_SUM else q_heads
        emitted = _launch.empty(batch, score_rows.numel(), heads, num_slots, dtype=emit_dtype(q.dtype), device=device)
        score_rows_or_any = score_rows
        emit_rows = score_rows.numel() * (1 if emit == EMIT_GROUP_SUM else groups)
    else:
        emitted, score_rows_or_any, emit_rows = lse, q_slot, 1  # unused: the kernel never touches them
    if sinks is not None:
        if sinks.shape != (q_heads,):
            raise ValueError(f"attend: sinks must hold one logit per query head, shape ({q_heads},), "
                             f"got {tuple(sinks.shape)}")
        sinks = sinks.to(device=device, dtype=torch.float32).contiguous()
    _attend_list[(splits, batch * kv_heads)](
        q, k_cache, v_cache, q_slot.contiguous(), kv_len, sel_idx if sparse else kv_len,
        sel_count if sparse else kv_len, tail_start if tail_start is not None else kv_len, score_rows_or_any,
        m_part, l_part, o_part, emitted, out, lse,
        sinks if sinks is not None else lse, _launch.tickets(batch * kv_heads, device) if fused else lse,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        sel_idx.stride(0) if sparse else 0,
        *(emitted.stride()[:3] if emitting else (0, 0, 0)),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        num_tokens, chunk, float(scaling), float(softcap or 1.0), int(window or 0),
        KV_HEADS=kv_heads, GROUPS=groups, HEAD_DIM=head_dim, V_DIM=v_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        SPARSE=sparse, HAS_SOFTCAP=softcap is not None, HAS_WINDOW=window is not None,
        EMIT=emit, EMIT_HALF=emitted.dtype == torch.float16, NUM_SCORE_ROWS=score_rows.numel() if emitting else 0,
        BLOCK_E=max(16, triton.next_power_of_2(emit_rows)), PRECISION=_launch.dot_precision(q.dtype),
        SINGLE=single, HAS_SINKS=sinks is not None, FUSED_COMBINE=fused, USE_GDC=_launch.pdl(device),
        EARLY_TRIGGER=_launch.pdl_option(device, "early_trigger"), HAS_TAIL_START=tail_start is not None,
        BALANCE=sparse and bool(tuning.get("balance", False)),
        OFFSETS_32=_row_offsets_fit_int32(k_cache, v_cache),
        num_warps=tuning["num_warps"], num_stages=stages, **_launch.pdl_launch(device),
    )
    if single or fused:
        return out, lse, (emitted if emitting else None)
    merge_splits(m_part, l_part, o_part, out, lse, sinks, splits, num_tokens, kv_heads, groups)
    return out, lse, (emitted if emitting else None)
