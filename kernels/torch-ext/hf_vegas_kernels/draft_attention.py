"""Sparse draft attention of one query token per row, with every KV head of a row in one program.

`attention._attend_list` gives each (row, KV head) its own program, which gathers 2 * head_dim bytes per slot. At
a small model's draft shape (SmolLM2: 3 KV heads of 64) that is 128-byte reads scattered over the cache, and 192
programs for 132 SMs at batch 64 (one wave and a half). Here a program owns one row and reads each selected slot's
keys and values of all KV heads at once, `kv_heads * head_dim` contiguous elements of the `(B, S, H, D)` storage.

The query tile is block-diagonal: query head `m` holds its vector in the columns of its own KV head and zeros
elsewhere, so `q_wide @ k_wide^T` is exactly each head's own logits, and row `m` of `p @ v_wide` holds that head's
output in its KV head's columns (the other columns are discarded). Same list semantics as the sparse path of
`_attend_list` (selected slots, then the tail `[sel_end, kv_len)`), same split states for `_combine_splits`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from .attention import _combine_splits, _num_splits, _tanh


@triton.jit
def _attend_all_heads(
    Q, K, V, QSlot, KvLen, SelIdx, SelCount, SelEnd, MPart, LPart, OPart, Out, Lse,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_vb, stride_vs, stride_sb, stride_ob, stride_oh, stride_lb,
    chunk, scaling, softcap,
    Q_HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, WIDE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, SINGLE: tl.constexpr,
):
    split = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    num_splits = tl.num_programs(0)
    m = tl.arange(0, BLOCK_M)  # query head
    w = tl.arange(0, BLOCK_W)  # column of the wide (kv_heads * head_dim) key/value row
    m_ok = m < Q_HEADS
    own = m_ok[:, None] & (w[None, :] // HEAD_DIM == m[:, None] // GROUPS) & (w[None, :] < WIDE)
    q = tl.load(Q + b * stride_qb + m[:, None] * stride_qh + (w % HEAD_DIM)[None, :], mask=own, other=0.0)
    q_slot = tl.load(QSlot + b)

    kv_len = tl.load(KvLen + b)
    sel_end = tl.load(SelEnd + b)
    count = tl.load(SelCount + b)
    n = count + tl.maximum(kv_len - sel_end, 0)
    start = split.to(tl.int64) * chunk
    end = tl.where(split == num_splits - 1, n, tl.minimum(start + chunk, n))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    w_ok = w < WIDE
    for p0 in range(start, end, BLOCK_N):
        p = p0 + tl.arange(0, BLOCK_N)
        in_list = p < end
        chosen = p < count
        picked = tl.load(SelIdx + b * stride_sb + p, mask=in_list & chosen, other=0)
        slot = tl.where(chosen, picked, sel_end + p - count)
        k = tl.load(K + b * stride_kb + slot[:, None] * stride_ks + w[None, :],
                    mask=in_list[:, None] & w_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling
        if HAS_SOFTCAP:
            s = _tanh(s / softcap) * softcap
        s = tl.where(in_list[None, :] & (slot[None, :] <= q_slot), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        probs = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(probs, axis=1)
        v = tl.load(V + b * stride_vb + slot[:, None] * stride_vs + w[None, :],
                    mask=in_list[:, None] & w_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    d = w - (m // GROUPS)[:, None] * HEAD_DIM  # column within the head's own output
    if SINGLE:
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        tl.store(Out + b * stride_ob + m[:, None] * stride_oh + d, out.to(Out.dtype.element_ty), mask=own)
        tl.store(Lse + b * stride_lb + m, tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf")),
                 mask=m_ok)
    else:
        # The split states of `_attend_list`: (row * kv_heads + kv_head, split, query head within the group).
        kv_heads = Q_HEADS // GROUPS
        part = ((b * kv_heads + m // GROUPS) * num_splits + split) * GROUPS + m % GROUPS
        tl.store(MPart + part, m_i, mask=m_ok)
        tl.store(LPart + part, l_i, mask=m_ok)
        tl.store(OPart + part[:, None] * HEAD_DIM + d, acc, mask=own)


# Widest key/value row (kv_heads * head_dim) one program holds: two 256-column tiles per stage fit comfortably.
MAX_WIDE = 256


def fits(q, k_cache, v_cache) -> bool:
    """Whether `attend_all_heads` can run this draft: one query token, values as wide as keys, all KV heads of a
    slot contiguous (the `(B, S, H, D)` storage) and at most `MAX_WIDE` of them together."""
    _, _, num_tokens, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    return (num_tokens == 1 and v_cache.shape[-1] == head_dim and kv_heads * head_dim <= MAX_WIDE
            and all(c.stride(3) == 1 and c.stride(2) == head_dim for c in (k_cache, v_cache)))


def attend_all_heads(q, k_cache, v_cache, q_slot, kv_len, sel_idx, sel_count, sel_end, scaling, *, list_len: int,
                     softcap=None):
    """Sparse draft attention (`ops.sparse_draft_attention`'s semantics) for drafts that `fits`. `(B, 1, Hq, D)`."""
    batch, q_heads, _, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    groups = q_heads // kv_heads
    wide = kv_heads * head_dim
    tuning = _launch.TUNING["sparse_all_heads"]
    block_n = tuning["block_n"]
    device = q.device
    splits, chunk = _num_splits(list_len, batch, block_n, tuning["waves"], device, tuning.get("nearest", False))
    q = q if q.stride(-1) == 1 else q.contiguous()
    f32 = {"dtype": torch.float32, "device": device}
    out = _launch.empty(batch, 1, q_heads, head_dim, dtype=q.dtype, device=device)
    lse = _launch.empty(batch, 1, q_heads, **f32)
    single = splits == 1
    parts = 1 if single else batch * kv_heads * splits * groups
    m_part, l_part, o_part = (_launch.empty(parts, **f32), _launch.empty(parts, **f32),
                              _launch.empty(parts * head_dim, **f32))
    _attend_all_heads[(splits, batch)](
        q, k_cache, v_cache, q_slot.contiguous(), kv_len, sel_idx, sel_count, sel_end, m_part, l_part, o_part, out,
        lse, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        sel_idx.stride(0), out.stride(0), out.stride(2), lse.stride(0),
        chunk, float(scaling), float(softcap or 1.0),
        Q_HEADS=q_heads, GROUPS=groups, HEAD_DIM=head_dim, WIDE=wide,
        BLOCK_M=max(16, triton.next_power_of_2(q_heads)), BLOCK_N=block_n, BLOCK_W=triton.next_power_of_2(wide),
        HAS_SOFTCAP=softcap is not None, PRECISION=_launch.dot_precision(q.dtype), SINGLE=single,
        num_warps=tuning["num_warps"], num_stages=tuning["num_stages"],
    )
    if not single:
        per_program = 1 if device.type == "cuda" else triton.next_power_of_2(groups)
        _combine_splits[(batch * kv_heads, triton.cdiv(groups, per_program))](
            m_part, l_part, o_part, out, lse, splits,
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            1, KV_HEADS=kv_heads, GROUPS=groups, V_DIM=head_dim,
            ROWS_PER_PROGRAM=per_program, BLOCK_DV=triton.next_power_of_2(head_dim), num_warps=4,
            SPLIT_BLOCK=max(1, min(triton.next_power_of_2(splits),
                                   4096 // (per_program * triton.next_power_of_2(head_dim)))),
        )
    return out
