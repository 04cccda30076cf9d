"""The "vegas" attention function: draft (sparse) or verify/prefill (full + selection), per the cache's step plan.

It is registered through `transformers.AttentionInterface` and reaches the active cache through a context
variable set by whoever drives the forwards (`hf_vegas.generate`, or `hf_vegas.assisted.assisted_generate`):
transformers hands the attention function the layer's keys, not the cache object.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ._compat import internals as compat
from .cache import VegasCache
from .ops import backend, eager, prefill, reference

ATTN_NAME = "vegas"

_ACTIVE: contextvars.ContextVar[VegasCache | None] = contextvars.ContextVar("hf_vegas_active_cache", default=None)


@contextlib.contextmanager
def active_cache(cache: VegasCache):
    """Route every "vegas" attention call inside the block to `cache`."""
    token = _ACTIVE.set(cache)
    try:
        yield cache
    finally:
        _ACTIVE.reset(token)


@torch.compiler.disable  # host-side dispatch and Triton launches: compiled steps (`vegas_compile`) call it eagerly
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
    cache = _ACTIVE.get()
    if cache is None:
        raise RuntimeError(
            "The 'vegas' attention implementation only runs inside hf_vegas generation "
            "(model.generate(..., custom_generate='vegas'))."
        )
    if dropout:
        raise ValueError("hf_vegas runs inference only: attention dropout must be 0 (call model.eval()).")
    # gpt-oss' learned attention sinks: one logit per query head in every softmax's denominator (every op takes them).
    sinks = kwargs.get("s_aux")
    if scaling is None:
        scaling = module.head_dim**-0.5
    # `VegasCache.update` gave the model `(B, kv_heads, slots, D)` views of the `(B, slots, kv_heads, D)` storage; the
    # ops read the storage layout (a model that rebuilt its keys or values passes new tensors, which the ops read
    # through their strides just the same).
    key, value = key.transpose(1, 2), value.transpose(1, 2)
    full_layer = not cache.layers[module.layer_idx].is_sliding
    if full_layer and sliding_window is not None and sliding_window >= cache.reach:
        sliding_window = None  # a window no position of this generation can leave: full attention
    if full_layer != (sliding_window is None):
        raise RuntimeError(
            f"Layer {module.layer_idx} attends with sliding_window={sliding_window}, but its config says "
            f"{'full' if full_layer else 'sliding'} attention: hf_vegas cannot tell which layers to sparsify."
        )
    kernels = _kernels_for(cache, query, key)
    ops = _torch_ops(cache)
    plan, sel = cache.plan, cache.selection
    # Full-attention layers draft sparsely, and so do windows long enough to pay (`cache.sparse_layers`): a windowed
    # layer's selection and drafts stay inside its window.
    sparse = module.layer_idx in sel.windows
    if sparse and sel.windows[module.layer_idx] != sliding_window:
        raise RuntimeError(
            f"Layer {module.layer_idx} attends with sliding_window={sliding_window}, but its config gives "
            f"{sel.windows[module.layer_idx]}: hf_vegas cannot tell which slots its drafts may read."
        )
    window_ops = {} if sliding_window is None else dict(window=sliding_window)
    extra_ops = {} if sinks is None else dict(sinks=sinks)
    # The kernels skip finished rows (length 0: they read nothing and output zeros, which nothing uses). The plain
    # PyTorch ops keep every row's length: a row of length 0 would give them an all-masked softmax (NaN).
    kv_len = plan.attend_lengths if kernels else plan.lengths
    # A layer may attend more than once per forward (DiffLlama: two value halves over the same keys and queries).
    # The scores depend on queries and keys only, so the layer selects at its first call.
    selecting = sparse and sel.selecting(plan.mode) and module.layer_idx not in sel.selected_layers
    if selecting:
        sel.selected_layers.add(module.layer_idx)
    if plan.mode == "draft" and sparse:
        if sel.policy.selects_while_drafting:
            _select_for_the_draft_query(cache, module.layer_idx, query, key, scaling, softcap, sinks, sliding_window)
        draft_attention = kernels.sparse_draft_attention if kernels else ops.sparse_draft_attention
        extra = dict(list_len=sel.draft_list_len, split_len=sel.draft_split_len) if kernels else {}
        out = draft_attention(
            query, key, value, plan.query_slots, kv_len, sel.sel_idx[module.layer_idx],
            sel.sel_count[module.layer_idx], sel.sel_end, scaling, softcap, **extra, **extra_ops, **window_ops,
        )
    elif kernels is not None and selecting and sel.score_rows is not None:
        out, emitted, lse = kernels.verify_attention(
            query, key, value, plan.query_slots, kv_len, scaling, sel.score_rows, cache.vegas_config.score, softcap,
            **extra_ops, **window_ops,
        )
        _select_from_emitted(cache, kernels, module.layer_idx, emitted, lse, query.shape[1], sliding_window)
    else:
        plain = softcap is None and sinks is None
        if plan.prefill_left_pad is not None and plain:
            out = prefill.causal_per_row(query, key, value, plan.prefill_left_pad, scaling, sliding_window)
        else:
            dense = kernels.dense_attention if kernels else ops.dense_attention
            out = dense(query, key, value, plan.query_slots, kv_len, scaling, sliding_window, softcap, **extra_ops)
        if selecting:
            _select(cache, module.layer_idx, query, key, scaling, softcap, sinks, sliding_window)
    return out, None


# The kernels keep all `groups * tokens` query rows of a KV head in one tile. Longer forwards (prefills) run one
# causal (or banded, for a sliding window) SDPA call per row (`ops/prefill.py`), or the reference ops when a prefill
# does not start from an empty cache or the layer has a soft cap or sinks.
MAX_KERNEL_QUERY_ROWS = 64


def _torch_ops(cache: VegasCache):
    """The plain-PyTorch ops of this cache: the CPU path (`ops.eager`) or the shape-static reference."""
    return eager if cache.eager_ops else reference


def _kernels_for(cache: VegasCache, query: torch.Tensor, key: torch.Tensor):
    """The kernels module when this forward runs them, else None (reference ops)."""
    if cache.backend != "triton":
        return None
    groups = query.shape[1] // key.shape[2]
    return backend.kernels() if groups * query.shape[2] <= MAX_KERNEL_QUERY_ROWS else None


def _select_from_emitted(cache: VegasCache, kernels, layer_idx: int, emitted, lse, q_heads: int, window=None) -> None:
    """Kernel path of `_select`: turn the verification's emitted logits into the next selection.

    Each layer's scores wait in an `(L, B, S)` scratch; at the last sparse layer all of them select in one launch.
    """
    sel, weights = cache.selection, cache.vegas_config.score == "weights"
    # A windowed layer's candidates start inside its window, and a score row does not rate what its window left.
    where = dict(cand_start=sel.cand_start[layer_idx], window=window, q_slot=cache.plan.query_slots)
    if sel.policy.deferred(cache.plan.mode):  # every scored row's scores, until acceptance
        sel.row_scores[layer_idx] = kernels.finalize_scores(emitted, lse, sel.score_rows, sel.sel_end, q_heads,
                                                            weights, mean_rows=False, **where)
        return
    layer_scores = sel.layer_scores(emitted.shape[-1])
    kernels.finalize_scores(emitted, lse, sel.score_rows, sel.sel_end, q_heads, weights, mean_rows=True,
                            out=layer_scores[layer_idx][:, None], **where)
    sel.emitted_layers.append(layer_idx)
    _flush_emitted(cache, layer_idx)


def _flush_emitted(cache: VegasCache, layer_idx: int) -> None:
    """At the forward's last sparse layer, select for every layer whose scores the kernels emitted."""
    sel = cache.selection
    if layer_idx != sel.sparse_layers[-1] or not sel.emitted_layers:
        return
    if sel.emitted_layers == sel.sparse_layers:  # the usual case, with a prebuilt index (no copy, graph-safe)
        layers = sel.sparse_layer_index
    else:
        layers = torch.tensor(sel.emitted_layers, device=sel.sparse_layer_index.device)
    backend.kernels().select_topk(sel.layer_scores(0), sel.sel_count, sel.sel_end, sel.buffer(), layers=layers)
    sel.emitted_layers = []


