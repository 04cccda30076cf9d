"""The ops of the contract `naive.py` defines, on the Triton kernels: same names, same signatures, same
results up to rounding (`verify_attention` emits fp16 logits for half-precision queries where the reference emits
fp32; `sinks` `(Hq,)`: gpt-oss' per-head sink logits, in every softmax's denominator).

Each is a `torch.library` custom op with a fake (shapes only), so `torch.compile` (`vegas_compile`) traces a step's
forward through attention, the cache write and the selection as single nodes instead of breaking its graph at each:
inductor then fuses what lies between them. Ops that write in place (the cache, the selection, a scores buffer)
declare it (`mutates_args`) and return nothing; the Python function around them returns the buffer as the reference
does.
"""

from __future__ import annotations

import torch

from . import _launch, cache_write, exchanges, norm, qkv_rope, select, two_rank_sum
from . import scores as emitted_scores
from .attention import EMIT_GROUP_SUM, EMIT_PER_HEAD, attend, emit_dtype

Tensor = torch.Tensor


def _dense_start(q_slot: Tensor, window: int | None) -> Tensor | None:
    """First slot any of a row's queries can see: the start of the sliding window, or None for slot 0 (the kernel
    then reads no start at all: a zero-filled tensor would cost a launch in every layer of a dense or verify step)."""
    if window is None:
        return None
    return (q_slot.min(dim=1).values - window + 1).clamp_min(0)


def _dense_list_len(q: Tensor, k_cache: Tensor, window: int | None, list_len: int | None) -> int:
    if list_len is not None:
        return list_len
    return k_cache.shape[1] if window is None else window + q.shape[2]


def _out_like(q: Tensor, v_cache: Tensor) -> Tensor:
    """The fake of an attention output: `(B, T, Hq, Dv)` from `q` `(B, Hq, T, D)`."""
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], v_cache.shape[-1])


@torch.library.custom_op("hf_vegas::sparse_draft_attention", mutates_args=())
def sparse_draft_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, q_slot: Tensor, kv_len: Tensor, sel_idx: Tensor, sel_count: Tensor,
    sel_end: Tensor, scaling: float, softcap: float | None = None, sinks: Tensor | None = None,
    window: int | None = None, list_len: int | None = None, split_len: int | None = None,
) -> Tensor:
    """Draft attention over `sel_idx[b, :sel_count[b]]` plus the tail `[sel_end[b], kv_len[b])`, each query inside
    its sliding `window` if one is given. `(B, T, Hq, Dv)`.

    `list_len` bounds `sel_count + tail` on the host (it sets the split count, and without `_launch.TUNING`'s `balance`
    the splits' length); default: the selection width.
    `split_len`: no split takes more entries than this (rounded up to the kernel's block), so rows with longer lists
    than most take more programs, not longer ones. Both are hints: they change the balance, never the result.
    """
    hint = list_len if list_len is not None else sel_idx.shape[1]
    out, _, _ = attend(
        q, k_cache, v_cache, q_slot, kv_len, scaling, tail_start=sel_end, list_len=hint,
        sel_idx=sel_idx, sel_count=sel_count, softcap=softcap, sinks=sinks, split_len=split_len, window=window,
    )
    return out


@sparse_draft_attention.register_fake
def _(q, k_cache, v_cache, *args, **kwargs):
    return _out_like(q, v_cache)


@torch.library.custom_op("hf_vegas::dense_attention", mutates_args=())
def dense_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, q_slot: Tensor, kv_len: Tensor, scaling: float,
    window: int | None = None, softcap: float | None = None, sinks: Tensor | None = None, list_len: int | None = None,
) -> Tensor:
    """Full causal (optionally windowed) attention over each row's cache: the dense decode path. `(B, T, Hq, Dv)`."""
    out, _, _ = attend(
        q, k_cache, v_cache, q_slot, kv_len, scaling, tail_start=_dense_start(q_slot, window),
        list_len=_dense_list_len(q, k_cache, window, list_len), softcap=softcap, window=window, sinks=sinks,
    )
    return out


@dense_attention.register_fake
def _(q, k_cache, v_cache, *args, **kwargs):
    return _out_like(q, v_cache)


