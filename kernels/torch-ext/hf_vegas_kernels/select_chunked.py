"""Top-k selection of long rows over many programs per row: a radix search of the k-th key, one launch per pass.

`select.py`'s tiled kernel runs the whole threshold search of a (layer, row) in one program: 8 passes of 16
thresholds, then a count and a write pass, each reading the row again. At the Qwen3-8B shape 16 x 32K that is 576
programs, each reading its 128 KiB row ten times one block after another: 1.11 ms per verification on an H200
(`kernel_bandwidth.py`, 58550eb), while the scores are 75 MB. Here each row is cut into chunks of `chunk` slots, one
program per (row, chunk), and each pass is a launch of its own (`_launch.SELECT_TUNING` holds the settings):

- pass p (32 / `bits` launches; 4 passes of 256 buckets by default): the k-th largest key (scores mapped to int32
  keys of the same order) is known to lie in [lo, lo + 2^(32 - bits * p)), at least k keys being >= lo; every chunk
  counts its keys per bucket of 2^(32 - bits * (p + 1)) keys from lo on (a histogram of 2^bits bins, keys above the
  range in the top bin) and stores the counts: plain stores, one slot per chunk, so no atomics, no zeroed buffer,
  the same sums in any schedule. A program first takes the step of the pass before it: lo as that pass found it
  (stored by its first chunk's program), moved to the highest bucket start of that pass that still leaves at least
  k keys at or above it (its counts summed over the row's chunks); its first chunk's program stores the result;
- count: the last pass's step gives the k-th key; every chunk counts its keys above it and equal to it;
- write: every chunk writes its slots at the offset of those the chunks before it take (ties in slot order, as many
  as still fit), so the list comes out ascending and equal, slot for slot, to the tiled kernel's and the
  reference's (the k-th key is the same whatever the search's steps).

Each program loads its chunk before it takes the step, so the load's round trip overlaps the step's reductions. A
row is cut into at most 64 chunks (longer chunks for longer rows), and a step sums the counts 32 chunks at a time,
so neither a program's registers nor its reads of the counts grow without bound with the row. The passes count
with a masked `tl.histogram` (Triton 3.4 and later, `supported`); with an older Triton `select.py` keeps one
program per row.
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.language as tl

from . import _launch
from ._pdl import wait_for_inputs

MAX_CHUNKS = 64  # a longer row takes longer chunks (up to MAX_CHUNK slots)
MAX_CHUNK = 16384
CHUNK_BLOCK = 32  # chunks whose counts a step sums at once


@functools.cache
def supported() -> bool:
    """Whether this Triton's `tl.histogram` takes a mask (3.4 and later), which the passes count with."""
    return "mask" in inspect.signature(tl.histogram).parameters


