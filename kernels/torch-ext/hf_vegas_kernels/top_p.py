"""Top-p (nucleus) filtering without sorting the vocabulary: the kept set of transformers' `TopPLogitsWarper`.

The warper sorts each row ascending, takes the cumulative softmax and removes every token whose cumulative
probability is at most `1 - top_p` (ties in ascending index order, as a stable sort leaves them). With
`G(t)` = the probability of the tokens whose score is at most `t`, that removes:

- every token scored below `t_c`, the smallest score with `G(t_c) > 1 - top_p`;
- of the tokens scored exactly `t_c`, the `floor((1 - top_p - G(below t_c)) / p(t_c))` of lowest index;

and keeps the rest (at least one token: the highest-index one scored `t_c`). `t_c` is pinned by a threshold search
over order-preserving int32 keys of the scores: each pass measures `G` at 16 thresholds and keeps the bracket that
holds `t_c`, so 8 passes pin all 32 bits. Every launch runs (row, chunk) programs, so a row is spread over the whole
GPU; a pass's programs each rebuild their row's bracket from the previous pass's per-chunk masses, in the same order,
so all of them agree, and no launch waits on the host.

Only a few tokens of a row can hold the cut. Each token scored at most `t_lo = max + ln((1 - top_p) * Z / V) - 1`
(`Z` the softmax sum over `exp(x - max)`, `V` the vocabulary) has a probability below `(1 - top_p) / (e V)`, so all
of them together stay below `1 - top_p`: `t_c > t_lo`. One launch therefore sums the mass below `t_lo` and compacts
the scores above it into a per-chunk list (in index order), and the threshold passes read only their lists, each
keeping for the next the entries still inside its bracket. Three launches read the whole row (softmax statistics,
compaction, the filtered copy); the other nine read lists of a few entries when the distribution is peaked, and
never more than the row (flat rows, e.g. a random model's, keep most of it). On Hopper each launch is a programmatic
dependent of the one before (`_launch.pdl`): it is launched while that one finishes and waits before its first
load, so the nine short launches overlap their launch latency. Until e0b2096 each of the 8 passes
compared every score with its 16 thresholds. On an H100 (`benchmarks/top_p.py`, results/top_p.jsonl) rows shaped like
a trained model's (`--logits peaked`) take 80 us for 64 x 49K and 356 us for 448 x 49K (168 and 1,023 before, same
call, from a one-off A/B script), flat rows 88 and 413 (164 and 1,021), the warper's sort 458 and 2,756.

Tried and dropped (4456d09): the eight passes and the tie count as one program per row over all its chunks' lists
(four launches in all, the bracket in registers). Rows of a trained model's shape gained (64 x 49K 80 -> 59 us,
448 x 49K 359 -> 263, 64 x 152K 200 -> 176), but flat rows, whose lists hold most of the row, lost badly on a large
vocabulary (64 x 152K 228 -> 860 us, 448 x 152K 1,287 -> 2,726): one program reads its whole row, latency-bound.
Same H100 call, one-off A/B script; larger tiles narrowed but did not close the gap (64 x 152K flat: 522 us).

The cumulative sums are fp32 sums in another order than the sort's scan, so a token whose cumulative probability
lies within rounding of `1 - top_p` may fall on the other side (as it may between two GPUs running the warper).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch

# Below this, 1 - top_p rounds so close to 1 in fp32 that the fp32 sum of all probabilities may not pass it, and the
# rule would keep no token (the warper's own scan keeps its last one): such tiny top_p stay with the warper.
MIN_TOP_P = 1e-3
THRESHOLDS = 16
PASSES = 8  # 16 ** 8 = 2 ** 32 keys
# Elements per program and per inner step on the GPU; the CPU interpreter's are small so that tests cross chunk and
# block boundaries.
TUNING = {"chunk": 4096, "block": 256, "num_warps": 4}
_CPU_TUNING = {"chunk": 256, "block": 64, "num_warps": 4}


@triton.jit
def _ordered_key(x):
    # + 0.0 turns -0.0 into +0.0: the sort ranks them as equal (ties broken by index), so must the keys
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _score_of_key(key):
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scaled(x, inv_temperature, HAS_TEMPERATURE: tl.constexpr):
    """A score as the warpers see it on CUDA: in fp32 (exact from half precision), times the fp32 reciprocal of the
    temperature, which is how PyTorch's CUDA division by a Python number computes `scores / temperature`."""
    x = x.to(tl.float32)
    if HAS_TEMPERATURE:
        x = x * inv_temperature
    return x


