"""Top-p (nucleus) filtering without sorting the vocabulary: the kept set of transformers' `TopPLogitsWarper`.

The warper sorts each row ascending, takes the cumulative softmax and removes every token whose cumulative
probability is at most `1 - top_p` (ties in ascending index order, as a stable sort leaves them). With
`G(t)` = the probability of the tokens whose score is at most `t`, that removes:

- every token scored below `t_c`, the smallest score with `G(t_c) > 1 - top_p`;
- of the tokens scored exactly `t_c`, the `floor((1 - top_p - G(below t_c)) / p(t_c))` of lowest index;

and keeps the rest (at least one token: the highest-index one scored `t_c`). `t_c` is pinned by a threshold search
over order-preserving int32 keys of the scores: each pass measures `G` at 16 thresholds and keeps the bracket that
holds `t_c`, so 8 passes pin all 32 bits. Every pass is one launch of (row, chunk) programs: a row is spread over
the whole GPU instead of one program re-reading it a dozen times (one program per row measured 1.3 ms for 448 rows
of 49K on an H100, these launches 1.0 ms, the sort 2.8 ms). A pass's programs each rebuild their row's bracket
from the previous pass's per-chunk masses, in the same order, so all of them agree; 11 launches in all, no host
synchronisation.

Tried and dropped (79809b6): starting the search at `[max - ln(V / (1 - top_p)) - 1, max]` and shrinking each bracket
to the keys of the tokens inside it pinned most rows after 3-5 passes, and the later passes read nothing; but the
extra per-interval key minimum and maximum made the passes that run dearer than the skipped ones saved (H100,
`benchmarks/top_p.py`: 64 x 49K 214 us against 164, 448 x 49K 1045 against 1030).

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
# Elements per program and per inner step, from `benchmarks/top_p.py --sweep` on an H100 (64 and 448 rows of 49K and
# 152K; results/top_p.jsonl): 164 us for 64 x 49K and 1.03 ms for 448 x 49K, against 455 us and 2.77 ms for the
# warper's sort. The CPU interpreter's are small so that tests cross chunk boundaries.
TUNING = {"chunk": 4096, "block": 256, "num_warps": 4}
_CPU_TUNING = {"chunk": 256, "block": 128, "num_warps": 4}


@triton.jit
def _ordered_key(x):
    # + 0.0 turns -0.0 into +0.0: the sort ranks them as equal (ties broken by index), so must the keys
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


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
def _bracket(Bracket, Mass, row, num_rows, num_chunks, removed_mass, PASS, THRESHOLDS: tl.constexpr,
             BLOCK_C: tl.constexpr):
    """`[lo, hi]` before pass `PASS` (holding t_c), and that pass's thresholds. Pass p's bracket follows from pass
    p - 1's bracket (stored) and masses (summed over the row's chunks here, in the same order by every program)."""
    lane = tl.arange(0, THRESHOLDS).to(tl.int64)
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    if PASS > 0:
        lo = tl.load(Bracket + ((PASS - 1) * num_rows + row) * 2)
        hi = tl.load(Bracket + ((PASS - 1) * num_rows + row) * 2 + 1)
        step = (hi - lo + THRESHOLDS) // THRESHOLDS
        threshold = tl.minimum(lo + lane * step, hi)
        c = tl.arange(0, BLOCK_C)
        masses = tl.load(Mass + (((PASS - 1) * num_rows + row) * num_chunks + c[:, None]) * THRESHOLDS
                         + lane[None, :], mask=(c < num_chunks)[:, None], other=0.0)
        over = tl.sum(masses, axis=0) > removed_mass
        hi = tl.min(tl.where(over, threshold, hi), axis=0)
        lo = tl.max(tl.where(over, lo, threshold + 1), axis=0)
    step = (hi - lo + THRESHOLDS) // THRESHOLDS
    return lo, hi, tl.minimum(lo + lane * step, hi)


@triton.jit
def _chunk_stats(Scores, ChunkMax, ChunkSum, vocab, stride_s, num_chunks, CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    scores = Scores + row * stride_s
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for v0 in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        i = v0 + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.load(scores + i, mask=i < vocab, other=float("-inf")))
    chunk_max = tl.max(top, axis=0)
    total = tl.zeros([BLOCK], tl.float32)
    for v0 in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        i = v0 + tl.arange(0, BLOCK)
        total += tl.exp(tl.load(scores + i, mask=i < vocab, other=float("-inf")) - chunk_max)
    # An all -inf chunk has max -inf: its sum is 0, and exp(-inf - top) weighs it out of the row's total.
    chunk_sum = tl.where(chunk_max == float("-inf"), 0.0, tl.sum(total, axis=0))
    tl.store(ChunkMax + row * num_chunks + chunk, chunk_max)
    tl.store(ChunkSum + row * num_chunks + chunk, chunk_sum)


@triton.jit
def _threshold_pass(
    Scores, ChunkMax, ChunkSum, Bracket, Mass, CutStats, vocab, stride_s, num_rows, num_chunks, removed_mass, PASS,
    THRESHOLDS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
    FINAL: tl.constexpr,
):
    """Pass `PASS` < 8: this chunk's mass at the pass's 16 thresholds. `FINAL` (pass 8): the bracket is the cut;
    this chunk's mass below it, the probability at it, and its count of tokens at it."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    scores = Scores + row * stride_s
    top, inv_total = _row_softmax(ChunkMax, ChunkSum, row, num_chunks, BLOCK_C)
    lo, hi, threshold = _bracket(Bracket, Mass, row, num_rows, num_chunks, removed_mass, PASS, THRESHOLDS, BLOCK_C)
    if chunk == 0:  # every program of the row computed the same bracket; one stores it for the next pass
        tl.store(Bracket + (PASS * num_rows + row) * 2, lo)
        tl.store(Bracket + (PASS * num_rows + row) * 2 + 1, hi)
    if FINAL:
        cut = hi.to(tl.int32)
        below = tl.zeros([BLOCK], tl.float32)
        p_cut = tl.zeros([BLOCK], tl.float32)
        ties = tl.zeros([BLOCK], tl.int32)
        for v0 in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            i = v0 + tl.arange(0, BLOCK)
            x = tl.load(scores + i, mask=i < vocab, other=float("-inf"))
            p = tl.exp(x - top) * inv_total
            key = _ordered_key(x)
            below += tl.where(key < cut, p, 0.0)
            p_cut = tl.maximum(p_cut, tl.where(key == cut, p, 0.0))
            ties += ((i < vocab) & (key == cut)).to(tl.int32)
        base = CutStats + (row * num_chunks + chunk) * 3
        tl.store(base, tl.sum(below, axis=0))
        tl.store(base + 1, tl.max(p_cut, axis=0))
        tl.store(base + 2, tl.sum(ties, axis=0).to(tl.float32))
    else:
        threshold32 = threshold.to(tl.int32)
        mass = tl.zeros([BLOCK, THRESHOLDS], tl.float32)
        for v0 in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            i = v0 + tl.arange(0, BLOCK)
            x = tl.load(scores + i, mask=i < vocab, other=float("-inf"))
            p = tl.exp(x - top) * inv_total
            mass += tl.where(_ordered_key(x)[:, None] <= threshold32[None, :], p[:, None], 0.0)
        lane = tl.arange(0, THRESHOLDS)
        tl.store(Mass + ((PASS * num_rows + row) * num_chunks + chunk) * THRESHOLDS + lane, tl.sum(mass, axis=0))