@triton.jit
def ordered_key(x):
    """fp32 scores as int32 keys of the same order (-0.0 below +0.0, NaN above +inf); `select.py`'s kernels too."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _chunk_keys(Scores, Count, CandEnd, Layers, batch, stride_sl, stride_sb, stride_cl, num_slots,
                CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """The program's listed row and chunk, the row's budget, and the chunk's slots, keys and which are candidates."""
    program = tl.program_id(0)
    row = program // CHUNKS
    chunk = program % CHUNKS
    layer = tl.load(Layers + row // batch)
    b = (row % batch).to(tl.int64)
    k = tl.load(Count + layer * stride_cl + b).to(tl.int32)
    n = tl.minimum(tl.load(CandEnd + b), num_slots).to(tl.int32)  # no candidate past the scores' last slot
    slot = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = slot < n
    key = ordered_key(tl.load(Scores + layer * stride_sl + b * stride_sb + slot, mask=valid, other=0.0))
    return row, chunk, layer, b, k, slot, valid, key


@triton.jit
def _step(Counts, Lows, row, chunk, k, PASS: tl.constexpr, CHUNKS: tl.constexpr, CHUNK_BLOCK: tl.constexpr,
          BITS: tl.constexpr, PASSES: tl.constexpr):
    """lo before pass PASS (PASSES: after the last, the k-th key): the k-th largest key lies in [lo, lo +
    2^(32 - BITS * PASS)) and at least k keys are >= lo. The first chunk's program stores it for the next launch."""
    BINS: tl.constexpr = 1 << BITS
    lo = tl.full([], -2147483648, tl.int64)
    if PASS > 0:
        if PASS > 1:
            lo = tl.load(Lows + row * (PASSES + 1) + PASS - 1)
        lane = tl.arange(0, BINS)
        blocks = tl.arange(0, CHUNK_BLOCK)
        counts = Counts + ((row * 2 + (PASS - 1) % 2) * CHUNKS) * BINS  # the pass before wrote its parity's slot
        per_bucket = tl.zeros([BINS], tl.int32)
        for c0 in range(0, CHUNKS, CHUNK_BLOCK):
            chunks = c0 + blocks
            per_bucket += tl.sum(tl.load(counts + chunks[:, None] * BINS + lane[None, :],
                                         mask=(chunks < CHUNKS)[:, None], other=0), axis=0)
        # the keys at or above each bucket's start
        reached = tl.sum(per_bucket, axis=0) - tl.cumsum(per_bucket, axis=0) + per_bucket
        reached = tl.where(lane == 0, k, reached)  # lo itself always qualifies (invariant)
        step = tl.full([], 1, tl.int64) << (32 - BITS * PASS)
        lo = tl.max(tl.where(reached >= k, lo + lane.to(tl.int64) * step, -2147483648), axis=0)
        if chunk == 0:
            tl.store(Lows + row * (PASSES + 1) + PASS, lo)
    return lo


@triton.jit
def _count_pass(
    Scores, Count, CandEnd, Layers, Counts, Lows, batch, stride_sl, stride_sb, stride_cl, num_slots,
    PASS: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, CHUNK_BLOCK: tl.constexpr,
    BITS: tl.constexpr, PASSES: tl.constexpr, USE_GDC: tl.constexpr,
):
    wait_for_inputs(USE_GDC, True)  # the scores (or the earlier passes' counts) are earlier launches' output
    BINS: tl.constexpr = 1 << BITS
    SHIFT: tl.constexpr = 32 - BITS * (PASS + 1)
    row, chunk, _, _, k, _, valid, key = _chunk_keys(Scores, Count, CandEnd, Layers, batch, stride_sl, stride_sb,
                                                     stride_cl, num_slots, CHUNK, CHUNKS)
    lo = _step(Counts, Lows, row, chunk, k, PASS, CHUNKS, CHUNK_BLOCK, BITS, PASSES)
    bucket = (key.to(tl.int64) - lo) >> SHIFT
    # Keys below lo count for no bucket, those above the range for the top one; an empty budget counts nothing.
    counted = valid & (bucket >= 0) & (k > 0)
    bucket = tl.where(counted, tl.minimum(bucket, BINS - 1), 0).to(tl.int32)
    # Two slots of counts alternate: this launch's step read the other one, and the next launch writes that one
    # only after this launch has finished.
    tl.store(Counts + ((row * 2 + PASS % 2) * CHUNKS + chunk) * BINS + tl.arange(0, BINS),
             tl.histogram(bucket, BINS, mask=counted))


@triton.jit
def _count_kth(
    Scores, Count, CandEnd, Layers, Counts, Lows, Totals, batch, stride_sl, stride_sb, stride_cl, num_slots,
    CHUNK: tl.constexpr, CHUNKS: tl.constexpr, CHUNK_BLOCK: tl.constexpr,
    BITS: tl.constexpr, PASSES: tl.constexpr, USE_GDC: tl.constexpr,
):
    """Each chunk's keys above the k-th and equal to it, into `Totals[row, chunk]`."""
    wait_for_inputs(USE_GDC, True)
    row, chunk, _, _, k, _, valid, key = _chunk_keys(Scores, Count, CandEnd, Layers, batch, stride_sl, stride_sb,
                                                     stride_cl, num_slots, CHUNK, CHUNKS)
    kth = _step(Counts, Lows, row, chunk, k, PASSES, CHUNKS, CHUNK_BLOCK, BITS, PASSES).to(tl.int32)
    totals = Totals + (row * CHUNKS + chunk) * 2
    tl.store(totals, tl.sum((valid & (key > kth)).to(tl.int32), axis=0))
    tl.store(totals + 1, tl.sum((valid & (key == kth)).to(tl.int32), axis=0))


@triton.jit
def _write_chunk(
    Scores, Count, CandEnd, Layers, Lows, Totals, batch, stride_sl, stride_sb, stride_cl, num_slots, Out, stride_ol,
    stride_ob,
    CHUNK: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, PASSES: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """Each chunk's selected slots, at the offset of those the chunks before it select."""
    wait_for_inputs(USE_GDC, True)
    row, chunk, layer, b, k, slot, valid, key = _chunk_keys(Scores, Count, CandEnd, Layers, batch, stride_sl,
                                                            stride_sb, stride_cl, num_slots, CHUNK, CHUNKS)
    valid = valid & (k > 0)  # an empty budget writes nothing
    kth = tl.load(Lows + row * (PASSES + 1) + PASSES).to(tl.int32)
    chunks = tl.arange(0, CHUNKS_P2)
    totals = Totals + (row * CHUNKS + chunks) * 2
    above_per_chunk = tl.load(totals, mask=chunks < CHUNKS, other=0)
    ties_per_chunk = tl.load(totals + 1, mask=chunks < CHUNKS, other=0)
    before = chunks < chunk
    ties_wanted = k - tl.sum(above_per_chunk, axis=0)
    ties_before = tl.sum(tl.where(before, ties_per_chunk, 0), axis=0)
    taken_before = tl.sum(tl.where(before, above_per_chunk, 0), axis=0) + tl.minimum(ties_before, ties_wanted)
    tie = (valid & (key == kth)).to(tl.int32)
    tie_rank = ties_before + tl.cumsum(tie, axis=0) - tie
    take = ((valid & (key > kth)) | ((tie == 1) & (tie_rank < ties_wanted))).to(tl.int32)
    position = taken_before + tl.cumsum(take, axis=0) - take
    tl.store(Out + layer * stride_ol + b * stride_ob + position, slot.to(tl.int64), mask=take == 1)


def check_settings(chunk: int, bits: int) -> None:
    """Refuse, naming the setting, a chunk or a key width the passes cannot run."""
    if chunk < 16 or chunk > MAX_CHUNK or chunk & (chunk - 1):
        raise ValueError(f"select_topk: the chunk (SELECT_TUNING['chunk']) must be a power of two from 16 to "
                         f"{MAX_CHUNK}, got {chunk}")
    if bits not in (4, 8):
        raise ValueError(f"select_topk: the bits per pass (SELECT_TUNING['bits']) must be 4 or 8, got {bits}")


def select_topk_chunked(scores, count, cand_end, out3, layers, per_layer: bool, chunk: int, bits: int, warps: int):
    """`select.select_topk` for `scores` `(L, B, S)` rows, in programs of `warps` warps over chunks of at least
    `chunk` slots (a power of two from 16 to 16384; more where a row would have more than `MAX_CHUNKS`), `bits` of
    the key per pass (4 or 8). The caller has checked the other arguments; `layers` is a device tensor of the layers
    to select for."""
    check_settings(chunk, bits)
    batch = scores.shape[1]
    rows = layers.numel() * batch
    chunk = min(MAX_CHUNK, max(chunk, triton.next_power_of_2(triton.cdiv(scores.shape[-1], MAX_CHUNKS))))
    chunks = triton.cdiv(scores.shape[-1], chunk)
    passes = 32 // bits
    device = scores.device
    # Per (listed row, parity of the pass, chunk) the bucket counts; per (listed row, pass) the lo found; per (listed
    # row, chunk) the count launch's keys above the k-th and equal to it. Every slot read was written by an earlier
    # launch of this call.
    counts = torch.empty((rows, 2, chunks, 1 << bits), dtype=torch.int32, device=device)
    lows = torch.empty((rows, passes + 1), dtype=torch.int64, device=device)
    totals = torch.empty((rows, chunks, 2), dtype=torch.int32, device=device)
    # A program loads its whole chunk at once: one round trip to memory per launch. At 16 x 32K on an H200,
    # programs looping over 1K-key blocks (waiting for each block's load in turn) took 0.75 ms at best per
    # verification (8K-key chunks, 3c559b4).
    sizes = dict(CHUNK=chunk, CHUNKS=chunks, PASSES=passes, USE_GDC=_launch.pdl(device), num_warps=warps,
                 **_launch.pdl_launch(device))
    block = min(CHUNK_BLOCK, triton.next_power_of_2(chunks))
    keys = (scores, count, cand_end, layers)
    strides = (batch, scores.stride(0), scores.stride(1), count.stride(0) if per_layer else 0, scores.shape[-1])
    grid = (rows * chunks,)
    for p in range(passes):
        _count_pass[grid](*keys, counts, lows, *strides, PASS=p, CHUNK_BLOCK=block, BITS=bits, **sizes)
    _count_kth[grid](*keys, counts, lows, totals, *strides, CHUNK_BLOCK=block, BITS=bits, **sizes)
    _write_chunk[grid](*keys, lows, totals, *strides, out3, out3.stride(0), out3.stride(1),
                       CHUNKS_P2=triton.next_power_of_2(chunks), **sizes)
    return out3