@triton.jit
def _row_softmax(ChunkMax, ChunkSum, row, num_chunks, BLOCK_C: tl.constexpr):
    """The row's maximum and 1 / sum(exp(x - max)), from the per-chunk statistics."""
    c = tl.arange(0, BLOCK_C)
    ok = c < num_chunks
    chunk_max = tl.load(ChunkMax + row * num_chunks + c, mask=ok, other=float("-inf"))
    top = tl.max(chunk_max, axis=0)
    chunk_sum = tl.load(ChunkSum + row * num_chunks + c, mask=ok, other=0.0)
    total = tl.sum(tl.where(ok, chunk_sum * tl.exp(chunk_max - top), 0.0), axis=0)
    return top, 1.0 / total


@triton.jit
def _floor_key(top, inv_total, vocab, removed_mass):
    """The key of `t_lo`: every token at or below it lies below the cut (see the module docstring)."""
    return _ordered_key(top + tl.log(removed_mass / (vocab * inv_total)) - 1.0)


@triton.jit
def _bracket(Below, Bracket, Base, Mass, row, num_rows, num_chunks, removed_mass, first_lo, first_hi, PASS,
             THRESHOLDS: tl.constexpr, BLOCK_C: tl.constexpr):
    """`[lo, hi]` before pass `PASS` (it holds t_c), `base` = G(lo - 1), and the pass's thresholds. Pass 0 starts at
    `[first_lo, first_hi]` with the mass below `t_lo`; pass p follows from pass p - 1's bracket and base (stored)
    and its masses (summed over the row's chunks here, in the same order by every program)."""
    lane = tl.arange(0, THRESHOLDS).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    if PASS == 0:
        lo = first_lo
        hi = first_hi
        base = tl.sum(tl.load(Below + row * num_chunks + c, mask=c < num_chunks, other=0.0), axis=0)
    else:
        prev_lo = tl.load(Bracket + ((PASS - 1) * num_rows + row) * 2)
        prev_hi = tl.load(Bracket + ((PASS - 1) * num_rows + row) * 2 + 1)
        prev_base = tl.load(Base + (PASS - 1) * num_rows + row)
        step = (prev_hi - prev_lo + THRESHOLDS) // THRESHOLDS
        threshold = tl.minimum(prev_lo + lane * step, prev_hi)
        masses = tl.load(Mass + (((PASS - 1) * num_rows + row) * num_chunks + c[:, None]) * THRESHOLDS
                         + lane[None, :], mask=(c < num_chunks)[:, None], other=0.0)
        below = prev_base + tl.sum(masses, axis=0)  # G at each threshold
        over = below > removed_mass
        hi = tl.min(tl.where(over, threshold, prev_hi), axis=0)
        lo = tl.max(tl.where(over, prev_lo, threshold + 1), axis=0)
        base = tl.max(tl.where(over, prev_base, below), axis=0)  # G is non-decreasing: G(lo - 1)
    step = (hi - lo + THRESHOLDS) // THRESHOLDS
    return lo, hi, base, tl.minimum(lo + lane * step, hi)


