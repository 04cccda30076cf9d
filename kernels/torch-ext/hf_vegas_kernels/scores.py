"""Collect-2-Query scores from the logits the verification kernel emitted: head mean, rows, softmax weights."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch


@triton.jit
def _finalize_scores(
    Emit, Lse, ScoreRows, CandStart, CandEnd, QSlot, Out, num_slots, window,
    stride_eb, stride_er, stride_eh, stride_lb, stride_lt, stride_ob, stride_or, stride_qb,
    EMIT_HEADS: tl.constexpr, Q_HEADS: tl.constexpr, NUM_ROWS: tl.constexpr,
    WEIGHTS: tl.constexpr, MEAN_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_WINDOW: tl.constexpr, USE_GDC: tl.constexpr,
):
    if USE_GDC:  # programmatic dependent launch (`_launch.pdl`): the logits are the attention kernel's output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    slot = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    in_buffer = slot < num_slots
    candidate = (slot < tl.load(CandEnd + b)) & (slot >= tl.load(CandStart + b))
    h = tl.arange(0, BLOCK_H)
    h_ok = h < EMIT_HEADS
    ok = h_ok[:, None] & candidate[None, :]
    total = tl.zeros([BLOCK_S], tl.float32)
    for r in tl.static_range(NUM_ROWS):
        t_r = tl.load(ScoreRows + r)
        seen = ok
        if HAS_WINDOW:  # a candidate the row's window has left scores 0 for it (no weight; logits masked to 0)
            seen = seen & (slot > tl.load(QSlot + b * stride_qb + t_r) - window)[None, :]
        values = tl.load(Emit + b * stride_eb + r * stride_er + h[:, None] * stride_eh + slot[None, :],
                         mask=seen, other=0.0).to(tl.float32)  # every emitted head of this row at once
        if WEIGHTS:  # softmax weight of head h: exp(logit - that head's log-sum-exp over the row)
            lse = tl.load(Lse + b * stride_lb + t_r * stride_lt + h, mask=h_ok, other=0.0)
            values = tl.where(seen, tl.exp(values - lse[:, None]), 0.0)
        row = tl.sum(values, axis=0) / Q_HEADS  # emitted heads hold either one head each or a KV head's group sum
        if MEAN_ROWS:
            total += row
        else:
            tl.store(Out + b * stride_ob + r * stride_or + slot, tl.where(candidate, row, float("-inf")),
                     mask=in_buffer)
    if MEAN_ROWS:
        tl.store(Out + b * stride_ob + slot, tl.where(candidate, total / NUM_ROWS, float("-inf")), mask=in_buffer)


def finalize_scores(emitted, lse, score_rows, cand_end, q_heads: int, weights: bool, mean_rows: bool, out=None,
                    cand_start=None, window=None, q_slot=None):
    """Scores `(B, 1 if mean_rows else R, S)` fp32, `-inf` outside `[cand_start, cand_end)` (`cand_start` `(B,)`,
    default 0: a windowed layer's candidates start inside its window), written into `out` if given. Only candidate
    slots of `emitted` are read: the verification kernel emits the slots it reads, which cover them.

    With a sliding `window` (and the forward's `q_slot` `(B, T)`), a candidate outside a score row's window scores
    0 for that row, as `naive.row_scores` rates it.

    `emitted` `(B, R, heads, S)` holds logits per query head (`weights=True` needs them) or per KV-head group sum;
    `lse` `(B, T, Hq)` is the verification's log-sum-exp; `score_rows` `(R,)` the token rows that were emitted.
    """
    batch, num_rows, heads, num_slots = emitted.shape
    if out is None:
        out = _launch.empty(batch, 1 if mean_rows else num_rows, num_slots, dtype=torch.float32, device=emitted.device)
    block_h = triton.next_power_of_2(heads)
    tuning = _launch.SELECT_TUNING
    tile = tuning["finalize_tile"]
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"finalize_scores: SELECT_TUNING['finalize_tile'] must be a power of two, got {tile}")
    block = max(64, tile // block_h)  # one (heads x slots) tile per row and program
    if cand_start is None:
        cand_start = torch.zeros_like(cand_end)
    if window is not None and q_slot is None:
        raise ValueError("finalize_scores: a window needs the forward's q_slot")
    q_slot = q_slot if window is not None else cand_end[:, None]  # unread without a window
    _finalize_scores[(batch, triton.cdiv(num_slots, block))](
        emitted, lse, score_rows, cand_start, cand_end, q_slot, out, num_slots, int(window or 0),
        emitted.stride(0), emitted.stride(1), emitted.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), q_slot.stride(0),
        EMIT_HEADS=heads, Q_HEADS=q_heads, NUM_ROWS=num_rows, WEIGHTS=weights, MEAN_ROWS=mean_rows,
        BLOCK_H=block_h, BLOCK_S=block, HAS_WINDOW=window is not None, USE_GDC=_launch.pdl(emitted.device),
        num_warps=tuning["finalize_warps"], **_launch.pdl_launch(emitted.device),
    )
    return out
