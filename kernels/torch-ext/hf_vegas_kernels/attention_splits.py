"""How the attention kernel (`attention.py`) spreads a list over programs, and how their softmax states merge.

A (row, KV head) pair's list is cut into `splits` chunks of whole blocks, one program each (`_num_splits`: enough
programs to fill the GPU the number of times `_launch.TUNING` asks). A split's state is `(max, sum, unnormalised
output)` per query row, in base 2 (the max is of `logit * log2(e)`; `LOG2E`): the kernel takes exp2 of scaled
logits, so the states merge with exp2 too, and the log-sum-exp leaves in natural units (`_write_result`). A sparse
draft of one split writes its result itself; other launches store their states to fp32 scratch, and either the last
of a pair's splits to finish merges them in the kernel (`fused_combine`: an atomic ticket per pair) or
`merge_splits` launches `_combine_splits`, parallel over query rows and vectorised over splits. Sinks (gpt-oss) join
the merged state's sum once, before it is normalised.

(Not to be confused with `benchmarks/attention_splits.py`, which times the launches at forced split counts.)
"""

from __future__ import annotations

import functools
import math

import triton
import triton.language as tl

from . import _launch

# Softmax states (split maxima, log-sum-exp before it is returned) are kept in base 2: x * LOG2E = x / ln 2.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _write_result(Sinks, head, ok, m_i, l_i, acc, out_ptr, lse_ptr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
                  HAS_SINKS: tl.constexpr):
    """Normalise a base-2 softmax state `(max, sum, unnormalised output)` and store the output and the natural
    log-sum-exp."""
    if HAS_SINKS:
        m_i, l_i, acc = _with_sinks(Sinks, head, ok, m_i, l_i, acc)
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    dv = tl.arange(0, BLOCK_DV)
    tl.store(out_ptr, out.to(out_ptr.dtype.element_ty), mask=ok[:, None] & (dv[None, :] < V_DIM))
    tl.store(lse_ptr, tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf")), mask=ok)


@triton.jit
def _with_sinks(Sinks, head, ok, m_i, l_i, acc):
    """Fold each query head's sink logit into a base-2 softmax state `(max, sum, unnormalised output)`: it joins the
    sum and adds nothing to the output (gpt-oss' attention sinks). A row that saw no slot keeps a zero output."""
    sink = tl.load(Sinks + head, mask=ok, other=0.0).to(tl.float32) * LOG2E
    top = tl.maximum(m_i, sink)
    scale = tl.where(m_i == float("-inf"), 0.0, tl.math.exp2(m_i - top))
    return top, l_i * scale + tl.math.exp2(sink - top), acc * scale[:, None]


@triton.jit
def _split_state_out(MPart, LPart, OPart, Tickets, Sinks, row_head, split, num_splits, rows, m, row_ok, m_i, l_i, acc,
                     head, out_ptr, lse_ptr, V_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
                     HAS_SINKS: tl.constexpr, FUSED_COMBINE: tl.constexpr):
    """Store one split's state for the merge (only real query rows); with FUSED_COMBINE, the last split of this
    (row, KV head) to finish merges all of them and writes the result, instead of a combine launch."""
    dv = tl.arange(0, BLOCK_DV)
    part = (row_head * num_splits + split) * rows + m
    tl.store(MPart + part, m_i, mask=row_ok)
    tl.store(LPart + part, l_i, mask=row_ok)
    tl.store(OPart + part[:, None] * V_DIM + dv[None, :], acc, mask=row_ok[:, None] & (dv[None, :] < V_DIM))
    if FUSED_COMBINE:
        # Every thread's stores precede the barrier, the barrier precedes the ticket's release, and the winner reads
        # the states after its acquire, past L1 (".cg": the line may hold an earlier launch's states).
        tl.debug_barrier()
        ticket = tl.atomic_add(Tickets + row_head, 1, sem="acq_rel", scope="gpu")
        if ticket == num_splits - 1:
            first = row_head * num_splits * rows + m
            top = tl.full([BLOCK_M], float("-inf"), tl.float32)
            for s in range(0, num_splits):
                top = tl.maximum(top, tl.load(MPart + first + s * rows, mask=row_ok, other=float("-inf"),
                                              cache_modifier=".cg"))
            top = tl.where(top == float("-inf"), 0.0, top)  # a row no split saw: zero output, lse -inf
            l_total = tl.zeros([BLOCK_M], tl.float32)
            merged = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
            for s in range(0, num_splits):
                w = tl.math.exp2(tl.load(MPart + first + s * rows, mask=row_ok, other=float("-inf"),
                                         cache_modifier=".cg") - top)
                l_total += tl.load(LPart + first + s * rows, mask=row_ok, other=0.0, cache_modifier=".cg") * w
                merged += tl.load(OPart + (first + s * rows)[:, None] * V_DIM + dv[None, :],
                                  mask=row_ok[:, None] & (dv[None, :] < V_DIM), other=0.0,
                                  cache_modifier=".cg") * w[:, None]
            _write_result(Sinks, head, row_ok, top, l_total, merged, out_ptr, lse_ptr, V_DIM, BLOCK_DV, HAS_SINKS)
            tl.atomic_xchg(Tickets + row_head, 0, sem="relaxed", scope="gpu")  # zero again for the next launch


@triton.jit
def _combine_splits(
    MPart, LPart, OPart, Out, Lse, Sinks, num_splits,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    T, KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, V_DIM: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr, SPLIT_BLOCK: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    if USE_GDC:  # programmatic dependent launch (`_launch.pdl`): the split states are the previous kernel's output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # A program merges ROWS_PER_PROGRAM query rows of one (row, KV head): first the maximum over all splits, then
    # the rescaled sums, SPLIT_BLOCK splits per step so that their loads are independent of each other.
    row_head = tl.program_id(0)
    rows = T * GROUPS
    m = tl.program_id(1) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    m_ok = m < rows
    base = row_head * num_splits * rows
    top = tl.full([ROWS_PER_PROGRAM], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        sb = s0 + tl.arange(0, SPLIT_BLOCK)
        ok = (sb < num_splits)[:, None] & m_ok[None, :]
        part = base + sb[:, None] * rows + m[None, :]
        top = tl.maximum(top, tl.max(tl.load(MPart + part, mask=ok, other=float("-inf")), axis=0))
    top = tl.where(top == float("-inf"), 0.0, top)  # a padding query row sees nothing: zero output, lse -inf
    dv = tl.arange(0, BLOCK_DV)
    l_total = tl.zeros([ROWS_PER_PROGRAM], tl.float32)
    acc = tl.zeros([ROWS_PER_PROGRAM, BLOCK_DV], tl.float32)
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        sb = s0 + tl.arange(0, SPLIT_BLOCK)
        ok = (sb < num_splits)[:, None] & m_ok[None, :]
        part = base + sb[:, None] * rows + m[None, :]
        w = tl.math.exp2(tl.load(MPart + part, mask=ok, other=float("-inf")) - top[None, :])
        l_total += tl.sum(tl.load(LPart + part, mask=ok, other=0.0) * w, axis=0)
        o = tl.load(OPart + part[:, :, None] * V_DIM + dv[None, None, :],
                    mask=ok[:, :, None] & (dv[None, None, :] < V_DIM), other=0.0)
        acc += tl.sum(o * w[:, :, None], axis=0)
    b = (row_head // KV_HEADS).to(tl.int64)
    head = (row_head % KV_HEADS) * GROUPS + m % GROUPS
    t = m // GROUPS
    if HAS_SINKS:  # `top` is 0 for a row no split saw: its zero sum and output rescale to zero all the same
        top, l_total, acc = _with_sinks(Sinks, head, m_ok, top, l_total, acc)
    seen = l_total > 0
    out = acc / tl.where(seen, l_total, 1.0)[:, None]
    tl.store(Out + b * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :],
             out.to(Out.dtype.element_ty), mask=m_ok[:, None] & (dv[None, :] < V_DIM))
    tl.store(Lse + b * stride_lb + t * stride_lt + head,
             tl.where(seen, (top + tl.log2(tl.where(seen, l_total, 1.0))) * LN2, float("-inf")), mask=m_ok)


def merge_splits(m_part, l_part, o_part, out, lse, sinks, splits: int, num_tokens: int, kv_heads: int, groups: int):
    """Merge the split states that `attention._attend_list` stored into `out` `(B, T, Hq, Dv)` and `lse` `(B, T, Hq)`
    (one launch of `_combine_splits`)."""
    batch, v_dim, device = out.shape[0], out.shape[-1], out.device
    rows = groups * num_tokens
    block_dv = triton.next_power_of_2(v_dim)
    # GPU: one query row per program, for parallelism at small batch. Triton's CPU interpreter pays per program,
    # so there a program takes all rows.
    per_program = 1 if device.type == "cuda" else triton.next_power_of_2(rows)
    split_block = max(1, min(triton.next_power_of_2(splits), 4096 // (per_program * block_dv)))
    _combine_splits[(batch * kv_heads, triton.cdiv(rows, per_program))](
        m_part, l_part, o_part, out, lse, sinks if sinks is not None else lse, splits,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        num_tokens, KV_HEADS=kv_heads, GROUPS=groups, V_DIM=v_dim,
        ROWS_PER_PROGRAM=per_program, SPLIT_BLOCK=split_block, BLOCK_DV=block_dv, HAS_SINKS=sinks is not None,
        USE_GDC=_launch.pdl(device), num_warps=4, **_launch.pdl_launch(device),
    )


def _num_splits(list_len: int, programs: int, block_n: int, waves: float, device, nearest: bool = False,
                split_len: int | None = None, fill: float = 0.0):
    """(splits, chunk): enough programs to fill the GPU `waves` times (rounded up, or to the nearest count), each
    chunk a multiple of the block; `waves` 0: one split per (row, KV head) (a sparse draft of one split writes its
    output itself).
    `fill` > 0 (then `waves` is how many programs an SM holds at once): the fewest splits whose last wave of
    programs is at least `fill` full (`_wave_filling_splits`).
    `split_len`: at least enough splits that none spans more than `split_len` entries (rounded up to blocks)."""
    blocks = max(triton.cdiv(max(list_len, 1), block_n), 1)
    fewest = 1 if split_len is None else triton.cdiv(blocks, max(triton.cdiv(split_len, block_n), 1))
    if waves == 0:
        want = 1
    elif fill > 0:
        want = _wave_filling_splits(blocks, programs, round(waves * _launch.device_sm_count(device)), fill)
    else:
        wanted = waves * _launch.device_sm_count(device) / programs
        want = max(round(wanted) if nearest else math.ceil(wanted), 1)
    splits = min(max(want, fewest), blocks)
    chunk = triton.cdiv(blocks, splits) * block_n
    return triton.cdiv(blocks * block_n, chunk), chunk


@functools.cache
def _wave_filling_splits(blocks: int, pairs: int, slots: int, fill: float) -> int:
    """The fewest splits of a `blocks`-long list over `pairs` (row, KV head) pairs whose programs fill their last
    wave of `slots` (programs resident at once) at least `fill` full, else the fullest: the time of a kernel whose
    programs all take about as long goes by whole waves (`_launch.TUNING`). Only counts the chunking can make."""
    best, best_fill = 1, 0.0
    for splits in range(1, blocks + 1):
        if triton.cdiv(blocks, triton.cdiv(blocks, splits)) != splits:
            continue
        launched = splits * pairs
        filled = launched / (triton.cdiv(launched, slots) * slots)
        if filled >= fill:
            return splits
        if filled > best_fill:
            best, best_fill = splits, filled
    return best