def _select(cache: VegasCache, layer_idx: int, query, key, scaling, softcap, sinks=None, window=None) -> None:
    """Choose the next draft's slots for this layer from this prefill/verify forward (no host sync)."""
    plan, sel, config = cache.plan, cache.selection, cache.vegas_config
    if sel.policy.selects_while_drafting:  # candidates and budget are set; each draft step picks its slots
        sel.has_selection = True
        return
    if sel.score_rows is None:  # a policy that selects by position alone
        sel.store(layer_idx, sel.policy.select_by_position(sel.sel_count[layer_idx], sel.sel_end, sel.max_selected,
                                                           windowed=window is not None))
        return
    rows, q_slot = sel.score_rows, plan.query_slots
    scores = _torch_ops(cache).row_scores(
        query[:, :, rows], key, q_slot[:, rows], plan.lengths, sel.sel_end, scaling, config.score, softcap,
        sinks=sinks, window=window, cand_start=sel.cand_start[layer_idx],
    )
    if sel.policy.deferred(plan.mode):
        sel.row_scores[layer_idx] = scores
        return
    sel.store(layer_idx, reference.select_topk(scores.mean(dim=1), sel.max_selected))
    _flush_emitted(cache, layer_idx)  # earlier layers of this forward may have taken the kernel path


def _select_for_the_draft_query(cache: VegasCache, layer_idx: int, query, key, scaling, softcap, sinks,
                                window) -> None:
    """The oracle policy: this draft step's own attention weights over the candidates choose its slots."""
    plan, sel = cache.plan, cache.selection
    scores = _torch_ops(cache).row_scores(query, key, plan.query_slots, plan.lengths, sel.sel_end, scaling, "weights",
                                          softcap, sinks=sinks, window=window, cand_start=sel.cand_start[layer_idx])
    sel.store(layer_idx, reference.select_topk(scores[:, 0], sel.max_selected))


def select_from_rows(cache: VegasCache, rows: torch.Tensor) -> None:
    """A deferring policy (`last_token`): select, per row `b`, from the scores of verify row `rows[b]`."""
    sel = cache.selection
    for layer_idx, scores in sel.row_scores.items():
        picked = scores[cache.plan.row_index, rows]  # (B, S)
        if cache.backend == "triton":
            backend.kernels().select_topk(picked, sel.sel_count[layer_idx], sel.sel_end, sel.buffer()[layer_idx])
        else:
            sel.store(layer_idx, reference.select_topk(picked, sel.max_selected))
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