def _emit_kind(score: str, softcap: float | None) -> int:
    if score not in ("logits", "weights"):
        raise ValueError(f"score must be 'logits' or 'weights', got {score!r}")
    return EMIT_GROUP_SUM if score == "logits" and softcap is None else EMIT_PER_HEAD


@torch.library.custom_op("hf_vegas::verify_attention", mutates_args=())
def verify_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, q_slot: Tensor, kv_len: Tensor, scaling: float, score_rows: Tensor,
    score: str, softcap: float | None = None, sinks: Tensor | None = None, window: int | None = None,
    list_len: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Dense (optionally windowed) attention that also emits the logits of the query rows `score_rows` for every slot
    it reads (a windowed layer reads, and emits, from the first slot any of the forward's queries sees).

    Returns `(out (B, T, Hq, Dv), emitted (B, R, heads, S), lse (B, T, Hq))`, for `finalize_scores` (`emitted` in
    fp32 for fp32 queries, else fp16: `attention.emit_dtype`):
    `score="logits"` emits per-KV-head group sums (heads = Hkv), as logits are linear in the query; softmax weights,
    and soft-capped logits, need every query head's own logits (heads = Hq). With `sinks` the log-sum-exp includes
    them, so the weights are the layer's own attention weights.
    """
    out, lse, emitted = attend(
        q, k_cache, v_cache, q_slot, kv_len, scaling, tail_start=_dense_start(q_slot, window),
        list_len=_dense_list_len(q, k_cache, window, list_len), softcap=softcap, score_rows=score_rows,
        emit=_emit_kind(score, softcap), sinks=sinks, window=window,
    )
    return out, emitted, lse


@verify_attention.register_fake
def _(q, k_cache, v_cache, q_slot, kv_len, scaling, score_rows, score, softcap=None, sinks=None, window=None,
      list_len=None):
    batch, q_heads, tokens, _ = q.shape
    heads = k_cache.shape[2] if _emit_kind(score, softcap) == EMIT_GROUP_SUM else q_heads
    return (_out_like(q, v_cache),
            q.new_empty(batch, score_rows.shape[0], heads, k_cache.shape[1], dtype=emit_dtype(q.dtype)),
            q.new_empty(batch, tokens, q_heads, dtype=torch.float32))


@torch.library.custom_op("hf_vegas::finalize_scores", mutates_args=("out",))
def _finalize_scores(
    emitted: Tensor, lse: Tensor, score_rows: Tensor, cand_end: Tensor, q_heads: int, weights: bool, mean_rows: bool,
    out: Tensor, cand_start: Tensor | None = None, window: int | None = None, q_slot: Tensor | None = None,
) -> None:
    emitted_scores.finalize_scores(emitted, lse, score_rows, cand_end, q_heads, weights, mean_rows, out=out,
                           cand_start=cand_start, window=window, q_slot=q_slot)


@_finalize_scores.register_fake
def _(*args, **kwargs):
    return None


def finalize_scores(emitted, lse, score_rows, cand_end, q_heads: int, weights: bool, mean_rows: bool, out=None,
                    cand_start=None, window=None, q_slot=None):
    """Collect-2-Query scores `(B, 1 if mean_rows else R, S)` from `verify_attention`'s output (see
    `naive.finalize_scores`), written into `out` if given. Returns them."""
    if out is None:
        batch, num_rows, _, num_slots = emitted.shape
        out = _launch.empty(batch, 1 if mean_rows else num_rows, num_slots, dtype=torch.float32, device=emitted.device)
    _finalize_scores(emitted, lse, score_rows, cand_end, q_heads, weights, mean_rows, out, cand_start, window, q_slot)
    return out


@torch.library.custom_op("hf_vegas::select_topk", mutates_args=("out",))
def _select_topk(scores: Tensor, count: Tensor, cand_end: Tensor, out: Tensor, layers: Tensor | None = None) -> None:
    select.select_topk(scores, count, cand_end, out, layers)


@_select_topk.register_fake
def _(*args, **kwargs):
    return None


def select_topk(scores, count, cand_end, out, layers=None):
    """`naive.select_topk` (top `count[b]` slots below `cand_end[b]`, ascending, into `out`)."""
    _select_topk(scores, count, cand_end, out, layers)
    return out


@torch.library.custom_op("hf_vegas::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(k_cache: Tensor, v_cache: Tensor, key: Tensor, value: Tensor, slots: Tensor) -> None:
    """`k_cache[b, slots[b, t]] = key[b, :, t]` (and values), in place, one launch."""
    cache_write.write_kv(k_cache, v_cache, key, value, slots)


@write_kv.register_fake
def _(*args, **kwargs):
    return None


@torch.library.custom_op("hf_vegas::qkv_rope_write", mutates_args=("k_cache", "v_cache"))
def qkv_rope_write(x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, bq: Tensor | None, bk: Tensor | None,
                   bv: Tensor | None, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
                   q_heads: int, kv_heads: int, head_dim: int, row_sumsq: Tensor | None = None,
                   eps: float = 0.0, q_norm: Tensor | None = None, k_norm: Tensor | None = None,
                   head_eps: float = 0.0) -> Tensor:
    """Project (an RMSNorm folded in, with `row_sumsq`), normalise the heads (with `q_norm`, `k_norm`), rotate and
    write one forward's keys and values at `slots`, in one launch; returns the rotated queries."""
    return qkv_rope.qkv_rope_write(x, wq, wk, wv, bq, bk, bv, cos, sin, k_cache, v_cache, slots, q_heads, kv_heads,
                                   head_dim, row_sumsq, eps, q_norm, k_norm, head_eps)


