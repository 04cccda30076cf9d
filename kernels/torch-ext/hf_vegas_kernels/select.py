"""Top-k selection per row without a host synchronisation: a radix-style threshold search, then compaction.

Scores are mapped to int32 keys with the same order as the floats. Each pass counts, for 16 evenly spaced
thresholds at once, how many candidates reach them and keeps the last threshold that still leaves at least `k`;
about 8 passes pin the k-th largest key exactly. One last pass writes the slots above it, then as many ties as
still fit, in slot order. The output lists are therefore ascending, which keeps the draft kernel's gathers local.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_THRESHOLDS = 16


@triton.jit
def _ordered_key(x):
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _select_topk(
    Scores, Count, CandEnd, Out, stride_sb, stride_ob,
    BLOCK_S: tl.constexpr, THRESHOLDS: tl.constexpr,
):
    b = tl.program_id(0)
    k = tl.load(Count + b).to(tl.int64)
    n = tl.load(CandEnd + b)
    lane = tl.arange(0, THRESHOLDS).to(tl.int64)
    # Invariant: at least k candidates have key >= lo, and the k-th largest key lies in [lo, hi].
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    while lo < hi:
        step = (hi - lo + THRESHOLDS) // THRESHOLDS
        threshold = lo + lane * step
        reached = tl.zeros([THRESHOLDS], tl.int64)
        for s0 in range(0, n, BLOCK_S):
            slot = s0 + tl.arange(0, BLOCK_S)
            valid = slot < n
            key = _ordered_key(tl.load(Scores + b * stride_sb + slot, mask=valid, other=0.0))
            hit = valid[:, None] & (key[:, None] >= threshold[None, :])
            reached += tl.sum(hit.to(tl.int64), axis=0)
        best = tl.max(tl.where(reached >= k, lane, 0), axis=0)
        lo = lo + best * step
        hi = tl.minimum(hi, lo + step - 1)
    kth = lo
    above = tl.zeros([], tl.int64)
    for s0 in range(0, n, BLOCK_S):
        slot = s0 + tl.arange(0, BLOCK_S)
        valid = slot < n
        key = _ordered_key(tl.load(Scores + b * stride_sb + slot, mask=valid, other=0.0))
        above += tl.sum((valid & (key > kth)).to(tl.int64), axis=0)
    ties_wanted = k - above
    taken = tl.zeros([], tl.int64)
    ties_seen = tl.zeros([], tl.int64)
    for s0 in range(0, n, BLOCK_S):
        slot = s0 + tl.arange(0, BLOCK_S)
        valid = slot < n
        key = _ordered_key(tl.load(Scores + b * stride_sb + slot, mask=valid, other=0.0))
        tie = (valid & (key == kth)).to(tl.int64)
        tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
        take = ((valid & (key > kth)) | ((tie == 1) & (tie_rank < ties_wanted))).to(tl.int64)
        position = taken + tl.cumsum(take, axis=0) - take
        tl.store(Out + b * stride_ob + position, slot.to(tl.int64), mask=take == 1)
        taken += tl.sum(take, axis=0)
        ties_seen += tl.sum(tie, axis=0)


def select_topk(scores: torch.Tensor, count: torch.Tensor, cand_end: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write into `out[b, :count[b]]` the slots of the `count[b]` highest `scores[b, :cand_end[b]]`, ascending.

    `count[b] <= cand_end[b]` is required (the budget never exceeds the candidates); `out[b, count[b]:]` is left
    untouched. Returns `out`.
    """
    batch = scores.shape[0]
    _select_topk[(batch,)](
        scores, count, cand_end, out, scores.stride(0), out.stride(0),
        BLOCK_S=1024, THRESHOLDS=_THRESHOLDS, num_warps=8,
    )
    return out