@triton.jit
def _write_filtered(
    Scores, Out, Bracket, CutStats, vocab, stride_s, stride_o, num_rows, num_chunks, removed_mass, filter_value,
    PASSES: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cut = tl.load(Bracket + (PASSES * num_rows + row) * 2 + 1).to(tl.int32)
    c = tl.arange(0, BLOCK_C)
    ok = c < num_chunks
    stats = CutStats + (row * num_chunks + c) * 3
    below = tl.sum(tl.load(stats, mask=ok, other=0.0), axis=0)
    p_cut = tl.max(tl.load(stats + 1, mask=ok, other=0.0), axis=0)
    ties_before = tl.sum(tl.load(stats + 2, mask=c < chunk, other=0.0), axis=0).to(tl.int32)
    ties_removed = tl.maximum(tl.floor((removed_mass - below) / p_cut), 0.0).to(tl.int32)
    scores = Scores + row * stride_s
    out = Out + row * stride_o
    ties_seen = ties_before
    for v0 in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        i = v0 + tl.arange(0, BLOCK)
        valid = i < vocab
        x = tl.load(scores + i, mask=valid, other=float("-inf"))
        key = _ordered_key(x)
        tie = (valid & (key == cut)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
        keep = (key > cut) | ((tie == 1) & (tie_rank >= ties_removed))
        tl.store(out + i, tl.where(keep, x, filter_value), mask=valid)
        ties_seen += tl.sum(tie, axis=0)


def top_p_filter(scores: torch.Tensor, top_p: float, filter_value: float = float("-inf")) -> torch.Tensor:
    """`TopPLogitsWarper(top_p, filter_value)(None, scores)` for fp32 `scores` `(N, V)` with `MIN_TOP_P <= top_p < 1`
    (and `min_tokens_to_keep=1`, which this rule always honours). Returns a new tensor."""
    if not MIN_TOP_P <= top_p < 1.0:
        raise ValueError(f"top_p_filter needs {MIN_TOP_P} <= top_p < 1, got {top_p}")
    if scores.dtype != torch.float32 or scores.dim() != 2:
        raise ValueError(f"top_p_filter takes fp32 (N, V) scores, got {scores.dtype} {tuple(scores.shape)}")
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    rows, vocab = scores.shape
    tuning = TUNING if scores.device.type == "cuda" else _CPU_TUNING
    chunk, block = tuning["chunk"], tuning["block"]
    num_chunks = triton.cdiv(vocab, chunk)
    block_c = triton.next_power_of_2(num_chunks)
    f32 = dict(dtype=torch.float32, device=scores.device)
    chunk_max, chunk_sum = _launch.empty(rows, num_chunks, **f32), _launch.empty(rows, num_chunks, **f32)
    bracket = _launch.empty(PASSES + 1, rows, 2, dtype=torch.int64, device=scores.device)
    mass = _launch.empty(PASSES, rows, num_chunks, THRESHOLDS, **f32)
    cut_stats = _launch.empty(rows, num_chunks, 3, **f32)
    out = _launch.empty(rows, vocab, **f32)
    # The warper compares the fp32 cumulative sums with 1 - top_p rounded to fp32: so does the kernel.
    removed_mass = float(torch.tensor(1.0 - top_p, dtype=torch.float32))
    grid = (rows, num_chunks)
    common = dict(CHUNK=chunk, BLOCK=block, num_warps=tuning["num_warps"])
    _chunk_stats[grid](scores, chunk_max, chunk_sum, vocab, scores.stride(0), num_chunks, **common)
    for step in range(PASSES + 1):
        _threshold_pass[grid](
            scores, chunk_max, chunk_sum, bracket, mass, cut_stats, vocab, scores.stride(0), rows, num_chunks,
            removed_mass, step, THRESHOLDS=THRESHOLDS, BLOCK_C=block_c, FINAL=step == PASSES, **common,
        )
    _write_filtered[grid](
        scores, out, bracket, cut_stats, vocab, scores.stride(0), out.stride(0), rows, num_chunks, removed_mass,
        float(filter_value), PASSES=PASSES, BLOCK_C=block_c, **common,
    )
    return out