@qkv_rope_write.register_fake
def _(x, wq, wk, wv, bq, bk, bv, cos, sin, k_cache, v_cache, slots, q_heads, kv_heads, head_dim, row_sumsq=None,
      eps=0.0, q_norm=None, k_norm=None, head_eps=0.0):
    return x.new_empty(x.shape[0], x.shape[1], q_heads, head_dim)


@torch.library.custom_op("hf_vegas::rope_write_kv", mutates_args=("k_cache", "v_cache"))
def rope_write_kv(qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
                  q_heads: int, kv_heads: int, head_dim: int, q_norm: Tensor | None = None,
                  k_norm: Tensor | None = None, head_eps: float = 0.0) -> Tensor:
    """`qkv_rope_write` after a projection of its own (`qkv_linear`), for weights too large for one launch."""
    return qkv_rope.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, q_heads, kv_heads, head_dim, q_norm, k_norm,
                                  head_eps)


@rope_write_kv.register_fake
def _(qkv, cos, sin, k_cache, v_cache, slots, q_heads, kv_heads, head_dim, q_norm=None, k_norm=None, head_eps=0.0):
    return qkv.new_empty(qkv.shape[0], qkv.shape[1], q_heads, head_dim)


@torch.library.custom_op("hf_vegas::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama's RMSNorm in one launch."""
    return norm.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("hf_vegas::exchange_sum_norm", mutates_args=())
def exchange_sum_norm(partial: Tensor, weight: Tensor | None, eps: float, exchange: str,
                      parity: int) -> tuple[Tensor, Tensor]:
    """`two_rank_sum.all_reduce_norm` through the exchange registered as `exchange` (`exchanges.py`), on its
    `parity` half: a two-rank sum and the RMSNorm after it in one launch. Its writes into the exchange's buffers and
    flags are declared nowhere on purpose: the compiler must not see (and copy) them; the op is ordered by its data
    (each sum's partial depends on the one before), and its outputs are always used."""
    return two_rank_sum.all_reduce_norm(partial, weight, eps, *exchanges.halves(exchange, parity))


@exchange_sum_norm.register_fake
def _(partial, weight, eps, exchange, parity):
    normed_rows = partial.shape[0] if weight is not None else 0
    return partial.new_empty(partial.shape), partial.new_empty(normed_rows, partial.shape[1])


__all__ = ["dense_attention", "exchange_sum_norm", "finalize_scores", "qkv_rope_write", "rms_norm", "rope_write_kv",
           "select_topk", "sparse_draft_attention", "verify_attention", "write_kv"]
