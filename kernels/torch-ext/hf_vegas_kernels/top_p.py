"""Top-p (nucleus) filtering without sorting the vocabulary: the kept set of transformers' `TopPLogitsWarper`.

The warper sorts each row ascending, takes the cumulative softmax and removes every token whose cumulative
probability is at most `1 - top_p` (ties in ascending index order, as a stable sort leaves them). With
`G(t)` = the probability of the tokens whose score is at most `t`, that removes:

- every token scored below `t_c`, the smallest score with `G(t_c) > 1 - top_p`;
- of the tokens scored exactly `t_c`, the `floor((1 - top_p - G(below t_c)) / p(t_c))` of lowest index;

and keeps the rest (at least one token: the highest-index one scored `t_c`). `t_c` is found by a threshold search
over order-preserving int32 keys of the scores (16 thresholds per pass, 8 passes, as `select.py` does), one program
per row, reading the row from L2 a dozen times instead of sorting the 49K-256K entries of a vocabulary. The
cumulative sums are fp32 sums in another order than the sort's scan, so a token whose cumulative probability lies
within rounding of `1 - top_p` may fall on the other side (as it may between two GPUs running the warper itself).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch

_THRESHOLDS = 16


@triton.jit
def _ordered_key(x):
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _top_p_filter(
    Scores, Out, vocab, stride_s, stride_o, removed_mass, filter_value,
    BLOCK: tl.constexpr, THRESHOLDS: tl.constexpr,
):
    # Every loop accumulates per lane and reduces once after it: a cross-warp reduction per block would cost more
    # than the loads (they hit L2: a program re-reads its own row).
    row = tl.program_id(0).to(tl.int64)
    scores = Scores + row * stride_s
    top_lanes = tl.full([BLOCK], float("-inf"), tl.float32)
    for v0 in range(0, vocab, BLOCK):
        i = v0 + tl.arange(0, BLOCK)
        top_lanes = tl.maximum(top_lanes, tl.load(scores + i, mask=i < vocab, other=float("-inf")))
    top = tl.max(top_lanes, axis=0)
    total_lanes = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, vocab, BLOCK):
        i = v0 + tl.arange(0, BLOCK)
        total_lanes += tl.exp(tl.load(scores + i, mask=i < vocab, other=float("-inf")) - top)
    inv_total = 1.0 / tl.sum(total_lanes, axis=0)
    # Smallest key t with G(t) > removed_mass; G(INT32_MAX) is the whole mass, so the answer lies in [lo, hi].
    lane = tl.arange(0, THRESHOLDS).to(tl.int64)
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    while lo < hi:
        step = (hi - lo + THRESHOLDS) // THRESHOLDS
        threshold = tl.minimum(lo + lane * step, hi)
        threshold32 = threshold.to(tl.int32)
        mass_lanes = tl.zeros([BLOCK, THRESHOLDS], tl.float32)
        for v0 in range(0, vocab, BLOCK):
            i = v0 + tl.arange(0, BLOCK)
            x = tl.load(scores + i, mask=i < vocab, other=float("-inf"))
            p = tl.exp(x - top) * inv_total
            mass_lanes += tl.where(_ordered_key(x)[:, None] <= threshold32[None, :], p[:, None], 0.0)
        over = tl.sum(mass_lanes, axis=0) > removed_mass
        hi = tl.min(tl.where(over, threshold, hi), axis=0)
        lo = tl.max(tl.where(over, lo, threshold + 1), axis=0)
    cut = hi.to(tl.int32)
    # Mass strictly below the cut, and the probability of a token scored exactly at it.
    below_lanes = tl.zeros([BLOCK], tl.float32)
    p_cut_lanes = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, vocab, BLOCK):
        i = v0 + tl.arange(0, BLOCK)
        x = tl.load(scores + i, mask=i < vocab, other=float("-inf"))
        p = tl.exp(x - top) * inv_total
        key = _ordered_key(x)
        below_lanes += tl.where(key < cut, p, 0.0)
        p_cut_lanes = tl.maximum(p_cut_lanes, tl.where(key == cut, p, 0.0))
    below = tl.sum(below_lanes, axis=0)
    p_cut = tl.max(p_cut_lanes, axis=0)
    ties_removed = tl.maximum(tl.floor((removed_mass - below) / p_cut), 0.0).to(tl.int32)
    out = Out + row * stride_o
    ties_seen = tl.zeros([], tl.int32)
    for v0 in range(0, vocab, BLOCK):
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
    """`TopPLogitsWarper(top_p, filter_value)(None, scores)` for fp32 `scores` `(N, V)` with `0 < top_p < 1`
    (and `min_tokens_to_keep=1`, which this rule always honours). Returns a new tensor."""
    if not 0.0 < top_p < 1.0:
        raise ValueError(f"top_p_filter needs 0 < top_p < 1, got {top_p}")
    if scores.dtype != torch.float32 or scores.dim() != 2:
        raise ValueError(f"top_p_filter takes fp32 (N, V) scores, got {scores.dtype} {tuple(scores.shape)}")
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    out = _launch.empty(*scores.shape, dtype=torch.float32, device=scores.device)
    # The warper compares the fp32 cumulative sums with 1 - top_p rounded to fp32: so does the kernel.
    removed_mass = float(torch.tensor(1.0 - top_p, dtype=torch.float32))
    block = 512 if scores.device.type == "cuda" else 256
    _top_p_filter[(scores.shape[0],)](
        scores, out, scores.shape[1], scores.stride(0), out.stride(0), removed_mass, float(filter_value),
        BLOCK=block, THRESHOLDS=_THRESHOLDS, num_warps=8,
    )
    return out
