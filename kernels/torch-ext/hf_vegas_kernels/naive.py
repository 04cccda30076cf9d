r"""The plain-PyTorch ("naive") ops: the contract, beside the Triton kernels that implement it (`ops.py`, `linear.py`,
`linear_ops.py`, `top_p.py`, `race.py`). The Triton ops and hf_vegas' CPU path (`hf_vegas.ops.eager`) take the same
names and signatures (`tests/test_op_contract.py`), so callers pick a module and never branch on which:
`dense_attention`, `sparse_draft_attention`, `verify_attention` (with the scored rows' logits), `finalize_scores`,
`select_topk`, `write_kv`. A finished row (`kv_len` 0) reads nothing and outputs zeros. This module imports only torch:
it is hf_vegas' op path wherever Triton is missing (and is copied into the Hub folder, `hf_vegas.hub`).

Shapes (cache layout "NHD", see `hf_vegas.cache`):
    q           `(B, Hq, T, D)` queries, RoPE applied
    k_cache     `(B, S, Hkv, D)` keys of every slot (slot = position), `Hq % Hkv == 0`
    v_cache     `(B, S, Hkv, Dv)`
    q_slot      `(B, T)` position of each query; a query sees slots `<= q_slot`
    kv_len      `(B,)` slots `>= kv_len` hold nothing valid
    sinks       `(Hq,)` or None: a learned logit per query head that joins each softmax's denominator and adds
                nothing to the output (gpt-oss' attention sinks, `s_aux` in transformers)
These read the whole buffer and mask; the kernels read only the slots the mask allows.
"""

from __future__ import annotations

import torch


def visible_slots(q_slot: torch.Tensor, kv_len: torch.Tensor, num_slots: int, window: int | None) -> torch.Tensor:
    """`(B, T, S)` bool: causal, inside the row's length, and inside the sliding window if any."""
    slots = torch.arange(num_slots, device=q_slot.device)
    visible = (slots[None, None, :] <= q_slot[:, :, None]) & (slots[None, None, :] < kv_len[:, None, None])
    if window is not None:
        # Same convention as transformers' sliding_window_overlay: kv > q - window.
        visible &= slots[None, None, :] > q_slot[:, :, None] - window
    return visible


def selected_slots(sel_idx: torch.Tensor, sel_count: torch.Tensor, num_slots: int) -> torch.Tensor:
    """`(B, S)` bool membership of the first `sel_count[b]` entries of `sel_idx[b]`."""
    batch, k_max = sel_idx.shape
    valid = torch.arange(k_max, device=sel_idx.device)[None, :] < sel_count[:, None]
    # Invalid entries go to an extra column that is dropped, so they can never clear a valid hit.
    target = torch.where(valid, sel_idx, num_slots)
    member = torch.zeros(batch, num_slots + 1, dtype=torch.bool, device=sel_idx.device)
    member.scatter_(1, target, True)
    return member[:, :num_slots]


def draft_visible(q_slot, kv_len, sel_idx, sel_count, sel_end, num_slots: int, window: int | None = None
                  ) -> torch.Tensor:
    """Draft mask: selected candidates plus every slot from `sel_end` on (accepted since, and drafts), causal, and
    inside the sliding window of a windowed layer."""
    slots = torch.arange(num_slots, device=q_slot.device)
    tail = slots[None, :] >= sel_end[:, None]
    chosen = selected_slots(sel_idx, sel_count, num_slots) | tail
    return visible_slots(q_slot, kv_len, num_slots, window) & chosen[:, None, :]


