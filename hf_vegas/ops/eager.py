r"""The CPU path: the naive ops' semantics, reading only the slots a step needs.

The naive ops (`hf_vegas_kernels.naive`) attend over the whole preallocated buffer through a `(B, T, S)` mask. That
keeps every shape static, which CUDA graphs need, but a "sparse" draft then reads every slot and a decode step reads
the buffer's capacity. On the CPU nothing is captured and a row's length is already on the host, so these ops, with the
same signatures and results:

- attend over slots `[0, max(kv_len))` only, through SDPA without a mask when every query sees every slot (one
  decode row, as vanilla `generate` runs it);
- gather each draft row's selected slots and its tail into one short contiguous list, and attend to that: a draft
  reads `budget + tail` slots per layer, not the whole prefix;
- rate the verification's candidates over the valid slots, with grouped query heads multiplied against their shared
  key head instead of a repeated copy of the keys.

They read lengths on the host (`int(kv_len.max())`): free on the CPU, a synchronisation per layer on a GPU, so the
cache uses them on the CPU only (`hf_vegas.cache.uses_eager_ops`). Tests: `tests/test_eager_ops.py`.
"""

from __future__ import annotations

import torch

from hf_vegas_kernels import naive

# Forwards of at most this many tokens run grouped query heads (see `_attend`): decode, draft and verify steps.
GROUPED_MAX_TOKENS = 64


def _heads_first(cache: torch.Tensor, n: int) -> torch.Tensor:
    """`(B, S, H, D)` cache -> `(B, H, n, D)` view of its first `n` slots."""
    return cache[:, :n].transpose(1, 2)


def _attend(q, k, v, visible, scaling: float, softcap: float | None, sinks=None) -> torch.Tensor:
    """`q` `(B, Hq, T, D)` over `k`, `v` `(B, Hkv, N, D)`, `visible` `(B, T, N)` or None (all).
    Returns `(B, T, Hq, Dv)`.

    Decode, draft and verify forwards (a few queries) run the `groups` query heads that share a key head as
    `groups * T` queries of that head: SDPA's grouped-query mode on the CPU repeats the keys and values per query
    head, a copy of both per layer. Longer masked forwards (a prefill after a prompt cache, sliding or soft-capped
    layers in a prefill) keep the grouped-query mode, whose `(B, 1, T, N)` mask is `groups` times smaller.
    """
    batch, q_heads, tokens, _ = q.shape
    kv_heads = k.shape[1]
    groups = q_heads // kv_heads
    if visible is not None and tokens > GROUPED_MAX_TOKENS and softcap is None and sinks is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=visible[:, None], scale=scaling, enable_gqa=groups > 1
        )
        return out.transpose(1, 2).contiguous()
    if softcap is None and sinks is None:
        grouped = q.reshape(batch, kv_heads, groups * tokens, q.shape[-1])
        if visible is not None:  # (B, T, N) -> (B, 1, groups * T, N): every head of a group sees what its token sees
            visible = visible[:, None].expand(batch, groups, tokens, -1).reshape(batch, 1, groups * tokens, -1)
        out = torch.nn.functional.scaled_dot_product_attention(
            grouped, k.to(q.dtype), v.to(q.dtype), attn_mask=visible, scale=scaling
        )
    else:  # SDPA has neither a soft cap nor sinks: the softmax by hand, per query head, then grouped again
        logits = _grouped_logits(q, k, scaling, softcap)  # (B, Hq, T, N)
        if visible is not None:  # every query head of a token sees what the token sees
            logits = logits.masked_fill(~visible[:, None], float("-inf"))
        probs = naive.softmax_with_sinks(logits, sinks).reshape(batch, kv_heads, groups * tokens, -1)
        out = torch.matmul(probs, v.float()).to(q.dtype)
    # Contiguous, as transformers' own attention functions return it: some models `view` it (AFMoE).
    return out.reshape(batch, q_heads, tokens, -1).transpose(1, 2).contiguous()


