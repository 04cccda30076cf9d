"""Top-k selection of long rows over many programs per row: a radix search of the k-th key, one launch per pass.

`select.py`'s tiled kernel runs the whole threshold search of a (layer, row) in one program: 8 passes of 16
thresholds, then a count and a write pass, each reading the row again. At the Qwen3-8B shape 16 x 32K that is 576
programs, each reading its 128 KiB row ten times one block after another: 1.11 ms per verification on an H200
(`kernel_bandwidth.py`, 58550eb), while the scores are 75 MB. Here each row is cut into chunks of `chunk` slots, one
program per (row, chunk), and each pass is a launch of its own:

- pass p (32 / `bits` launches): the k-th largest key (scores mapped to int32 keys of the same order) is known to
  lie in [lo, hi], a range of at most 2^(32 - bits * p) keys starting at a multiple of that; every chunk counts its
  keys per bucket of 2^(32 - bits * (p + 1)) keys above lo (a histogram of 2^bits bins, keys above the range in the
  top bin) and stores the counts: plain stores, one slot per chunk, so no atomics, no zeroed buffer, the same sums
  in any schedule. A program finds [lo, hi] by replaying the passes before it from their counts summed over the
  row's chunks: the highest bucket start that still leaves at least k keys at or above it;
- count: every chunk counts its keys above the k-th and equal to it;
- write: every chunk writes its slots at the offset of those the chunks before it take (ties in slot order, as many
  as still fit), so the list comes out ascending and equal, slot for slot, to the tiled kernel's and the
  reference's (the k-th key is the same whatever the search's steps).

A row whose range closed before the last pass (a single key) skips the remaining passes' counting.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch

BITS = 4  # bits of the key a pass resolves: 16 buckets, 8 passes (`bits` 8: 256 buckets, 4 passes)


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
            BITS: tl.constexpr, PASSES: tl.constexpr):
    """(lo, hi) after passes 0..PASS-1: the k-th largest key lies in [lo, hi] and at least k keys are >= lo."""
    BINS: tl.constexpr = 1 << BITS
    lane = tl.arange(0, BINS).to(tl.int64)
    chunks = tl.arange(0, CHUNKS_P2)
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    for p in tl.static_range(PASS):
        step = tl.full([], 1, tl.int64) << (32 - BITS * (p + 1))
        counts = Counts + ((row * (PASSES + 1) + p) * CHUNKS + chunks[:, None]) * BINS + lane[None, :]
        per_bucket = tl.sum(tl.load(counts, mask=(chunks < CHUNKS)[:, None], other=0), axis=0)
        # keys in each bucket or above it: the keys at or above each bucket's start
        reached = tl.sum(per_bucket, axis=0) - tl.cumsum(per_bucket, axis=0) + per_bucket
        reached = tl.where(lane == 0, k, reached)  # lo itself always qualifies (invariant)
        lo = tl.max(tl.where(reached >= k, lo + lane * step, -2147483648), axis=0)
        hi = tl.minimum(hi, lo + step - 1)
    return lo, hi


@triton.jit
def _count_pass(
    Scores, Count, CandEnd, Layers, Counts, batch, stride_sl, stride_sb, stride_cl,
    PASS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
    BITS: tl.constexpr, PASSES: tl.constexpr, USE_GDC: tl.constexpr,
):
    if USE_GDC:  # programmatic dependent launch: the scores (or the earlier passes' counts) are earlier output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    BINS: tl.constexpr = 1 << BITS
    SHIFT: tl.constexpr = 32 - BITS * (PASS + 1)
    row, chunk, layer, b, k, n = _chunk_row(Count, CandEnd, Layers, batch, stride_cl, CHUNKS)
    lo, hi = _replay(Counts, row, k, PASS, CHUNKS, CHUNKS_P2, BITS, PASSES)
    per_bucket = tl.zeros([BINS], tl.int32)
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, n)
    if (k > 0) & (lo < hi):  # a closed range counts nothing: its later passes keep (lo, hi)
        scores = Scores + layer * stride_sl + b * stride_sb
        for s0 in range(start, end, BLOCK):
            slot = s0 + tl.arange(0, BLOCK)
            valid = slot < end
            bucket = (_ordered_key(tl.load(scores + slot, mask=valid, other=0.0)).to(tl.int64) - lo) >> SHIFT
            counted = valid & (bucket >= 0)  # keys below lo count for no bucket; those above the range, the top one
            bucket = tl.where(counted, tl.minimum(bucket, BINS - 1), 0).to(tl.int32)
            per_bucket += tl.histogram(bucket, BINS, mask=counted)
    tl.store(Counts + ((row * (PASSES + 1) + PASS) * CHUNKS + chunk) * BINS + tl.arange(0, BINS), per_bucket)


@triton.jit
def _count_kth(
    Scores, Count, CandEnd, Layers, Counts, batch, stride_sl, stride_sb, stride_cl,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
    BITS: tl.constexpr, PASSES: tl.constexpr, USE_GDC: tl.constexpr,
):
    """Each chunk's keys above the k-th and equal to it, into the counts' last pass slot (buckets 0 and 1)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row, chunk, layer, b, k, n = _chunk_row(Count, CandEnd, Layers, batch, stride_cl, CHUNKS)
    kth, _ = _replay(Counts, row, k, PASSES, CHUNKS, CHUNKS_P2, BITS, PASSES)
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
    lane = tl.arange(0, 2)
    tl.store(Counts + ((row * (PASSES + 1) + PASSES) * CHUNKS + chunk) * (1 << BITS) + lane,
             tl.where(lane == 0, above, ties))


