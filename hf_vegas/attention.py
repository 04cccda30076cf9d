"""The "vegas" attention function: draft (sparse) or verify/prefill (full + selection), per the cache's step plan.

It is registered through `transformers.AttentionInterface` and reaches the active cache through a thread-local slot
set by whoever drives the forwards (`hf_vegas.generate`, or `hf_vegas.assisted.assisted_generate`): transformers
hands the attention function the layer's keys, not the cache object. (Thread-local rather than a context variable:
`torch.compile` traces a thread-local's attributes, and stops at `ContextVar.get`.)

Every step runs one set of ops (`VegasCache.ops`, one signature for the kernels and the plain-PyTorch ops), so this
function is plain Python over tensors: a compiled step (`vegas_compile`) traces through it.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from . import placement
from ._compat import internals as compat
from .cache import VegasCache
from .ops import prefill

ATTN_NAME = "vegas"

_ACTIVE = threading.local()  # `.cache`: the cache of this thread's running generation


@contextlib.contextmanager
def active_cache(cache: VegasCache):
    """Route every "vegas" attention call of this thread inside the block to `cache`."""
    previous = getattr(_ACTIVE, "cache", None)
    _ACTIVE.cache = cache
    try:
        yield cache
    finally:
        _ACTIVE.cache = previous


def vegas_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
):
    cache = getattr(_ACTIVE, "cache", None)
    if cache is None:
        raise RuntimeError(
            "The 'vegas' attention implementation only runs inside hf_vegas generation "
            "(model.generate(..., custom_generate='vegas'))."
        )
    if dropout:
        raise ValueError("hf_vegas runs inference only: attention dropout must be 0 (call model.eval()).")
    if cache.spread:  # a model on several devices: this layer's kernels launch on its device
        with cache.device_guard(module.layer_idx):
            return attend(cache, module, query, key, value, scaling, sliding_window, softcap, kwargs.get("s_aux"))
    return attend(cache, module, query, key, value, scaling, sliding_window, softcap, kwargs.get("s_aux"))


def attend(cache: VegasCache, module, query, key, value, scaling, sliding_window, softcap, sinks):
    """The attention of `module`'s layer over `cache` after its keys and values are written: `query` `(B, Hq, T, D)`,
    `key` and `value` the `(B, Hkv, S, D)` views `VegasCache.update` returns. Per the cache's step plan: a sparse
    draft, or full attention and the selection it yields. Returns `(output (B, T, Hq, Dv), None)`; a fused layer
    (`hf_vegas.fused_layers`) calls it for its verification and dense steps."""
    # `sinks`: gpt-oss' learned attention sinks, one logit per query head in every softmax's denominator (every op
    # takes them).
    if scaling is None:
        scaling = module.head_dim**-0.5
    # `VegasCache.update` gave the model `(B, kv_heads, slots, D)` views of the `(B, slots, kv_heads, D)` storage; the
    # ops read the storage layout (a model that rebuilt its keys or values passes new tensors, which the ops read
    # through their strides just the same).
    key, value = key.transpose(1, 2), value.transpose(1, 2)
    layer = module.layer_idx
    full_layer = not cache.layers[layer].is_sliding
    if full_layer and sliding_window is not None and sliding_window >= cache.reach:
        sliding_window = None  # a window no position of this generation can leave: full attention
    if full_layer != (sliding_window is None):
        raise RuntimeError(
            f"Layer {layer} attends with sliding_window={sliding_window}, but its config says "
            f"{'full' if full_layer else 'sliding'} attention: hf_vegas cannot tell which layers to sparsify."
        )
    # The kernels keep all `groups * tokens` query rows of a KV head in one tile; a wider forward (a prefill, HF's
    # assisted loop's first verification, which re-feeds the prompt) runs the plain-PyTorch ops, and selects from
    # its scored rows alone (`_select`) rather than emitting logits for every row.
    narrow = query.shape[1] // key.shape[2] * query.shape[2] <= MAX_KERNEL_QUERY_ROWS
    ops = cache.ops if narrow else cache.torch_ops
    plan, sel = cache.state(layer)  # (on this layer's device)
    # Full-attention layers draft sparsely, and so do windows long enough to pay (`cache.sparse_layers`): a windowed
    # layer's selection and drafts stay inside its window.
    sparse = layer in sel.windows
    if sparse and sel.windows[layer] != sliding_window:
        raise RuntimeError(
            f"Layer {layer} attends with sliding_window={sliding_window}, but its config gives "
            f"{sel.windows[layer]}: hf_vegas cannot tell which slots its drafts may read."
        )
    extra = dict(softcap=softcap, sinks=sinks, window=sliding_window)
    # Finished rows have length 0 here: every op reads nothing for them and outputs zeros, which nothing uses.
    kv_len = plan.attend_lengths
    # A layer may attend more than once per forward (DiffLlama: two value halves over the same keys and queries).
    # The scores depend on queries and keys only, so the layer selects at its first call.
    selecting = sparse and sel.choosing and layer not in sel.selected_layers
    if selecting:
        sel.selected_layers.add(layer)
    if plan.mode == "draft" and sparse:
        if sel.policy.selects_while_drafting:
            _select_for_the_draft_query(cache, ops, layer, query, key, scaling, extra)
        return ops.sparse_draft_attention(
            query, key, value, plan.query_slots, kv_len, sel.sel_idx[layer], sel.sel_count[layer], sel.sel_end,
            scaling, list_len=sel.draft_list_len, split_len=sel.draft_split_len, **extra,
        ), None
    if selecting and sel.score_rows is not None and plan.mode == "verify" and narrow:
        out, emitted, lse = ops.verify_attention(query, key, value, plan.query_slots, kv_len, scaling, sel.score_rows,
                                                 cache.vegas_config.score, **extra)
        _select_from_emitted(cache, ops, layer, emitted, lse, query.shape[1], sliding_window)
        return out, None
    if plan.prefill_left_pad is not None and softcap is None and sinks is None:
        out = prefill.causal_per_row(query, key, value, plan.prefill_left_pad, scaling, sliding_window,
                                     plan.prefill_start)
    else:
        out = ops.dense_attention(query, key, value, plan.query_slots, kv_len, scaling, **extra)
    if selecting:
        _select(cache, layer, query, key, scaling, extra)
    return out, None


# Query rows per KV head the kernels take in one tile. Longer forwards (prefills) run one causal (or banded, for a
# sliding window) SDPA call per row after the tokens the row already holds (`ops/prefill.py`); a layer with a soft
# cap or sinks runs `dense_attention` (the kernels for a narrow forward, else the plain-PyTorch ops).
MAX_KERNEL_QUERY_ROWS = 64


def _select_from_emitted(cache: VegasCache, ops, layer: int, emitted, lse, q_heads: int, window=None) -> None:
    """Turn the verification's emitted logits into the next selection.

    Each layer's scores wait in an `(L, B, S)` scratch; at the last sparse layer all of them select in one op.
    """
    plan, sel = cache.state(layer)
    weights = cache.vegas_config.score == "weights"
    # A windowed layer's candidates start inside its window, and a score row does not rate what its window left.
    where = dict(cand_start=sel.cand_start[layer], window=window, q_slot=plan.query_slots)
    if sel.policy.deferred(plan.mode):  # every scored row's scores, until acceptance
        sel.row_scores[layer] = ops.finalize_scores(emitted, lse, sel.score_rows, sel.sel_end, q_heads, weights,
                                                    mean_rows=False, **where)
        return
    layer_scores = sel.layer_scores(emitted.shape[-1])
    ops.finalize_scores(emitted, lse, sel.score_rows, sel.sel_end, q_heads, weights, mean_rows=True,
                        out=layer_scores[layer][:, None], **where)
    sel.scored_layers.append(layer)
    _flush_scored(cache, layer)


def _flush_scored(cache: VegasCache, layer: int) -> None:
    """At the forward's last sparse layer, select for every layer whose scores wait in the scratch (with the cache's
    ops whatever the forward's width: a selection is one row of scores per (layer, row))."""
    sel = cache.state(layer)[1]
    if layer != sel.sparse_layers[-1] or not sel.scored_layers:
        return
    if sel.scored_layers == sel.sparse_layers:  # the usual case, with a prebuilt index (no copy, graph-safe)
        layers = sel.sparse_layer_index
    else:
        layers = torch.tensor(sel.scored_layers, device=sel.sparse_layer_index.device)
    scores = sel.layer_scores(0)
    if sel.group is not None:  # `selection_heads="all"`: the scored layers' scores averaged over the TP ranks
        scores.index_copy_(0, layers, sel.pool(scores.index_select(0, layers)))
    sel.select(cache.ops, scores, layers=layers)
    sel.scored_layers = []