def _grouped_logits(q, k, scaling: float, softcap: float | None) -> torch.Tensor:
    """`(B, Hq, T, N)` fp32 logits; the `groups` query heads of a key head share one matmul with it (no key copies)."""
    batch, q_heads, tokens, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.float().reshape(batch, kv_heads, (q_heads // kv_heads) * tokens, dim)
    logits = torch.matmul(grouped, k.float().transpose(-1, -2)).reshape(batch, q_heads, tokens, -1) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _all_or_mask(visible: torch.Tensor) -> torch.Tensor | None:
    return None if bool(visible.all()) else visible


def dense_attention(q, k_cache, v_cache, q_slot, kv_len, scaling: float, window=None, softcap=None, sinks=None,
                    list_len=None):
    """`naive.dense_attention` over slots `[0, max(kv_len))` only (a shorter row's slots past its length, and
    those a window leaves, are read and masked out)."""
    alive, kv_len = naive.finished_rows(kv_len, q_slot)
    n = int(kv_len.max())
    visible = _all_or_mask(naive.visible_slots(q_slot, kv_len, n, window))
    out = _attend(q, _heads_first(k_cache, n), _heads_first(v_cache, n), visible, scaling, softcap, sinks)
    return _zero_finished(out, alive)


def _zero_finished(out: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
    return out if bool(alive.all()) else naive.zero_finished(out, alive).contiguous()


def verify_attention(q, k_cache, v_cache, q_slot, kv_len, scaling, score_rows, score: str, softcap=None, sinks=None,
                     window=None, list_len=None):
    """`naive.verify_attention` over slots `[0, max(kv_len))`; `emitted` is zero past them."""
    out = dense_attention(q, k_cache, v_cache, q_slot, kv_len, scaling, window, softcap, sinks)
    num_slots, n = k_cache.shape[1], int(naive.finished_rows(kv_len, q_slot)[1].max())
    row_logits = _grouped_logits(q[:, :, score_rows], _heads_first(k_cache, n), scaling, softcap)
    emitted, lse = naive.emit_scores(row_logits, q_slot, kv_len, score_rows, score, softcap, sinks, window,
                                         k_cache.shape[2])
    return out, torch.nn.functional.pad(emitted, (0, num_slots - n)), lse


def sparse_draft_attention(q, k_cache, v_cache, q_slot, kv_len, sel_idx, sel_count, sel_end, scaling, softcap=None,
                           sinks=None, window=None, list_len=None, split_len=None):
    """`naive.sparse_draft_attention`, reading only the selected slots and the tail, gathered per row."""
    alive, kv_len = naive.finished_rows(kv_len, q_slot)
    if q.shape[0] == 1 and q.shape[2] == 1:
        slots = _one_query_list(q_slot, kv_len, sel_idx, sel_count, sel_end, window)
        if slots is not None:
            n = int(kv_len[0])
            k, v = _gather_slots(k_cache, slots, n), _gather_slots(v_cache, slots, n)
            return _zero_finished(_attend(q, k, v, None, scaling, softcap, sinks), alive)
    n = int(kv_len.max())
    visible = naive.draft_visible(q_slot, kv_len, sel_idx, sel_count, sel_end, n, window)  # (B, T, n)
    batch, tokens, _ = visible.shape
    seen = visible.any(dim=1)  # (B, n): the slots some query of the row attends to
    counts = seen.sum(dim=1)
    width = max(int(counts.max()), 1)
    # Each row's seen slots in increasing order, left-aligned in a (B, width) list. A shorter row pads with its own
    # first slot (masked out below): the op reads no slot the row does not see. (A row that sees nothing, which
    # only a finished row's may, reads slot 0; its output is zeroed.)
    rows, cols = seen.nonzero(as_tuple=True)
    starts = counts.cumsum(0) - counts
    first = cols[starts.clamp_max(cols.numel() - 1)] if cols.numel() else starts
    slots = torch.where(counts > 0, first, 0)[:, None].repeat(1, width)
    slots[rows, torch.arange(rows.numel(), device=cols.device) - starts[rows]] = cols
    in_list = torch.arange(width, device=cols.device)[None, :] < counts[:, None]
    if tokens == 1:  # the row's one query sees exactly its listed slots
        listed = in_list[:, None, :]
    else:
        listed = visible.gather(2, slots[:, None, :].expand(batch, tokens, width)) & in_list[:, None, :]
    k, v = _gather_slots(k_cache, slots, n), _gather_slots(v_cache, slots, n)
    return _zero_finished(_attend(q, k, v, _all_or_mask(listed), scaling, softcap, sinks), alive)


def _one_query_list(q_slot, kv_len, sel_idx, sel_count, sel_end, window=None) -> torch.Tensor | None:
    """The usual CPU draft (one row, one query at the row's last slot) without a mask: its selection, then its tail.

    Every policy selects distinct candidates (top-k, or StreamingLLM's sinks and recent slots), so with the selected
    slots below `sel_end <= kv_len` (and inside the query's `window`, if any) the list is the naive visible set.
    None when the query is elsewhere, `sel_end > kv_len` or a selected slot is not a candidate or outside the window:
    the general path decides.
    """
    length, count, end = int(kv_len[0]), int(sel_count[0]), int(sel_end[0])
    chosen = sel_idx[0, :count]
    first = 0 if window is None else length - window  # the query's first visible slot (it sits at `length - 1`)
    if window is not None and end < first:
        return None
    outside = bool(count) and not first <= int(chosen.min()) <= int(chosen.max()) < end
    if int(q_slot[0, 0]) != length - 1 or end > length or outside:
        return None
    return torch.cat([chosen, torch.arange(end, length, device=chosen.device)])[None]


def _gather_slots(cache: torch.Tensor, slots: torch.Tensor, n: int) -> torch.Tensor:
    """`(B, H, width, D)`: row `b`'s slots `slots[b]` of a `(B, S, H, D)` cache, for every head."""
    heads_first = cache.transpose(1, 2)  # (B, H, S, D)
    batch, heads, num_slots, dim = heads_first.shape
    width = slots.shape[1]
    if heads_first.is_contiguous():  # the CPU cache's storage: one index_select over (B * H * S) rows of D
        rows = (torch.arange(batch * heads, device=slots.device) * num_slots).view(batch, heads, 1)
        flat = (rows + slots[:, None, :]).reshape(-1)
        return heads_first.reshape(-1, dim).index_select(0, flat).view(batch, heads, width, dim)
    index = slots[:, None, :, None].expand(batch, heads, width, dim)
    return heads_first[:, :, :n].gather(2, index)


def row_scores(q_rows, k_cache, q_slot_rows, kv_len, cand_end, scaling, score: str, softcap=None, sinks=None,
               window=None, cand_start=None):
    """`naive.row_scores` over the valid slots: `(B, R, S)`, `-inf` outside the candidates."""
    if score not in ("logits", "weights"):
        raise ValueError(f"score must be 'logits' or 'weights', got {score!r}")
    num_slots = k_cache.shape[1]
    n = int(kv_len.max())
    logits = _grouped_logits(q_rows, _heads_first(k_cache, n), scaling, softcap)  # (B, Hq, R, n)
    visible = naive.visible_slots(q_slot_rows, kv_len, n, window)[:, None]
    if score == "weights":
        values = naive.softmax_with_sinks(logits.masked_fill(~visible, float("-inf")), sinks)
    else:
        values = logits.masked_fill(~visible, 0.0)
    mean = values.mean(dim=1).masked_fill(~naive.candidate_slots(cand_start, cand_end, n)[:, None], float("-inf"))
    return torch.nn.functional.pad(mean, (0, num_slots - n), value=float("-inf"))


# The rest of the contract reads only what it is given: the naive ops are the CPU path's.
finalize_scores, select_topk, write_kv = naive.finalize_scores, naive.select_topk, naive.write_kv