@triton.jit
def _chunk_stats(Scores, ChunkMax, ChunkSum, vocab, stride_s, num_chunks, inv_temperature, CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr, HAS_TEMPERATURE: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:  # programmatic dependent launch (`_launch.pdl`): the scores or lists are earlier kernels' output
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    scores = Scores + row * stride_s
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for v0 in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        i = v0 + tl.arange(0, BLOCK)
        top = tl.maximum(top, _scaled(tl.load(scores + i, mask=i < vocab, other=float("-inf")), inv_temperature,
                                      HAS_TEMPERATURE))
    chunk_max = tl.max(top, axis=0)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    total = tl.zeros([BLOCK], tl.float32)
    for v0 in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        i = v0 + tl.arange(0, BLOCK)
        total += tl.exp(_scaled(tl.load(scores + i, mask=i < vocab, other=float("-inf")), inv_temperature,
                                HAS_TEMPERATURE) - chunk_max)
    # An all -inf chunk has max -inf: its sum is 0, and exp(-inf - top) weighs it out of the row's total.
    chunk_sum = tl.where(chunk_max == float("-inf"), 0.0, tl.sum(total, axis=0))
    tl.store(ChunkMax + row * num_chunks + chunk, chunk_max)
    tl.store(ChunkSum + row * num_chunks + chunk, chunk_sum)


@triton.jit
def _compact(Scores, ChunkMax, ChunkSum, List, Count, Below, vocab, stride_s, num_chunks, removed_mass,
             inv_temperature, CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
             HAS_TEMPERATURE: tl.constexpr, USE_GDC: tl.constexpr):
    """This chunk's mass below `t_lo`, and its scores above it, in index order, into list 0."""
    if USE_GDC:  # programmatic dependent launch (`_launch.pdl`): the scores or lists are earlier kernels' output
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    scores = Scores + row * stride_s
    top, inv_total = _row_softmax(ChunkMax, ChunkSum, row, num_chunks, BLOCK_C)
    floor = _floor_key(top, inv_total, vocab, removed_mass)
    out = List + (row * num_chunks + chunk) * CHUNK
    below = tl.zeros([BLOCK], tl.float32)
    written = tl.zeros([], tl.int32)
    for v0 in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        i = v0 + tl.arange(0, BLOCK)
        valid = i < vocab
        x = _scaled(tl.load(scores + i, mask=valid, other=float("-inf")), inv_temperature, HAS_TEMPERATURE)
        key = _ordered_key(x)
        below += tl.where(valid & (key < floor), tl.exp(x - top) * inv_total, 0.0)
        keep = (valid & (key >= floor)).to(tl.int32)
        tl.store(out + written + tl.cumsum(keep, axis=0) - keep, x, mask=keep == 1)
        written += tl.sum(keep, axis=0)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(Count + row * num_chunks + chunk, written)
    tl.store(Below + row * num_chunks + chunk, tl.sum(below, axis=0))


@triton.jit
def _threshold_pass(
    ChunkMax, ChunkSum, List, Count, Below, Bracket, Base, Mass, Ties, vocab, num_rows, num_chunks, removed_mass,
    PASS, THRESHOLDS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
    FINAL: tl.constexpr, USE_GDC: tl.constexpr,
):
    """Pass `PASS` < 8 reads list `PASS % 2`: the mass of its entries inside the bracket at the pass's 16 thresholds,
    and those entries into the other list. `FINAL` (pass 8): the bracket is the cut; this chunk's count of entries
    at it."""
    if USE_GDC:  # programmatic dependent launch (`_launch.pdl`): the scores or lists are earlier kernels' output
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    top, inv_total = _row_softmax(ChunkMax, ChunkSum, row, num_chunks, BLOCK_C)
    first_lo = _floor_key(top, inv_total, vocab, removed_mass).to(tl.int64)
    first_hi = _ordered_key(top).to(tl.int64)
    lo, hi, base, threshold = _bracket(Below, Bracket, Base, Mass, row, num_rows, num_chunks, removed_mass,
                                       first_lo, first_hi, PASS, THRESHOLDS, BLOCK_C)
    if chunk == 0:  # every program of the row computed the same bracket; one stores it for the next pass
        tl.store(Bracket + (PASS * num_rows + row) * 2, lo)
        tl.store(Bracket + (PASS * num_rows + row) * 2 + 1, hi)
        tl.store(Base + PASS * num_rows + row, base)
    if USE_GDC:  # the rest reads one short list: let the next pass launch and wait
        tl.extra.cuda.gdc_launch_dependents()
    slot = row * num_chunks + chunk
    source = (PASS % 2) * num_rows * num_chunks + slot
    entries = List + source * CHUNK
    count = tl.load(Count + source)
    if FINAL:
        ties = tl.zeros([BLOCK], tl.int32)
        for v0 in range(0, count, BLOCK):
            i = v0 + tl.arange(0, BLOCK)
            key = _ordered_key(tl.load(entries + i, mask=i < count, other=float("-inf")))
            ties += ((i < count) & (key == hi)).to(tl.int32)
        tl.store(Ties + slot, tl.sum(ties, axis=0))
    else:
        target = ((PASS + 1) % 2) * num_rows * num_chunks + slot
        out = List + target * CHUNK
        threshold32 = threshold.to(tl.int32)
        mass = tl.zeros([BLOCK, THRESHOLDS], tl.float32)
        written = tl.zeros([], tl.int32)
        for v0 in range(0, count, BLOCK):
            i = v0 + tl.arange(0, BLOCK)
            x = tl.load(entries + i, mask=i < count, other=float("-inf"))
            key = _ordered_key(x)
            inside = (i < count) & (key >= lo) & (key <= hi)
            p = tl.where(inside, tl.exp(x - top) * inv_total, 0.0)
            mass += tl.where(key[:, None] <= threshold32[None, :], p[:, None], 0.0)
            keep = inside.to(tl.int32)
            tl.store(out + written + tl.cumsum(keep, axis=0) - keep, x, mask=inside)
            written += tl.sum(keep, axis=0)
        lane = tl.arange(0, THRESHOLDS)
        tl.store(Mass + ((PASS * num_rows + row) * num_chunks + chunk) * THRESHOLDS + lane, tl.sum(mass, axis=0))
        tl.store(Count + target, written)


@triton.jit
def _write_filtered(
    Scores, Out, ChunkMax, ChunkSum, Bracket, Base, Ties, vocab, stride_s, stride_o, num_rows, num_chunks,
    removed_mass, filter_value, inv_temperature, PASSES: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_C: tl.constexpr, HAS_TEMPERATURE: tl.constexpr, USE_GDC: tl.constexpr,
):
    if USE_GDC:  # programmatic dependent launch (`_launch.pdl`): the scores or lists are earlier kernels' output
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    top, inv_total = _row_softmax(ChunkMax, ChunkSum, row, num_chunks, BLOCK_C)
    cut = tl.load(Bracket + (PASSES * num_rows + row) * 2 + 1).to(tl.int32)
    below = tl.load(Base + PASSES * num_rows + row)  # G(cut - 1): the mass strictly below the cut
    p_cut = tl.exp(_score_of_key(cut) - top) * inv_total
    c = tl.arange(0, BLOCK_C)
    ties_before = tl.sum(tl.load(Ties + row * num_chunks + c, mask=c < chunk, other=0), axis=0)
    ties_removed = tl.maximum(tl.floor((removed_mass - below) / p_cut), 0.0).to(tl.int32)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    scores = Scores + row * stride_s
    out = Out + row * stride_o
    ties_seen = ties_before
    for v0 in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        i = v0 + tl.arange(0, BLOCK)
        valid = i < vocab
        x = _scaled(tl.load(scores + i, mask=valid, other=float("-inf")), inv_temperature, HAS_TEMPERATURE)
        key = _ordered_key(x)
        tie = (valid & (key == cut)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
        keep = (key > cut) | ((tie == 1) & (tie_rank >= ties_removed))
        tl.store(out + i, tl.where(keep, x, filter_value), mask=valid)
        ties_seen += tl.sum(tie, axis=0)


def temperature_reciprocal(temperature: float) -> float:
    """`1 / temperature` in fp32, as PyTorch's CUDA kernels divide by a Python number (`a * (1 / b)`, the reciprocal
    rounded once; the CPU divides exactly)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32))


def top_p_filter(scores: torch.Tensor, top_p: float, filter_value: float = float("-inf"),
                 temperature: float | None = None) -> torch.Tensor:
    """`TopPLogitsWarper(top_p, filter_value)(None, scores)` for `(N, V)` scores with `MIN_TOP_P <= top_p < 1` (and
    `min_tokens_to_keep=1`, which this rule always honours). Returns a new fp32 tensor.

    `scores` in fp32, or in bf16 / fp16, read as the fp32 copy `generate` makes (exact). `temperature`: first divide
    them by it, as `TemperatureLogitsWarper` does on CUDA (bit for bit: times `temperature_reciprocal`), so the pair
    costs no extra pass over the rows."""
    if not MIN_TOP_P <= top_p < 1.0:
        raise ValueError(f"top_p_filter needs {MIN_TOP_P} <= top_p < 1, got {top_p}")
    if scores.dtype not in (torch.float32, torch.bfloat16, torch.float16) or scores.dim() != 2:
        raise ValueError(f"top_p_filter takes (N, V) scores in float32, bfloat16 or float16, got {scores.dtype} "
                         f"{tuple(scores.shape)}")
    if temperature is not None and not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"top_p_filter: temperature must be a positive number or None, got {temperature!r}")
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    rows, vocab = scores.shape
    tuning = TUNING if scores.device.type == "cuda" else _CPU_TUNING
    chunk, block = tuning["chunk"], tuning["block"]
    num_chunks = triton.cdiv(vocab, chunk)
    block_c = triton.next_power_of_2(num_chunks)
    device = scores.device
    f32 = dict(dtype=torch.float32, device=device)
    chunk_max, chunk_sum = _launch.empty(rows, num_chunks, **f32), _launch.empty(rows, num_chunks, **f32)
    lists = _launch.empty(2, rows, num_chunks, chunk, **f32)  # two lists: a pass reads one and writes the other
    count = _launch.empty(2, rows, num_chunks, dtype=torch.int32, device=device)
    below = _launch.empty(rows, num_chunks, **f32)
    bracket = _launch.empty(PASSES + 1, rows, 2, dtype=torch.int64, device=device)
    base = _launch.empty(PASSES + 1, rows, **f32)
    mass = _launch.empty(PASSES, rows, num_chunks, THRESHOLDS, **f32)
    ties = _launch.empty(rows, num_chunks, dtype=torch.int32, device=device)
    out = _launch.empty(rows, vocab, **f32)
    # The warper compares the fp32 cumulative sums with 1 - top_p rounded to fp32: so does the kernel.
    removed_mass = float(torch.tensor(1.0 - top_p, dtype=torch.float32))
    grid = (rows, num_chunks)
    common = dict(CHUNK=chunk, BLOCK=block, num_warps=tuning["num_warps"], USE_GDC=_launch.pdl(device),
                  **_launch.pdl_launch(device))
    scaling = dict(HAS_TEMPERATURE=temperature is not None)
    t = temperature_reciprocal(temperature) if temperature is not None else 1.0
    _chunk_stats[grid](scores, chunk_max, chunk_sum, vocab, scores.stride(0), num_chunks, t, **scaling, **common)
    _compact[grid](scores, chunk_max, chunk_sum, lists, count, below, vocab, scores.stride(0), num_chunks,
                   removed_mass, t, BLOCK_C=block_c, **scaling, **common)
    for step in range(PASSES + 1):
        _threshold_pass[grid](
            chunk_max, chunk_sum, lists, count, below, bracket, base, mass, ties, vocab, rows, num_chunks,
            removed_mass, step, THRESHOLDS=THRESHOLDS, BLOCK_C=block_c, FINAL=step == PASSES, **common,
        )
    _write_filtered[grid](
        scores, out, chunk_max, chunk_sum, bracket, base, ties, vocab, scores.stride(0), out.stride(0), rows,
        num_chunks, removed_mass, float(filter_value), t, PASSES=PASSES, BLOCK_C=block_c, **scaling, **common,
    )
    return out
