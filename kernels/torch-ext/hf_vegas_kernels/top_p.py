"""Top-p (nucleus) filtering without sorting the vocabulary: the kept set of transformers' `TopPLogitsWarper`.

The warper sorts each row ascending, takes the cumulative softmax and removes every token whose cumulative
probability is at most `1 - top_p` (ties in ascending index order, as a stable sort leaves them). With
`G(t)` = the probability of the tokens whose score is at most `t`, that removes:

- every token scored below `t_c`, the smallest score with `G(t_c) > 1 - top_p`;
- of the tokens scored exactly `t_c`, the `floor((1 - top_p - G(below t_c)) / p(t_c))` of lowest index;

and keeps the rest (at least one token: the highest-index one scored `t_c`). `t_c` is pinned by a threshold search
over order-preserving int32 keys of the scores: each pass measures `G` at 16 thresholds and keeps the bracket that
holds `t_c`, so 8 passes pin all 32 bits.

Only a few tokens of a row can hold the cut. Each token scored at most `t_lo = max + ln((1 - top_p) * Z / V) - 1`
(`Z` the softmax sum over `exp(x - max)`, `V` the vocabulary) has a probability below `(1 - top_p) / (e V)`, so all
of them together stay below `1 - top_p`: `t_c > t_lo`. So, in four launches and no host synchronisation:

1. (row, chunk) programs: each chunk's maximum and softmax sum;
2. (row, chunk) programs: each chunk's mass below `t_lo`, and its scores above it, in index order, into a list;
3. one program per row: the 8 passes over the row's lists (every chunk's list side by side), each keeping the
   entries inside its bracket for the next, then each chunk's count of entries at the cut;
4. (row, chunk) programs: the filtered copy.

Launches 1, 2 and 4 read the whole row spread over the GPU; the search reads lists of a few entries when the
distribution is peaked (a trained model's), and at most the row when it is flat (a random model's). Until e0b2096
each pass was a launch of (row, chunk) programs comparing every score with its 16 thresholds (11 launches), and at
9612478 each pass was a launch over the lists (12 launches). On an H100 (`benchmarks/top_p.py`,
results/top_p.jsonl) rows shaped like a trained model's (`--logits peaked`) took 80 us for 64 x 49K and 356 us for
448 x 49K at 9612478 (168 and 1,023 at e0b2096, same call, from a one-off A/B script), flat rows 88 and 413 (164 and
1,021), the warper's sort 458 and 2,756.

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
TUNING = {"chunk": 4096, "block": 256, "num_warps": 4, "search_tile": 512, "search_warps": 4}
_CPU_TUNING = {"chunk": 256, "block": 64, "num_warps": 4, "search_tile": 16, "search_warps": 4}


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
def _compact(Scores, ChunkMax, ChunkSum, List, Count, Below, vocab, stride_s, num_chunks, removed_mass,
             CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    """This chunk's mass below `t_lo`, and its scores above it, in index order, into list 0."""
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
        x = tl.load(scores + i, mask=valid, other=float("-inf"))
        key = _ordered_key(x)
        below += tl.where(valid & (key < floor), tl.exp(x - top) * inv_total, 0.0)
        keep = (valid & (key >= floor)).to(tl.int32)
        tl.store(out + written + tl.cumsum(keep, axis=0) - keep, x, mask=keep == 1)
        written += tl.sum(keep, axis=0)
    tl.store(Count + row * num_chunks + chunk, written)
    tl.store(Below + row * num_chunks + chunk, tl.sum(below, axis=0))


