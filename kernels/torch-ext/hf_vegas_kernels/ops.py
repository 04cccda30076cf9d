"""The kernels behind the signatures of `hf_vegas.ops.reference` (plus the host-side list-length hint). `sinks`
`(Hq,)`: gpt-oss' per-head sink logits, in every softmax's denominator."""

from __future__ import annotations

import torch

from .attention import EMIT_GROUP_SUM, EMIT_PER_HEAD, attend


def sparse_draft_attention(
    q, k_cache, v_cache, q_slot, kv_len, sel_idx, sel_count, sel_end, scaling, softcap=None, list_len=None, sinks=None,
    split_len=None, window=None,
):
    """Draft attention over `sel_idx[b, :sel_count[b]]` plus the tail `[sel_end[b], kv_len[b])`, each query inside
    its sliding `window` if one is given. `(B, T, Hq, Dv)`.

    `list_len` bounds `sel_count + tail` on the host (it only balances the splits); default: the selection width.
    `split_len`: no split takes more entries than this (rounded up to the kernel's block), so rows with longer lists
    than most take more programs, not longer ones. Both are hints: they change the balance, never the result.
    """
    hint = list_len if list_len is not None else sel_idx.shape[1]
    out, _, _ = attend(
        q, k_cache, v_cache, q_slot, kv_len, scaling, tail_start=sel_end, list_len=hint,
        sel_idx=sel_idx, sel_count=sel_count, softcap=softcap, sinks=sinks, split_len=split_len, window=window,
    )
    return out


def _dense_start(q_slot: torch.Tensor, window: int | None) -> torch.Tensor:
    """First slot any of a row's queries can see: 0, or the start of the sliding window."""
    if window is None:
        return torch.zeros(q_slot.shape[0], dtype=torch.long, device=q_slot.device)
    return (q_slot.min(dim=1).values - window + 1).clamp_min(0)


def dense_attention(q, k_cache, v_cache, q_slot, kv_len, scaling, window=None, softcap=None, list_len=None,
                    sinks=None):
    """Full causal (optionally windowed) attention over each row's cache: the dense decode path. `(B, T, Hq, Dv)`."""
    if list_len is None:
        list_len = k_cache.shape[1] if window is None else window + q.shape[2]
    out, _, _ = attend(
        q, k_cache, v_cache, q_slot, kv_len, scaling, tail_start=_dense_start(q_slot, window), list_len=list_len,
        softcap=softcap, window=window, sinks=sinks,
    )
    return out


def verify_attention(q, k_cache, v_cache, q_slot, kv_len, scaling, score_rows, score: str, softcap=None,
                     list_len=None, sinks=None, window=None):
    """Dense (optionally windowed) attention that also emits the logits of the query rows `score_rows` for every slot
    it reads (a windowed layer reads, and emits, from the first slot any of the forward's queries sees).

    Returns `(out (B, T, Hq, Dv), emitted (B, R, heads, S), lse (B, T, Hq))`, for `finalize_scores`:
    `score="logits"` emits per-KV-head group sums (heads = Hkv), as logits are linear in the query; softmax weights,
    and soft-capped logits, need every query head's own logits (heads = Hq). With `sinks` the log-sum-exp includes
    them, so the weights are the layer's own attention weights.
    """
    if score not in ("logits", "weights"):
        raise ValueError(f"score must be 'logits' or 'weights', got {score!r}")
    emit = EMIT_GROUP_SUM if score == "logits" and softcap is None else EMIT_PER_HEAD
    out, lse, emitted = attend(
        q, k_cache, v_cache, q_slot, kv_len, scaling, tail_start=_dense_start(q_slot, window),
        list_len=list_len if list_len is not None else (k_cache.shape[1] if window is None else window + q.shape[2]),
        softcap=softcap, score_rows=score_rows, emit=emit, sinks=sinks, window=window,
    )
    return out, emitted, lse


__all__ = ["dense_attention", "sparse_draft_attention", "verify_attention"]