@triton.jit
def _write_chunk(
    Scores, Count, CandEnd, Layers, Counts, batch, stride_sl, stride_sb, stride_cl, Out, stride_ol, stride_ob,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
    BITS: tl.constexpr, PASSES: tl.constexpr, USE_GDC: tl.constexpr,
):
    """Each chunk's selected slots, at the offset of those the chunks before it select."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row, chunk, layer, b, k, n = _chunk_row(Count, CandEnd, Layers, batch, stride_cl, CHUNKS)
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, n)
    if (k > 0) & (start < end):
        kth, _ = _replay(Counts, row, k, PASSES, CHUNKS, CHUNKS_P2, BITS, PASSES)
        kth = kth.to(tl.int32)
        chunks = tl.arange(0, CHUNKS_P2)
        totals = Counts + ((row * (PASSES + 1) + PASSES) * CHUNKS + chunks) * (1 << BITS)
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


def select_topk_chunked(scores, count, cand_end, out3, layers, per_layer: bool, chunk: int, bits: int = BITS):
    """`select.select_topk` for `scores` `(L, B, S)` rows, `chunk` slots per program (a power of two, at least 16),
    `bits` of the key per pass (4 or 8). The caller has checked the other arguments; `layers` is a device tensor of
    the layers to select for."""
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"select_topk: the chunk (SELECT_TUNING['chunk']) must be a power of two >= 16, got {chunk}")
    if bits not in (4, 8):
        raise ValueError(f"select_topk: the bits per pass (SELECT_TUNING['bits']) must be 4 or 8, got {bits}")
    batch = scores.shape[1]
    rows = layers.numel() * batch
    chunks = triton.cdiv(scores.shape[-1], chunk)
    passes = 32 // bits
    # Per (listed row, pass, chunk): the bucket counts; the last pass slot holds the count launch's two totals.
    counts = torch.empty((rows, passes + 1, chunks, 1 << bits), dtype=torch.int32, device=scores.device)
    use_gdc = _launch.pdl(scores.device)
    # A program loads its whole chunk at once (up to 16 keys per thread): one round trip to memory per pass. A
    # program looping over 1K-key blocks waited for each block's load in turn: 0.75 ms at best per verification
    # at 16 x 32K on an H200 (8K-key chunks, 3c559b4).
    block = min(chunk, 16384)
    sizes = dict(CHUNK=chunk, BLOCK=block, CHUNKS=chunks, CHUNKS_P2=triton.next_power_of_2(chunks), BITS=bits,
                 PASSES=passes, USE_GDC=use_gdc, num_warps=max(4, min(32, block // 512)),
                 **_launch.pdl_launch(scores.device))
    common = (scores, count, cand_end, layers, counts, batch, scores.stride(0), scores.stride(1))
    stride_cl = count.stride(0) if per_layer else 0
    grid = (rows * chunks,)
    for p in range(passes):
        _count_pass[grid](*common, stride_cl, PASS=p, **sizes)
    _count_kth[grid](*common, stride_cl, **sizes)
    _write_chunk[grid](*common, stride_cl, out3, out3.stride(0), out3.stride(1), **sizes)
    return out3