def _logits(q: torch.Tensor, k_cache: torch.Tensor, scaling: float, softcap: float | None) -> torch.Tensor:
    """`(B, Hq, T, S)` scaled (and soft-capped) attention logits in fp32."""
    groups = q.shape[1] // k_cache.shape[2]
    k = k_cache.permute(0, 2, 1, 3).repeat_interleave(groups, dim=1)
    logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def softmax_with_sinks(logits: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension of `(B, Hq, T, S)` logits; with `sinks`, each head's sink logit joins the
    denominator (as one more column, dropped after), as gpt-oss' own attention computes it."""
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    batch, heads, tokens, _ = logits.shape
    column = sinks.to(logits.dtype).reshape(1, heads, 1, 1).expand(batch, heads, tokens, 1)
    return torch.softmax(torch.cat([logits, column], dim=-1), dim=-1)[..., :-1]


def masked_attention(q, k_cache, v_cache, visible, scaling: float, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of `q` over the slots `visible` `(B, T, S)` allows. Returns `(B, T, Hq, Dv)` in `q.dtype`.

    Every query must see at least one slot.
    """
    groups = q.shape[1] // k_cache.shape[2]
    if softcap is None and sinks is None:
        k = k_cache.permute(0, 2, 1, 3)
        v = v_cache.permute(0, 2, 1, 3)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=visible[:, None], scale=scaling, enable_gqa=groups > 1
        )
    else:
        logits = _logits(q, k_cache, scaling, softcap).masked_fill(~visible[:, None], float("-inf"))
        v = v_cache.permute(0, 2, 1, 3).repeat_interleave(groups, dim=1).float()
        out = torch.matmul(softmax_with_sinks(logits, sinks), v).to(q.dtype)
    return out.transpose(1, 2)


def dense_attention(q, k_cache, v_cache, q_slot, kv_len, scaling: float, window=None, softcap=None, sinks=None,
                    list_len=None):
    """Full causal attention over each row's cache (verification, prefill, sliding-window layers).

    `list_len` (every attention op takes it, with `split_len` for drafts) is a host-side hint of how many slots a row
    reads, which only the kernels' work split uses: it never changes a result.
    """
    alive, kv_len = finished_rows(kv_len, q_slot)
    visible = visible_slots(q_slot, kv_len, k_cache.shape[1], window)
    return zero_finished(masked_attention(q, k_cache, v_cache, visible, scaling, softcap, sinks), alive)


def sparse_draft_attention(q, k_cache, v_cache, q_slot, kv_len, sel_idx, sel_count, sel_end, scaling, softcap=None,
                           sinks=None, window=None, list_len=None, split_len=None):
    """Draft attention: the selected candidate slots plus the tail `[sel_end, kv_len)` (inside `window`, if any)."""
    alive, kv_len = finished_rows(kv_len, q_slot)
    visible = draft_visible(q_slot, kv_len, sel_idx, sel_count, sel_end, k_cache.shape[1], window)
    return zero_finished(masked_attention(q, k_cache, v_cache, visible, scaling, softcap, sinks), alive)


def finished_rows(kv_len: torch.Tensor, q_slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A row of length 0 is finished: it reads nothing and its output is zeros (the kernels skip it). The plain ops
    compute it over its slots up to its queries, so that no softmax is empty, and then zero it (`zero_finished`)."""
    alive = kv_len > 0
    return alive, torch.where(alive, kv_len, q_slot.max(dim=1).values + 1)


def zero_finished(out: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
    return torch.where(alive[:, None, None, None], out, 0.0).to(out.dtype)


def verify_attention(q, k_cache, v_cache, q_slot, kv_len, scaling, score_rows, score: str, softcap=None, sinks=None,
                     window=None, list_len=None):
    """Dense attention that also emits the logits of the query rows `score_rows` `(R,)` for the slots it reads.

    Returns `(out (B, T, Hq, Dv), emitted (B, R, heads, S), lse (B, T, Hq))`, the input of `finalize_scores`:
    `score="logits"` without a soft cap emits per-KV-head group sums (heads = Hkv: logits are linear in the query);
    softmax weights, and soft-capped logits, need every query head's own logits (heads = Hq). `lse` is a query's
    log-sum-exp over the slots it sees, sinks included; `finalize_scores` reads the scored rows' only, which are all
    the plain ops compute (the other rows hold NaN; the kernels fill every row, at no extra cost). What `emitted`
    holds for slots the op does not read is unspecified (the kernels read from a window's start on);
    `finalize_scores` reads the candidates only. `emitted` is fp32 here; the kernels emit fp16 for half-precision
    queries (half the bytes; the ranking it feeds is unchanged but for near-ties).
    """
    out = dense_attention(q, k_cache, v_cache, q_slot, kv_len, scaling, window, softcap, sinks)
    row_logits = _logits(q[:, :, score_rows], k_cache, scaling, softcap)
    return (out, *emit_scores(row_logits, q_slot, kv_len, score_rows, score, softcap, sinks, window,
                              k_cache.shape[2]))


def emit_scores(row_logits, q_slot, kv_len, score_rows, score: str, softcap, sinks, window, kv_heads: int):
    """`verify_attention`'s `(emitted, lse)` from the scored rows' `(B, Hq, R, N)` fp32 logits over slots `[0, N)`
    (`q_slot` `(B, T)`: every row of the forward)."""
    if score not in ("logits", "weights"):
        raise ValueError(f"score must be 'logits' or 'weights', got {score!r}")
    lengths = finished_rows(kv_len, q_slot)[1]
    visible = visible_slots(q_slot[:, score_rows], lengths, row_logits.shape[-1], window)[:, None]
    seen = row_logits.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        seen = torch.cat([seen, sinks.float().reshape(1, -1, 1, 1).expand(*seen.shape[:3], 1)], dim=-1)
    batch, heads, num_rows, num_slots = row_logits.shape
    lse = row_logits.new_full((batch, q_slot.shape[1], heads), float("nan"))
    lse[:, score_rows] = torch.logsumexp(seen, dim=-1).transpose(1, 2)  # (B, R, Hq) into the scored rows
    rows = row_logits.transpose(1, 2)  # (B, R, Hq, N)
    if score == "logits" and softcap is None:
        rows = rows.reshape(batch, num_rows, kv_heads, heads // kv_heads, num_slots).sum(dim=3)
    return rows, lse


def finalize_scores(emitted, lse, score_rows, cand_end, q_heads: int, weights: bool, mean_rows: bool, out=None,
                    cand_start=None, window=None, q_slot=None):
    """Collect-2-Query scores from `verify_attention`'s `emitted` and `lse`: `(B, 1 if mean_rows else R, S)` fp32,
    head-averaged (softmax weights `exp(logit - lse)` if `weights`, else logits), `-inf` outside the candidates
    `[cand_start, cand_end)`; written into `out` if given. With a sliding `window` (and the forward's `q_slot`
    `(B, T)`), a candidate a score row's window has left scores 0 for that row. Only candidate slots of `emitted` are
    read. Equals `row_scores` (then the mean over rows)."""
    num_slots = emitted.shape[-1]
    candidate = candidate_slots(cand_start, cand_end, num_slots)  # (B, S)
    seen = candidate[:, None, None, :]
    if window is not None:
        if q_slot is None:
            raise ValueError("finalize_scores: a window needs the forward's q_slot")
        slots = torch.arange(num_slots, device=emitted.device)
        seen = seen & (slots > q_slot[:, score_rows, None] - window)[:, :, None, :]
    values = emitted.float()
    if weights:
        values = torch.exp(values - lse[:, score_rows, :, None])
    row = torch.where(seen, values, 0.0).sum(dim=2) / q_heads  # (B, R, S)
    result = (row.mean(dim=1, keepdim=True) if mean_rows else row).masked_fill(~candidate[:, None], float("-inf"))
    if out is None:
        return result
    out.copy_(result)
    return out


def row_scores(q_rows, k_cache, q_slot_rows, kv_len, cand_end, scaling, score: str, softcap=None, sinks=None,
               window=None, cand_start=None):
    """Criticality of each candidate slot for the given query rows, averaged over query heads.

    Args:
        q_rows `(B, Hq, R, D)`, q_slot_rows `(B, R)`: the collected query rows (Collect-2-Query: R = 2).
        cand_end `(B,)`: candidates are slots `[cand_start, cand_end)` (`cand_start` `(B,)`, default 0); other slots
            score `-inf`.
        score: `"logits"` (raw scaled logits) or `"weights"` (softmax weights over each row's visible slots, with
            the `sinks` in their denominators: the weights the layer's attention gives).
        window: the layer's sliding window, or None (full attention).

    Returns `(B, R, S)` fp32, head-averaged, `-inf` outside the candidates.
    """
    num_slots = k_cache.shape[1]
    logits = _logits(q_rows, k_cache, scaling, softcap)  # (B, Hq, R, S)
    visible = visible_slots(q_slot_rows, kv_len, num_slots, window)[:, None]
    if score == "weights":
        values = softmax_with_sinks(logits.masked_fill(~visible, float("-inf")), sinks)
    elif score == "logits":
        values = logits.masked_fill(~visible, 0.0)
    else:
        raise ValueError(f"score must be 'logits' or 'weights', got {score!r}")
    mean = values.mean(dim=1)  # over query heads
    return mean.masked_fill(~candidate_slots(cand_start, cand_end, num_slots)[:, None, :], float("-inf"))


def candidate_slots(cand_start, cand_end, num_slots: int) -> torch.Tensor:
    """`(B, S)` bool: slots in `[cand_start, cand_end)` (`cand_start` None: from 0)."""
    slots = torch.arange(num_slots, device=cand_end.device)[None, :]
    inside = slots < cand_end[:, None]
    return inside if cand_start is None else inside & (slots >= cand_start[:, None])


def select_topk(scores, count, cand_end, out, layers=None):
    """Write into `out[..., b, :count[b]]` the slots of the `count[b]` highest `scores[..., b, :cand_end[b]]`,
    ascending; ties go to the lower slot. `out[..., b, count[b]:]` is left as it was. Returns `out`.

    `scores` `(B, S)` with `out` `(B, K)`, or `scores` `(L, B, S)` with `out` `(L, B, K)` and `layers` the layer
    indices to select for (default: all); `count` `(B,)`, or `(L, B)` for a budget per layer (at most `cand_end`, `K`).
    """
    scores3, out3 = (scores[None], out[None]) if scores.dim() == 2 else (scores, out)
    if count.dim() not in (1, 2) or count.shape[-1] != scores3.shape[1]:
        raise ValueError(f"select_topk: count must be (B,) or (L, B), got {tuple(count.shape)}")
    if layers is None:
        layers = torch.arange(scores3.shape[0], device=scores.device)
    counts = count if count.dim() == 2 else count[None].expand(scores3.shape[0], -1)
    slots = torch.arange(scores3.shape[-1], device=scores.device)
    position = torch.arange(out3.shape[-1], device=scores.device)
    for i in range(layers.shape[0]):  # one layer at a time: a sort of (B, S), not of every layer's scores at once
        layer = layers[i:i + 1]  # a one-element index on the device (no host read: graph-safe)
        ranked = scores3[layer].float().masked_fill(slots >= cand_end[:, None], float("-inf"))
        best = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :out3.shape[-1]]
        kept = position[:best.shape[-1]] < counts[layer][..., None]
        ascending = torch.sort(best.masked_fill(~kept, scores3.shape[-1]), dim=-1).values  # the kept slots first
        width = best.shape[-1]
        out3[layer, :, :width] = torch.where(kept, ascending, out3[layer, :, :width])
    return out


def streaming_select(sel_count: torch.Tensor, sel_end: torch.Tensor, k_max: int, sink: int) -> torch.Tensor:
    """StreamingLLM selection: the first `sink` slots plus the most recent `sel_count - sink` candidates."""
    i = torch.arange(k_max, device=sel_count.device)[None, :]
    sinks = torch.clamp(sel_count, max=sink)[:, None]
    recent = sel_end[:, None] - sel_count[:, None] + i
    return torch.where(i < sinks, i, recent).clamp_min(0)


def top_p_filter(scores: torch.Tensor, top_p: float, filter_value: float = float("-inf"),
                 temperature: float | None = None) -> torch.Tensor:
    """transformers' `TopPLogitsWarper` rule with ties broken as a stable sort breaks them (lowest index removed
    first; CUDA's radix sort is stable, the CPU sort promises nothing among ties), on the fp32 scores divided by
    `temperature` first if one is given, as `TemperatureLogitsWarper` divides on CUDA: times the fp32 reciprocal
    (PyTorch's CUDA division by a Python number; the CPU's is exact). Returns a new fp32 `(N, V)` tensor."""
    scores = scores.float()
    if temperature is not None:
        scores = scores * (torch.tensor(1.0) / torch.tensor(temperature, dtype=torch.float32)).item()
    ascending, order = torch.sort(scores, descending=False, stable=True)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    removed = cumulative <= (1 - top_p)
    removed[..., -1:] = False  # min_tokens_to_keep = 1
    return scores.masked_fill(removed.scatter(1, order, removed), filter_value)


def race_argmax(scores: torch.Tensor, race: torch.Tensor | None) -> torch.Tensor:
    """The winner of the exponential race per row: `argmax(scores - log(race))`, which is `argmax(softmax(scores) /
    race)` (the row's softmax denominator does not change the winner); without draws (`race` None), `argmax(scores)`.
    A NaN key never wins (unlike `torch.argmax`, where NaN does); a row without a finite key gives 0. `(B, V)` scores
    and positive draws, returns `(B,)` int64."""
    key = scores.float() if race is None else scores.float() - race.float().log()
    return key.masked_fill(key.isnan(), float("-inf")).argmax(dim=-1)


def write_kv(k_cache, v_cache, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """`k_cache[b, slots[b, t]] = key[b, :, t]` (and values), in place. Caches `(B, S, H, D)`, `key` `(B, H, T, D)`."""
    rows = torch.arange(key.shape[0], device=slots.device)[:, None]
    # (B, H, T, D) -> (B, T, H, D): advanced indexing on dims 0 and 1 writes whole tokens.
    k_cache[rows, slots] = key.transpose(1, 2).to(k_cache.dtype)
    v_cache[rows, slots] = value.transpose(1, 2).to(v_cache.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: `weight * (x * rsqrt(mean(x^2) + eps))`, computed in fp32, in `x`'s dtype."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def all_reduce_norm(partial: torch.Tensor, weight: torch.Tensor | None, eps: float, peer_recv: torch.Tensor,
                    recv: torch.Tensor, peer_pad: torch.Tensor, pad: torch.Tensor):
    """One rank's side of a two-rank sum and the RMSNorm after it: `partial` `(rows, K)` goes into `peer_recv[:rows]`
    and raises the peer's flags `peer_pad[:rows]` (each 0 before); this rank's flags `pad[:rows]` must then be raised
    (by the peer) and are cleared; `recv[:rows]` holds the peer's partial. Returns `(total, rms_norm(total))` with
    `total` the fp32 sum rounded once; without a `weight` the norm's place is an empty `(0, K)` tensor.
    (Sequential: a flag not yet raised is an error here where a GPU waits.)"""
    rows = partial.shape[0]
    if bool((peer_pad[:rows] != 0).any()):
        raise RuntimeError("all_reduce_norm: the peer has not read the previous signal (here nothing can wait)")
    peer_recv[:rows] = partial
    peer_pad[:rows] = 1
    if bool((pad[:rows] != 1).any()):
        raise RuntimeError("all_reduce_norm: the peer's signal is missing (here nothing can wait)")
    pad[:rows] = 0
    total = (partial.float() + recv[:rows].float()).to(partial.dtype)
    return total, rms_norm(total, weight, eps) if weight is not None else partial.new_empty(0, partial.shape[1])


def grouped_linear(x: torch.Tensor, weights, biases=None, row_sumsq=None, eps: float = 0.0) -> torch.Tensor:
    """The outputs of several projections of one input, concatenated on the last dimension. With `row_sumsq`
    `(rows, P)`, `x` is an RMSNorm's input times its weight and the products are scaled by the norm's row factor
    (`row_norm_scale`, in fp32) before the biases, as `gated_linear` scales."""
    biases = biases if biases is not None else [None] * len(weights)
    if row_sumsq is not None:
        scale = row_norm_scale(row_sumsq, x.shape[-1], eps).reshape(*x.shape[:-1], 1)
        products = [torch.nn.functional.linear(x.float(), w.float()) * scale for w in weights]
        return torch.cat([p if b is None else p + b.float() for p, b in zip(products, biases)], dim=-1).to(x.dtype)
    return torch.cat([torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)


GATED_ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
}


def row_norm_scale(row_sumsq: torch.Tensor, width: int, eps: float) -> torch.Tensor:
    """RMSNorm's factor `rsqrt(mean(h^2) + eps)` per row `(rows, 1)`, from partial sums of squares `(rows, P)` of
    rows `h` of `width` values (`linear_residual_norm` writes them)."""
    return torch.rsqrt(row_sumsq.float().sum(-1, keepdim=True) / width + eps)


def gated_linear(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, act: str, row_sumsq=None,
                 eps: float = 0.0) -> torch.Tensor:
    """A gated MLP's first half: `act(x @ w_gate.T) * (x @ w_up.T)`. With `row_sumsq` `(rows, P)`, `x` is an RMSNorm's
    input times its weight and both products are scaled by the norm's row factor (`row_norm_scale`) first: the MLP
    of `rms_norm(h, norm_weight, eps)` where `x = h * norm_weight`."""
    linear = torch.nn.functional.linear
    if row_sumsq is not None:  # products kept in fp32 until the scale, as the kernel keeps them
        scale = row_norm_scale(row_sumsq, x.shape[-1], eps).reshape(*x.shape[:-1], 1)
        gate, up = (linear(x.float(), w.float()) * scale for w in (w_gate, w_up))
        return (GATED_ACTIVATIONS[act](gate) * up).to(x.dtype)
    return GATED_ACTIVATIONS[act](linear(x, w_gate)) * linear(x, w_up)


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`residual + x @ weight.T`, rounded once (as `torch.addmm`, which a fused layer used before)."""
    rows = residual.reshape(-1, residual.shape[-1])
    return torch.addmm(rows, x.reshape(-1, x.shape[-1]), weight.t()).reshape(residual.shape)


def linear_residual_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor):
    """`h = linear_residual(x, weight, residual)` with what the RMSNorm after it needs: `(h, h * norm_weight,
    sumsq)`, `sumsq` `(rows, 1)` fp32 sums of squares of `h`'s rows (the kernel writes partial sums, `(rows, P)`)."""
    out = linear_residual(x, weight, residual)
    flat = out.reshape(-1, out.shape[-1]).float()
    return out, (out.float() * norm_weight.float()).to(out.dtype), flat.pow(2).sum(-1, keepdim=True)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding of `x` `(..., D)` (the `rotate_half` convention), in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return x.float() * cos.float() + torch.cat([-x2, x1], dim=-1) * sin.float()


def rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, q_heads: int, kv_heads: int, head_dim: int, q_norm=None,
                  k_norm=None, head_eps: float = 0.0):
    """One forward's fused q/k/v projections `(B, T, (Hq + 2 Hkv) * D)`: write the rotated keys and the values into
    the caches at `slots` `(B, T)` and return the rotated queries `(B, T, Hq, D)`. `cos`, `sin` `(B, T, D)`. With
    `q_norm` and `k_norm` `(D,)` (Qwen3's per-head RMSNorms, epsilon `head_eps`), the query and key heads are
    normalised in fp32 before their rotation."""
    batch, tokens, _ = qkv.shape
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(batch, tokens, q_heads, head_dim), k.reshape(batch, tokens, kv_heads, head_dim)
    if q_norm is not None:
        q, k = rms_norm(q.float(), q_norm, head_eps), rms_norm(k.float(), k_norm, head_eps)
    cos, sin = cos[:, :, None], sin[:, :, None]
    keys = rotate(k, cos, sin)
    write_kv(k_cache, v_cache, keys.transpose(1, 2), v.reshape(batch, tokens, kv_heads, head_dim).transpose(1, 2),
             slots)
    return rotate(q, cos, sin).to(qkv.dtype)


def qkv_rope_write(x, wq, wk, wv, bq, bk, bv, cos, sin, k_cache, v_cache, slots, q_heads: int, kv_heads: int,
                   head_dim: int, row_sumsq=None, eps: float = 0.0, q_norm=None, k_norm=None, head_eps: float = 0.0):
    """`rope_write_kv` of the q/k/v projections of `x` `(B, T, K)` (biases `bq`, `bk`, `bv` or None), with the
    projections kept in fp32 until the rotation: writes the keys and values at `slots`, returns the rotated queries
    `(B, T, Hq, D)` in `x`'s dtype. With `row_sumsq` `(B * T, P)`, `x` is an RMSNorm's input times its weight and the
    projections (before their biases) are scaled by the norm's row factor, as `gated_linear` scales. `q_norm`,
    `k_norm`, `head_eps`: `rope_write_kv`'s head norms."""
    qkv = grouped_linear(x.float(), (wq.float(), wk.float(), wv.float()))
    if row_sumsq is not None:
        qkv = qkv * row_norm_scale(row_sumsq, x.shape[-1], eps).reshape(*x.shape[:-1], 1)
    if bq is not None:
        qkv = qkv + torch.cat([bq.float(), bk.float(), bv.float()])
    return rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, q_heads, kv_heads, head_dim, q_norm, k_norm,
                         head_eps).to(x.dtype)