def _select(cache: VegasCache, layer: int, query, key, scaling, extra: dict) -> None:
    """Choose the next draft's slots for this layer from this prefill/verify forward (no host sync), when the
    forward's attention did not emit its scores (a prefill, or a forward too wide for the kernels)."""
    (plan, sel), config = cache.state(layer), cache.vegas_config
    if sel.policy.selects_while_drafting:  # candidates and budget are set; each draft step picks its slots
        sel.has_selection = True
        return
    if sel.score_rows is None:  # a policy that selects by position alone
        sel.store(layer, sel.policy.select_by_position(sel.sel_count[layer], sel.sel_end, sel.max_selected,
                                                       windowed=extra["window"] is not None))
        return
    rows, q_slot = sel.score_rows, plan.query_slots
    scores = cache.torch_ops.row_scores(
        query[:, :, rows], key, q_slot[:, rows], plan.lengths, sel.sel_end, scaling, config.score, **extra,
        cand_start=sel.cand_start[layer],
    )
    if sel.policy.deferred(plan.mode):
        sel.row_scores[layer] = scores
        return
    sel.layer_scores(scores.shape[-1])[layer].copy_(scores.mean(dim=1))
    sel.scored_layers.append(layer)
    _flush_scored(cache, layer)


def _select_for_the_draft_query(cache: VegasCache, ops, layer: int, query, key, scaling, extra: dict) -> None:
    """The oracle policy: this draft step's own attention weights over the candidates choose its slots."""
    plan, sel = cache.state(layer)
    scores = cache.torch_ops.row_scores(query, key, plan.query_slots, plan.lengths, sel.sel_end, scaling, "weights",
                                        **extra, cand_start=sel.cand_start[layer])
    sel.select(ops, sel.pool(scores[:, 0].contiguous()), layer=layer)


def select_from_rows(cache: VegasCache, rows: torch.Tensor) -> None:
    """A deferring policy (`last_token`): select, per row `b`, from the scores of verify row `rows[b]` (on every
    device that holds layers)."""
    for plan, sel in cache.states():
        with placement.device_guard(sel.device):
            kept = rows.to(sel.device)
            for layer, scores in sel.row_scores.items():
                picked = sel.pool(scores[plan.row_index, kept])  # (B, S)
                sel.select(cache.ops, picked, layer=layer)
        sel.row_scores.clear()


def _no_mask(*args, **kwargs):
    # The cache carries each row's length and selection; a 4D mask would be redundant work (and wrong for
    # ragged rows), so the "vegas" mask function builds nothing.
    return None


def register() -> str:
    """Register the "vegas" attention and mask functions with transformers (idempotent). Returns the name."""
    AttentionInterface.register(ATTN_NAME, vegas_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, _no_mask)
    return ATTN_NAME


@contextlib.contextmanager
def vegas_attention(model):
    """Switch `model` to the "vegas" attention for the block and restore its own implementation after."""
    register()
    original = compat.attn_implementation(model)
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(original)