@triton.jit
def _search(
    ChunkMax, ChunkSum, List, Count, Below, Cut, Base, Ties, vocab, num_rows, num_chunks, removed_mass,
    THRESHOLDS: tl.constexpr, PASSES: tl.constexpr, CHUNK: tl.constexpr, ENTRIES: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program per row: the 8 threshold passes over the row's lists (all its chunks' lists side by side, ENTRIES
    of each per step), each keeping the entries inside its bracket for the next, then the count of entries at the
    cut in each chunk. Stores the cut, G(cut - 1) and the per-chunk tie counts."""
    row = tl.program_id(0).to(tl.int64)
    top, inv_total = _row_softmax(ChunkMax, ChunkSum, row, num_chunks, BLOCK_C)
    c = tl.arange(0, BLOCK_C)
    chunk_ok = c < num_chunks
    lane = tl.arange(0, THRESHOLDS).to(tl.int64)
    e = tl.arange(0, ENTRIES)
    # Smallest key t with G(t) > removed_mass: in [lo, hi], and base = G(lo - 1).
    lo = _floor_key(top, inv_total, vocab, removed_mass).to(tl.int64)
    hi = _ordered_key(top).to(tl.int64)
    base = tl.sum(tl.load(Below + row * num_chunks + c, mask=chunk_ok, other=0.0), axis=0)
    counts = tl.load(Count + row * num_chunks + c, mask=chunk_ok, other=0)
    lists = List + (row * num_chunks + c[:, None]) * CHUNK  # list 0 of each chunk; list 1 lies num_rows rows on
    other = num_rows * num_chunks * CHUNK
    for step in range(PASSES):
        source = lists + (step % 2) * other
        target = lists + ((step + 1) % 2) * other
        stride = (hi - lo + THRESHOLDS) // THRESHOLDS
        threshold = tl.minimum(lo + lane * stride, hi)
        threshold32 = threshold.to(tl.int32)
        mass = tl.zeros([BLOCK_C, THRESHOLDS], tl.float32)
        written = tl.zeros([BLOCK_C], tl.int32)
        for e0 in range(0, tl.max(counts, axis=0), ENTRIES):
            valid = (e0 + e)[None, :] < counts[:, None]
            x = tl.load(source + e0 + e[None, :], mask=valid, other=float("-inf"))
            key = _ordered_key(x)
            inside = valid & (key >= lo) & (key <= hi)
            p = tl.where(inside, tl.exp(x - top) * inv_total, 0.0)
            mass += tl.sum(tl.where(key[:, :, None] <= threshold32[None, None, :], p[:, :, None], 0.0), axis=1)
            keep = inside.to(tl.int32)
            tl.store(target + written[:, None] + tl.cumsum(keep, axis=1) - keep, x, mask=inside)
            written += tl.sum(keep, axis=1)
        counts = written
        tl.debug_barrier()  # the next pass reads what every thread of this program wrote
        below = base + tl.sum(mass, axis=0)  # G at each threshold
        over = below > removed_mass
        new_hi = tl.min(tl.where(over, threshold, hi), axis=0)
        new_lo = tl.max(tl.where(over, lo, threshold + 1), axis=0)
        base = tl.max(tl.where(over, base, below), axis=0)  # G is non-decreasing: G(new_lo - 1)
        lo, hi = new_lo, new_hi
    # 16 ** 8 keys: the bracket is one key, the cut. Its ties sit in the last pass's lists (list PASSES % 2).
    source = lists + (PASSES % 2) * other
    ties = tl.zeros([BLOCK_C], tl.int32)
    for e0 in range(0, tl.max(counts, axis=0), ENTRIES):
        valid = (e0 + e)[None, :] < counts[:, None]
        key = _ordered_key(tl.load(source + e0 + e[None, :], mask=valid, other=float("-inf")))
        ties += tl.sum((valid & (key == hi)).to(tl.int32), axis=1)
    tl.store(Ties + row * num_chunks + c, ties, mask=chunk_ok)
    tl.store(Cut + row, hi.to(tl.int32))
    tl.store(Base + row, base)


@triton.jit
def _write_filtered(
    Scores, Out, ChunkMax, ChunkSum, Cut, Base, Ties, vocab, stride_s, stride_o, num_chunks, removed_mass,
    filter_value, CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    top, inv_total = _row_softmax(ChunkMax, ChunkSum, row, num_chunks, BLOCK_C)
    cut = tl.load(Cut + row)
    below = tl.load(Base + row)  # G(cut - 1): the mass strictly below the cut
    p_cut = tl.exp(_score_of_key(cut) - top) * inv_total
    c = tl.arange(0, BLOCK_C)
    ties_before = tl.sum(tl.load(Ties + row * num_chunks + c, mask=c < chunk, other=0), axis=0)
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
    device = scores.device
    f32 = dict(dtype=torch.float32, device=device)
    chunk_max, chunk_sum = _launch.empty(rows, num_chunks, **f32), _launch.empty(rows, num_chunks, **f32)
    lists = _launch.empty(2, rows, num_chunks, chunk, **f32)  # two lists: a pass reads one and writes the other
    count = _launch.empty(rows, num_chunks, dtype=torch.int32, device=device)
    below = _launch.empty(rows, num_chunks, **f32)
    cut = _launch.empty(rows, dtype=torch.int32, device=device)
    base = _launch.empty(rows, **f32)
    ties = _launch.empty(rows, num_chunks, dtype=torch.int32, device=device)
    out = _launch.empty(rows, vocab, **f32)
    # The warper compares the fp32 cumulative sums with 1 - top_p rounded to fp32: so does the kernel.
    removed_mass = float(torch.tensor(1.0 - top_p, dtype=torch.float32))
    grid = (rows, num_chunks)
    common = dict(CHUNK=chunk, BLOCK=block, num_warps=tuning["num_warps"])
    _chunk_stats[grid](scores, chunk_max, chunk_sum, vocab, scores.stride(0), num_chunks, **common)
    _compact[grid](scores, chunk_max, chunk_sum, lists, count, below, vocab, scores.stride(0), num_chunks,
                   removed_mass, BLOCK_C=block_c, **common)
    # A step of the search takes ENTRIES entries of every chunk's list at once: about `search_tile` in all.
    entries = max(1, tuning["search_tile"] // block_c)
    _search[(rows,)](
        chunk_max, chunk_sum, lists, count, below, cut, base, ties, vocab, rows, num_chunks, removed_mass,
        THRESHOLDS=THRESHOLDS, PASSES=PASSES, CHUNK=chunk, ENTRIES=entries, BLOCK_C=block_c,
        num_warps=tuning["search_warps"],
    )
    _write_filtered[grid](
        scores, out, chunk_max, chunk_sum, cut, base, ties, vocab, scores.stride(0), out.stride(0), num_chunks,
        removed_mass, float(filter_value), BLOCK_C=block_c, **common,
    )
    return out
