"""Top-k selection of long rows over many programs per row: the tiled threshold passes, one launch per pass.

`select.py`'s tiled kernel runs the whole threshold search of a (layer, row) in one program: 8 passes of 16
thresholds, then a count and a write pass, each reading the row again. At the Qwen3-8B shape 16 x 32K that is 576
programs, each reading its 128 KiB row ten times one block after another: 1.14 ms per verification on an H200
(1d6f650), while the scores are 75 MB. Here each row is cut into chunks of `chunk` slots, one program per (row,
chunk), and each pass is a launch of its own:

- pass p (8 launches): every chunk counts its keys at or above the 16 thresholds of pass p and stores the counts
  (plain stores, one slot per chunk: no atomics, no zeroed buffer, the same sums in any schedule). The thresholds
  come from replaying the passes before: each program sums the earlier passes' counts over the row's chunks and
  takes the same bisection steps as the tiled kernel, so the k-th key found is the tiled kernel's;
- count: every chunk counts its keys above the k-th and equal to it;
- write: every chunk writes its slots at the offset the chunks before it take (ties in slot order, as many as still
  fit), so the list comes out ascending and equal, slot for slot, to the tiled kernel's and the reference's.

Eight passes always suffice: a pass narrows a range of R keys to ceil(R / 16), and 16^8 = 2^32; a row whose range
closed earlier skips the remaining passes' counting.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch

THRESHOLDS = 16
PASSES = 8


@triton.jit
def _ordered_key(x):
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _chunk_row(Count, CandEnd, Layers, batch, stride_cl, CHUNKS: tl.constexpr):
    """The program's (listed row, chunk), the row's layer and sequence, its budget and candidate count."""
    program = tl.program_id(0)
    row = program // CHUNKS
    chunk = program % CHUNKS
    layer = tl.load(Layers + row // batch)
    b = (row % batch).to(tl.int64)
    k = tl.load(Count + layer * stride_cl + b).to(tl.int32)
    n = tl.load(CandEnd + b).to(tl.int32)
    return row, chunk, layer, b, k, n


@triton.jit
def _replay(Counts, row, k, PASS: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
            THRESHOLDS: tl.constexpr, PASSES: tl.constexpr):
    """(lo, hi) after passes 0..PASS-1: the k-th largest key lies in [lo, hi] and at least k keys are >= lo."""
    lane = tl.arange(0, THRESHOLDS).to(tl.int64)
    chunks = tl.arange(0, CHUNKS_P2)
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    for p in tl.static_range(PASS):
        step = (hi - lo + THRESHOLDS) // THRESHOLDS
        threshold = tl.minimum(lo + lane * step, 2147483647)
        counts = Counts + ((row * (PASSES + 1) + p) * CHUNKS + chunks[:, None]) * THRESHOLDS + lane[None, :]
        per_chunk = tl.load(counts, mask=(chunks < CHUNKS)[:, None], other=0)
        reached = tl.sum(per_chunk, axis=0)
        reached = tl.where(lane == 0, k, reached)  # lo itself always qualifies (invariant), even at INT32_MIN
        lo = tl.max(tl.where(reached >= k, threshold, -2147483648), axis=0)
        hi = tl.minimum(hi, lo + step - 1)
    return lo, hi


@triton.jit
def _count_pass(
    Scores, Count, CandEnd, Layers, Counts, batch, stride_sl, stride_sb, stride_cl,
    PASS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
    THRESHOLDS: tl.constexpr, PASSES: tl.constexpr, USE_GDC: tl.constexpr,
):
    if USE_GDC:  # programmatic dependent launch: the scores (or the earlier passes' counts) are earlier output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row, chunk, layer, b, k, n = _chunk_row(Count, CandEnd, Layers, batch, stride_cl, CHUNKS)
    lo, hi = _replay(Counts, row, k, PASS, CHUNKS, CHUNKS_P2, THRESHOLDS, PASSES)
    lane = tl.arange(0, THRESHOLDS).to(tl.int64)
    step = (hi - lo + THRESHOLDS) // THRESHOLDS
    threshold32 = tl.minimum(lo + lane * step, 2147483647).to(tl.int32)
    reached = tl.zeros([THRESHOLDS], tl.int32)
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, n)
    if (k > 0) & (lo < hi):  # a closed range counts nothing: its later passes keep (lo, hi)
        scores = Scores + layer * stride_sl + b * stride_sb
        for s0 in range(start, end, BLOCK):
            slot = s0 + tl.arange(0, BLOCK)
            valid = slot < end
            key = tl.where(valid, _ordered_key(tl.load(scores + slot, mask=valid, other=0.0)), -2147483648)
            reached += tl.sum((key[:, None] >= threshold32[None, :]).to(tl.int32), axis=0)
    tl.store(Counts + ((row * (PASSES + 1) + PASS) * CHUNKS + chunk) * THRESHOLDS + lane, reached)


@triton.jit
def _count_kth(
    Scores, Count, CandEnd, Layers, Counts, batch, stride_sl, stride_sb, stride_cl,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
    THRESHOLDS: tl.constexpr, PASSES: tl.constexpr, USE_GDC: tl.constexpr,
):
    """Each chunk's keys above the k-th and equal to it, into the counts' last pass slot (lanes 0 and 1)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row, chunk, layer, b, k, n = _chunk_row(Count, CandEnd, Layers, batch, stride_cl, CHUNKS)
    kth, _ = _replay(Counts, row, k, PASSES, CHUNKS, CHUNKS_P2, THRESHOLDS, PASSES)
    kth = kth.to(tl.int32)
    above = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, n)
    scores = Scores + layer * stride_sl + b * stride_sb
    for s0 in range(start, end, BLOCK):
        slot = s0 + tl.arange(0, BLOCK)
        valid = slot < end
        key = _ordered_key(tl.load(scores + slot, mask=valid, other=0.0))
        above += tl.sum((valid & (key > kth)).to(tl.int32), axis=0)
        ties += tl.sum((valid & (key == kth)).to(tl.int32), axis=0)
    lane = tl.arange(0, THRESHOLDS)
    tl.store(Counts + ((row * (PASSES + 1) + PASSES) * CHUNKS + chunk) * THRESHOLDS + lane,
             tl.where(lane == 0, above, ties), mask=lane < 2)


