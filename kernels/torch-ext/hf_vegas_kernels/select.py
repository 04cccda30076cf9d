"""Top-k selection per (layer, row) without a host synchronisation: a threshold search, then compaction.

Scores are mapped to int32 keys with the same order as the floats. Each pass counts, for 16 evenly spaced
thresholds at once, how many candidates reach them and keeps the highest threshold that still leaves at least `k`;
8 passes pin the k-th largest key exactly. One pass counts the keys above it, a last one writes those slots, then
as many ties as still fit, in slot order. The lists are therefore ascending (local gathers for the draft kernel)
and deterministic. One program per (layer, row): after a verification every full-attention layer selects in one
launch (`layers * batch` programs); the `last_token` policy selects per layer after acceptance.

A row of at most `_launch.SELECT_TUNING["row_in_registers"]` slots (16K) is loaded once and kept in registers
(`_select_topk_row`): the k-th key is then found by bisection, one reduction per bit (32), and the slots are written
in 1,024-slot steps that read the row again from L2. Written with one scan of the whole row, the kernel held 255
registers and spilled at 8K slots and 4 warps (two programs per SM; 128 registers now): at SmolLM2 64 x 7.5K on an
H100 (`kernel_bandwidth.py`, 30 layers x 64 rows, two passes in one call) 251 / 249 -> 199 / 198 us (8 warps 221, 2
warps 251). Reloading the row for each of the threshold passes cost 0.59 ms per verification at SmolLM2 64 x 7.5K
(30 layers, 1 920 programs) on an H100, against a ~20 us read of the scores. The block is the row's slot count
rounded up to a power of two, so callers pass only the slots that can be candidates (`SelectionState.select`): on an
H100 (30 layers x 64 rows, random scores; a one-off timing script, not kept) 8193 slots, a power-of-two capacity
plus the cache's scratch slot, took 0.61 ms and 8192 slots 0.23 ms; radix passes of 8 bits through `tl.histogram`
(0.45 ms at best) and four-way bisection (0.28 ms) were slower. End to end: README, "Fewer, overlapped launches".
Longer rows run a radix search of the k-th key over chunks of the row, one launch per pass (`select_chunked.py`,
`SELECT_TUNING["chunk"]`); with `chunk` 0 or a Triton older than 3.4, the threshold passes below in one program per
row (`_select_topk`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from . import select_chunked
from .select_chunked import ordered_key as _ordered_key

_THRESHOLDS = 16
_WRITE_BLOCK = 1024  # slots per step of the register kernel's write
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


@triton.jit
def _select_topk(
    Scores, Count, CandEnd, Out, Layers, batch, num_slots,
    stride_sl, stride_sb, stride_ol, stride_ob, stride_cl,
    BLOCK_S: tl.constexpr, THRESHOLDS: tl.constexpr,
):
    program = tl.program_id(0)
    layer = tl.load(Layers + program // batch)
    b = (program % batch).to(tl.int64)
    scores = Scores + layer * stride_sl + b * stride_sb
    k = tl.load(Count + layer * stride_cl + b).to(tl.int32)
    n = tl.minimum(tl.load(CandEnd + b), num_slots)  # no candidate past the scores' last slot
    lane = tl.arange(0, THRESHOLDS).to(tl.int64)
    # Invariant: at least k candidates have key >= lo, and the k-th largest key lies in [lo, hi].
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    while lo < hi:
        step = (hi - lo + THRESHOLDS) // THRESHOLDS
        threshold = tl.minimum(lo + lane * step, 2147483647)
        threshold32 = threshold.to(tl.int32)
        reached = tl.zeros([THRESHOLDS], tl.int32)
        for s0 in range(0, n, BLOCK_S):
            slot = s0 + tl.arange(0, BLOCK_S)
            valid = slot < n
            key = _ordered_key(tl.load(scores + slot, mask=valid, other=float("-inf")))
            key = tl.where(valid, key, -2147483648)  # below every real key, never counted (thresholds > it)
            reached += tl.sum((key[:, None] >= threshold32[None, :]).to(tl.int32), axis=0)
        reached = tl.where(lane == 0, k, reached)  # lo itself always qualifies (invariant), even at INT32_MIN
        lo = tl.max(tl.where(reached >= k, threshold, -2147483648), axis=0)
        hi = tl.minimum(hi, lo + step - 1)
    kth = lo.to(tl.int32)
    above = tl.zeros([], tl.int32)
    for s0 in range(0, n, BLOCK_S):
        slot = s0 + tl.arange(0, BLOCK_S)
        valid = slot < n
        key = _ordered_key(tl.load(scores + slot, mask=valid, other=float("-inf")))
        above += tl.sum((valid & (key > kth)).to(tl.int32), axis=0)
    _write_selected(scores, Out + layer * stride_ol + b * stride_ob, n, kth, k - above, BLOCK_S)


@triton.jit
def _write_selected(scores, out, n, kth, ties_wanted, BLOCK: tl.constexpr):
    """Write the slots of `scores[:n]` keyed above `kth`, and the first `ties_wanted` keyed `kth`, ascending, into
    `out`: BLOCK slots a step, each step's positions offset by what the steps before took."""
    taken = tl.zeros([], tl.int32)
    ties_seen = tl.zeros([], tl.int32)
    for s0 in range(0, n, BLOCK):
        slot = s0 + tl.arange(0, BLOCK)
        valid = slot < n
        key = _ordered_key(tl.load(scores + slot, mask=valid, other=float("-inf")))
        tie = (valid & (key == kth)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
        take = ((valid & (key > kth)) | ((tie == 1) & (tie_rank < ties_wanted))).to(tl.int32)
        position = taken + tl.cumsum(take, axis=0) - take
        tl.store(out + position, slot.to(tl.int64), mask=take == 1)
        taken += tl.sum(take, axis=0)
        ties_seen += tl.sum(tie, axis=0)


@triton.jit
def _select_topk_row(
    Scores, Count, CandEnd, Out, Layers, batch, num_slots,
    stride_sl, stride_sb, stride_ol, stride_ob, stride_cl,
    BLOCK_S: tl.constexpr, WRITE_BLOCK: tl.constexpr, USE_GDC: tl.constexpr,
):
    if USE_GDC:  # programmatic dependent launch (`_launch.pdl`): the scores are the previous kernel's output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    program = tl.program_id(0)
    layer = tl.load(Layers + program // batch)
    b = (program % batch).to(tl.int64)
    k = tl.load(Count + layer * stride_cl + b).to(tl.int32)
    n = tl.minimum(tl.load(CandEnd + b), num_slots)  # no candidate past the scores' last slot
    slot = tl.arange(0, BLOCK_S)
    valid = slot < n
    key = _ordered_key(tl.load(Scores + layer * stride_sl + b * stride_sb + slot, mask=valid, other=float("-inf")))
    key = tl.where(valid, key, -2147483648)  # below every threshold tried (all > INT32_MIN): never counted
    # Invariant: at least k candidates have key >= lo, and the k-th largest key lies in [lo, hi].
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        reached = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0)
        lo = tl.where(reached >= k, mid, lo)
        hi = tl.where(reached >= k, hi, mid - 1)
    kth = lo.to(tl.int32)
    ties_wanted = k - tl.sum((key > kth).to(tl.int32), axis=0)
    # The write reads the row again, WRITE_BLOCK slots at a time (from L2: the row was just read): scanning the whole
    # row in registers kept its slots, ranks and positions live beside the keys, 255 registers and spills at 4 warps,
    # two programs per SM.
    _write_selected(Scores + layer * stride_sl + b * stride_sb, Out + layer * stride_ol + b * stride_ob, n, kth,
                    ties_wanted, WRITE_BLOCK)


def select_topk(scores, count, cand_end, out, layers=None):
    """Write into `out[..., b, :count[b]]` the slots of the `count[b]` highest `scores[..., b, :cand_end[b]]`.

    `scores` `(B, S)` with `out` `(B, K)`, or `scores` `(L, B, S)` with `out` `(L, B, K)` and `layers` the layer
    indices to select for (default: all); `count` `(B,)`, or `(L, B)` for a budget per layer. Slots come out
    ascending; `count <= cand_end` is required (the budget never exceeds the candidates) and `out[..., b, count:]`
    is left untouched. A `cand_end` past the scores' `S` slots counts as `S`, as in `naive.select_topk`: no slot
    past a row's scores is read. Returns `out`.
    """
    if scores.dim() == 2:
        scores, out3 = scores[None], out[None]
    else:
        out3 = out
    per_layer = count.dim() == 2
    if count.dim() not in (1, 2) or count.shape[-1] != scores.shape[1] or (per_layer and count.stride(1) != 1):
        raise ValueError(f"select_topk: count must be (B,) or (L, B) with contiguous rows, got {tuple(count.shape)}")
    if layers is None:
        layers = torch.arange(scores.shape[0], device=scores.device)
    batch = scores.shape[1]
    grid = (layers.numel() * batch,)
    args = (scores, count, cand_end, out3, layers, batch, scores.shape[-1],
            scores.stride(0), scores.stride(1), out3.stride(0), out3.stride(1),
            count.stride(0) if per_layer else 0)
    if scores.shape[-1] <= _launch.SELECT_TUNING["row_in_registers"]:
        block = triton.next_power_of_2(scores.shape[-1])
        warps = _launch.SELECT_TUNING["num_warps"] or (4 if block <= 8192 else 16 if block <= 16384 else 32)
        _select_topk_row[grid](*args, BLOCK_S=block, WRITE_BLOCK=min(block, _WRITE_BLOCK),
                               USE_GDC=_launch.pdl(scores.device), num_warps=warps,
                               **_launch.pdl_launch(scores.device))
    elif _launch.SELECT_TUNING["chunk"] and select_chunked.supported():
        tuning = _launch.SELECT_TUNING
        select_chunked.select_topk_chunked(scores, count, cand_end, out3, layers, per_layer, tuning["chunk"],
                                           tuning["bits"], tuning["chunk_warps"])
    else:
        _select_topk[grid](*args, BLOCK_S=1024, THRESHOLDS=_THRESHOLDS, num_warps=8)
    return out