@triton.jit
def _write_chunk(
    Scores, Count, CandEnd, Layers, Counts, batch, stride_sl, stride_sb, stride_cl, Out, stride_ol, stride_ob,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
    THRESHOLDS: tl.constexpr, PASSES: tl.constexpr, USE_GDC: tl.constexpr,
):
    """Each chunk's selected slots, at the offset of those the chunks before it select."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row, chunk, layer, b, k, n = _chunk_row(Count, CandEnd, Layers, batch, stride_cl, CHUNKS)
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, n)
    if (k > 0) & (start < end):
        kth, _ = _replay(Counts, row, k, PASSES, CHUNKS, CHUNKS_P2, THRESHOLDS, PASSES)
        kth = kth.to(tl.int32)
        chunks = tl.arange(0, CHUNKS_P2)
        totals = Counts + ((row * (PASSES + 1) + PASSES) * CHUNKS + chunks) * THRESHOLDS
        above_per_chunk = tl.load(totals, mask=chunks < CHUNKS, other=0)
        ties_per_chunk = tl.load(totals + 1, mask=chunks < CHUNKS, other=0)
        before = chunks < chunk
        ties_wanted = k - tl.sum(above_per_chunk, axis=0)
        ties_seen = tl.sum(tl.where(before, ties_per_chunk, 0), axis=0)
        taken = tl.sum(tl.where(before, above_per_chunk, 0), axis=0) + tl.minimum(ties_seen, ties_wanted)
        scores = Scores + layer * stride_sl + b * stride_sb
        out = Out + layer * stride_ol + b * stride_ob
        for s0 in range(start, end, BLOCK):
            slot = s0 + tl.arange(0, BLOCK)
            valid = slot < end
            key = _ordered_key(tl.load(scores + slot, mask=valid, other=0.0))
            tie = (valid & (key == kth)).to(tl.int32)
            tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
            take = ((valid & (key > kth)) | ((tie == 1) & (tie_rank < ties_wanted))).to(tl.int32)
            position = taken + tl.cumsum(take, axis=0) - take
            tl.store(out + position, slot.to(tl.int64), mask=take == 1)
            taken += tl.sum(take, axis=0)
            ties_seen += tl.sum(tie, axis=0)


def select_topk_chunked(scores, count, cand_end, out3, layers, per_layer: bool, chunk: int):
    """`select.select_topk` for `scores` `(L, B, S)` rows of `chunk` slots per program (a power of two, at least
    16). The caller has checked the arguments; `layers` is a device tensor of the layers to select for."""
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"select_topk: the chunk (SELECT_TUNING['chunk']) must be a power of two >= 16, got {chunk}")
    batch = scores.shape[1]
    rows = layers.numel() * batch
    chunks = triton.cdiv(scores.shape[-1], chunk)
    # Per (listed row, pass, chunk): the 16 threshold counts; the last pass slot holds the count launch's totals.
    counts = torch.empty((rows, PASSES + 1, chunks, THRESHOLDS), dtype=torch.int32, device=scores.device)
    use_gdc = _launch.pdl(scores.device)
    sizes = dict(CHUNK=chunk, BLOCK=min(chunk, 1024), CHUNKS=chunks, CHUNKS_P2=triton.next_power_of_2(chunks),
                 THRESHOLDS=THRESHOLDS, PASSES=PASSES, USE_GDC=use_gdc, num_warps=8,
                 **_launch.pdl_launch(scores.device))
    common = (scores, count, cand_end, layers, counts, batch, scores.stride(0), scores.stride(1))
    stride_cl = count.stride(0) if per_layer else 0
    grid = (rows * chunks,)
    for p in range(PASSES):
        _count_pass[grid](*common, stride_cl, PASS=p, **sizes)
    _count_kth[grid](*common, stride_cl, **sizes)
    _write_chunk[grid](*common, stride_cl, out3, out3.stride(0), out3.stride(1), **sizes)
    return out3
