"""Fused layers: a standard pre-norm decoder layer (Llama and its kin) in fewer, fuller launches in decode-sized steps.

A SmolLM2 draft step at batch 64 is bound by its launch count, not its bytes (`benchmarks/profile_forward.py`):
even compiled, each layer is eleven kernels of 1-4 us (add + norm, q/k/v, two rotary halves, the cache write, the
sparse attention, the output projection, add + norm, gate/up, down, add). In draft steps a layer whose code is
exactly Llama's runs instead as five kernels (six when the draft attention splits its list; the first layer of a
chain adds its input norm and the rotary tables' copy):

    [input RMSNorm: the first layer only]                   hf_vegas_kernels.rms_norm
    q/k/v projection (+ q/k norms) + rotary + cache write   hf_vegas_kernels.qkv_rope_write
    sparse draft attention                                  hf_vegas_kernels.sparse_draft_attention
    output projection + residual (+ the next norm's input)  hf_vegas_kernels.linear_residual_norm
    gate/up projection + activation                         hf_vegas_kernels.gated_linear_op
    down projection + residual (+ the next norm's input)    hf_vegas_kernels.linear_residual_norm

The RMSNorms ride in the projections: the projection that makes a norm's input `h` also writes `h * norm_weight`
and each column block's sum of squares of `h`'s rows, and the projection after the norm multiplies `h *
norm_weight` and scales its products by `rsqrt(mean(h^2) + eps)` per row. (Folding the whole norm into the consumer
was slower: every program must first read its rows' squares, and scaling the input tile in registers keeps it from
streaming into the product.) The next layer's input norm is handed from one layer's last projection to the next
layer's first through `carry`, and taken only when the next layer receives the very tensor this one returned: a
decoder that passes another tensor between layers gets its own norm launch back. (One that changed that tensor in
place would go unnoticed; Llama's and its kin's decoders do not, and a wrong draft input would cost acceptance only,
never a token.) In fp16, whose range `h * norm_weight` could exceed where the normalised value would not, and at a
hidden size no block of 16 divides, the norms stay launches of their own (seven kernels per layer). The rotary tables
ride along the same way: the first layer of a chain writes `cos` and `sin` into one buffer (`_rope_tables`) and each
layer hands it to the next, so a compiled step computes them once, not in launches between the layers.

(Before, the projection and the rotary embedding were two launches, and each residual sum was cuBLAS' `addmm`,
which a compiled step runs as a copy of the residual and the GEMM: eleven kernels per layer; then seven, with the
norms as launches of their own.)

Qwen3's attention (Llama's with an RMSNorm over each query and key head, `q_norm` and `k_norm`) fuses the same way:
the head norms ride in the launch that rotates the heads. Where the q/k/v weights are large
(`fused_projections._large`, Qwen3-8B's 50 MB), a launch with one program per head would read them on too few SMs, so
the projection runs as its own launch (`qkv_linear`, the input norm folded in) and `rope_write_kv` normalises, rotates
and writes after it: six kernels. (The model's own compiled forward of a Qwen3-8B draft layer ran ten: the
projections, the attention and five small kernels of about 15 us together at 16 x 32K on an H200,
`benchmarks/RESULTS.md`.)

The same launches run the verification and dense steps (`FULL_STEPS`), with the attention the model's own layer
would call (`attention.attend`: full attention and the selection it yields) in place of the sparse draft attention.
The model's own compiled forward runs ~15 launches per layer there (H100: 456 kernels in a SmolLM2 dense step of 30
layers, `benchmarks/profile_forward.py`); fused, a SmolLM2 dense step at 64 x 7.5K took 3.77 ms against 4.20 and a
verification 5.97 against 6.10 (H200, `benchmarks/RESULTS.md`). These steps pick the tokens, so they round as the
kernels do (fp32 sums, like cuBLAS', in another order; the norms folded as above), not as the model's layers: in
half precision on the GPU the tokens may differ from vanilla's as a kernel change may (in fp32 on the CPU, where
the plain-PyTorch backend runs no fused layer, they are vanilla's). What must hold is that the verification and our
dense path (`gamma=0`) round alike, at every gamma: the README promises that speculation changes no token against
the dense path, `gamma="auto"` moves between the two within a generation, and the benchmark compares them
(`agreement_with_dense`). So a layer fuses them at any gamma or not at all (`_applies`: small weights, folded norms,
a batch of at least `FULL_STEP_MIN_BATCH` rows, so that both take 64-row tiles), and the projections' launch
settings keep the order of every sum at every row count (`_launch.LINEAR_TUNING`; a launch of more than 64 rows may
take other pipeline stages, and column blocks that a GPU test shows to round alike), so that a verification of
64 x 7 rows rounds as the dense step of its 64 (measured: 64 of 64 greedy rows at SmolLM2 64 x 7.5K; with the
former "generic" setting above 64 rows, whose norms' partial sums covered other column blocks, 20 of 64). Below that
batch, for large weights, and under `fuse_projections=False` (then in every step), the model's own layers run these
steps, as they did before 7f5a89f. Drafts only decide how many tokens are accepted, never which.

Under transformers' tensor parallelism (`tp_plan="auto"`) such a layer runs its draft steps fused too, over this
rank's shards: q/k/v (column-parallel) with the head norms, rotary embedding and cache write as above, the sparse
attention over this rank's KV heads, then the output and down projections' partial products (row-parallel), each
handed to transformers' own sum over the ranks (`LayerParts.tp_sums`), the first rank's with the residual added
(`_partial_product`), and the norms as launches of their own: their input is whole only after the sum. With
`tp_all_reduce="symmetric_memory"` on two ranks each sum and the norm after it are one launch instead
(`exchange_sum_norm`, through the `Exchange` that `symmetric_all_reduces` yields), the down projection's sum writing
the next fused layer's input norm. Verification
and dense steps keep the model's own forward there.

Which layers: the decoder layer, its attention and its norms run exactly the code of transformers' own Llama classes
(compared as source text against the installed release, so a model whose code differs in anything, a bias on the
output projection, a soft cap, another rotary convention, keeps its own forward), or Qwen3's attention, with plain
`nn.Linear` projections or transformers' tensor-parallel ones (`fused_layer_parts`), in draft steps of few enough
rows for the one-launch kernels to pay (`fused_projections._max_rows`: any draft of small weights, a few rows of large
ones) and the verification and dense steps above, no hooks, and full attention in this generation (sliding-window
layers keep their window). Everything else, and every prefill, runs the model's own forward. Instance `forward`
attributes are removed when the block exits. Every kernel is a `torch.library` custom op, so a compiled step
(`vegas_compile`) traces the fused layer with the rest.
"""

from __future__ import annotations

import contextlib

import torch

from ._compat import internals as compat
from .attention import attend
from .fused_layer_parts import LayerParts, layer_parts, link_norms
from .fused_projections import fused_projections
from .rotary_tables import rotary_tables

# The steps besides drafts that the fused layers run (`StepPlan.MODES`: "decode" is a dense step).
FULL_STEPS = ("verify", "decode")
# Verification and dense steps fuse from this batch on: the projections' row block is 64 rows (`_launch.LINEAR_TUNING`)
# and is clamped to the rows of a smaller forward, so below it a dense step and its verification (gamma + 1 times the
# rows) would run tiles of other heights, which may round otherwise.
FULL_STEP_MIN_BATCH = 64


def _applies(parts: LayerParts, cache, hidden_states: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether this forward is a step the fused layer runs: a one-token sparse draft of at most `parts.max_rows`
    rows, or a verification or dense step of at least `FULL_STEP_MIN_BATCH` rows through a layer of small weights
    (`parts.full_steps`), at any gamma: a dense step and a verification then either both fuse or both do not, and
    round alike; in the weights' dtype, without autocast, with per-token rotary factors over the whole head
    (anything else, every prefill among them, runs the model's own forward)."""
    if args or cache is None or kwargs.get(compat.CACHE_KEYWORD) is not cache or hidden_states.dim() != 3:
        return False
    batch, tokens = hidden_states.shape[:2]
    mode = cache.plan.mode
    if mode == "draft":
        fits = tokens == 1 and batch <= parts.max_rows
    else:  # (HF's assisted loop, one row, re-feeds its prompt with the first verification: never fused)
        fits = (mode in FULL_STEPS and parts.full_steps and batch >= FULL_STEP_MIN_BATCH
                and tokens <= cache.vegas_config.max_gamma + 1)
    position_embeddings = kwargs.get("position_embeddings")
    return (fits and position_embeddings is not None
            and position_embeddings[0].shape == (batch, tokens, parts.head_dim)
            and not cache.layers[parts.layer_idx].is_sliding and cache.layers[parts.layer_idx].is_initialized
            and hidden_states.dtype == parts.o_weight.dtype
            and not torch.is_autocast_enabled(hidden_states.device.type))


def _fused_forward(parts: LayerParts, cache, hidden_states: torch.Tensor, position_embeddings,
                   carry: dict, exchange) -> torch.Tensor:
    kernels = cache.ops  # the Triton backend's: fused layers run on no other
    batch, tokens, hidden = hidden_states.shape
    x = hidden_states.reshape(batch * tokens, hidden)
    bias = parts.qkv_bias or (None, None, None)
    # The layer before handed its output with this layer's norm input (None where the norms do not fold) and the
    # rotary tables.
    handed = carry.pop(parts.layer_idx, None)
    normed, row_sumsq, rope = handed[1:] if handed is not None and handed[0] is hidden_states else (None, None, None)
    if normed is None:
        normed, row_sumsq = kernels.rms_norm(x, parts.norm_in, parts.eps_in).view(batch, tokens, hidden), None
    if rope is None or rope[0] is not position_embeddings:  # the first layer of a chain (or new tables)
        rope = (position_embeddings, _rope_tables(*position_embeddings) if parts.hands_on
                else tuple(t.contiguous() for t in position_embeddings))
    cos, sin = rope[1]
    cache.begin_layer(parts.layer_idx, tokens)
    store = cache.layers[parts.layer_idx]
    heads = (parts.q_heads, parts.kv_heads, parts.head_dim)
    head_norms = parts.head_norms or (None, None, 0.0)
    if parts.split_qkv:
        qkv = kernels.qkv_linear(normed, *parts.qkv, *bias, row_sumsq, parts.eps_in)
        q = kernels.rope_write_kv(qkv, cos, sin, store.keys, store.values, cache.plan.write_slots, *heads, *head_norms)
    else:
        q = kernels.qkv_rope_write(normed, *parts.qkv, *bias, cos, sin, store.keys, store.values,
                                   cache.plan.write_slots, *heads, row_sumsq, parts.eps_in, *head_norms)
    if cache.plan.mode == "draft":
        sel = cache.selection
        attn = kernels.sparse_draft_attention(
            q.transpose(1, 2), store.keys, store.values, cache.plan.query_slots, cache.plan.attend_lengths,
            sel.sel_idx[parts.layer_idx], sel.sel_count[parts.layer_idx], sel.sel_end, parts.scaling,
            list_len=sel.draft_list_len, split_len=sel.draft_split_len,
        )
    else:  # a verification or dense step: the attention the model's own layer would call, its selection included
        attn, _ = attend(cache, parts.attention, q.transpose(1, 2), store.keys.transpose(1, 2),
                         store.values.transpose(1, 2), parts.scaling, None, None, None)
    attn = attn.reshape(batch * tokens, -1)
    if parts.tp_sums is not None:
        out, scaled, sums = _tensor_parallel_rest(kernels, parts, attn, x, exchange)
    else:
        out, scaled, sums = _rest(kernels, parts, attn, x)
    out = out.view(batch, tokens, hidden)
    scaled = None if scaled is None else scaled.view(batch, tokens, hidden)
    if parts.hands_on:
        carry[parts.layer_idx + 1] = (out, scaled, sums, rope)
    return out


def _rest(kernels, parts: LayerParts, attn: torch.Tensor, x: torch.Tensor) -> tuple:
    """A layer after its attention, on one device: `(output, next norm's scaled input, its row sums)` (the last two
    None where the norms do not fold). Each residual sum is one launch that reads the residual in its epilogue
    (`torch.addmm` would copy it first), and writes what the norm after it needs."""
    if parts.fold_norms:
        x, scaled, row_sumsq = kernels.linear_residual_norm(attn, parts.o_weight, x, parts.norm_post)
        gated = kernels.gated_linear_op(scaled, parts.gate, parts.up, parts.act, row_sumsq, parts.eps_post)
    else:
        x = kernels.linear_residual_op(attn, parts.o_weight, x)
        normed = kernels.rms_norm(x, parts.norm_post, parts.eps_post)
        gated = kernels.gated_linear_op(normed, parts.gate, parts.up, parts.act)
    if not parts.folds_next:  # (always, without fold_norms: `link_norms`)
        return kernels.linear_residual_op(gated, parts.down, x), None, None
    return kernels.linear_residual_norm(gated, parts.down, x, parts.next_norm[0])


def _tensor_parallel_rest(kernels, parts: LayerParts, attn: torch.Tensor, x: torch.Tensor, exchange) -> tuple:
    """Under tensor parallelism, a layer after its attention: the output projection's partial products summed over
    the ranks (with the residual), the norm, this rank's gate/up columns, the down projection's sum (with the
    residual). Two sums per layer, as the model's own forward makes.

    Through an `exchange` (`symmetric_all_reduce.Exchange`, two ranks) each sum and the norm after it are one launch
    (`exchange_sum_norm`), and the down projection's sum hands the next fused layer its input norm; the two sums take
    the exchange's two halves in turn (every fused layer starts on half 0 after one that ended on half 1, whatever
    runs between them). Otherwise each sum is transformers' own (`LayerParts.tp_sums`) and each norm a launch of its
    own."""
    o_partial = _partial_product(kernels, attn, parts.o_weight, x, parts.adds_residual)
    if not _sums_through(exchange, o_partial):
        x = parts.tp_sums[0](o_partial)
        normed = kernels.rms_norm(x, parts.norm_post, parts.eps_post)
        gated = kernels.gated_linear_op(normed, parts.gate, parts.up, parts.act)
        return parts.tp_sums[1](_partial_product(kernels, gated, parts.down, x, parts.adds_residual)), None, None
    x, normed = kernels.exchange_sum_norm(o_partial, parts.norm_post, parts.eps_post, exchange.name, 0)
    gated = kernels.gated_linear_op(normed, parts.gate, parts.up, parts.act)
    norm, eps = parts.next_norm or (None, 0.0)  # (the last layer: the model's final norm follows)
    out, next_normed = kernels.exchange_sum_norm(_partial_product(kernels, gated, parts.down, x, parts.adds_residual),
                                                 norm, eps, exchange.name, 1)
    return out, next_normed if norm is not None else None, None


def _sums_through(exchange, partial: torch.Tensor) -> bool:
    """Whether `partial` is summed through `exchange`: one is given, of its dtype and width, with room for its rows
    (plain values only: a compiled step's trace decides alike, and every rank alike)."""
    return (exchange is not None and partial.dtype == exchange.dtype and partial.shape[0] <= exchange.rows
            and partial.shape[1] == exchange.hidden)


def _partial_product(kernels, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                     adds_residual: bool) -> torch.Tensor:
    """A row-parallel projection's partial product on this rank, with the residual added on the first rank only: the
    ranks' sum is then the projection plus the residual, one launch fewer than the sum's own addition. (It rounds
    otherwise than the model's residual sum after the all-reduce: drafts may, as they only decide how many tokens are
    accepted.)"""
    return kernels.linear_residual_op(x, weight, residual) if adds_residual else kernels.linear_op(x, weight, None)


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A forward's rotary tables `(2, *cos.shape)`, written once for a chain of fused layers, which hand them down
    with the norm input. Compiled, inductor would give each fused layer its own copy of `cos` and `sin` (its input to
    an op), and on a GPU it computes some of those copies in launches of their own between the layers: 7 per
    SmolLM2 draft step of 30 layers, each a break in the chain of dependent launches. Written by an op (the one the
    compiled verification and dense forwards use, `rotary_tables`), the tables are one buffer that every layer
    reads."""
    return rotary_tables(cos, sin)


@contextlib.contextmanager
def fused_layers(model, cache, exchange=None):
    """Inside the block, the decoder layers of `model` that `layer_parts` accepts run their draft steps, and where
    `_applies` says so their verification and dense steps, over `cache` as fused launches (Triton backend); every
    other forward runs as before. Under tensor parallelism their sums over the ranks go through `exchange` where one
    is given (`symmetric_all_reduce.symmetric_all_reduces`). Yields the number of layers fused."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    all_parts = {layer: parts for layer in decoder.modules() if (parts := layer_parts(layer)) is not None}
    link_norms(decoder, all_parts)
    carry = {}  # a norm input (and the rotary tables) one fused layer hands the next, by the next one's index
    patched = []
    try:
        for layer, parts in all_parts.items():
            standard = type(layer).forward

            def forward(hidden_states, *args, _layer=layer, _parts=parts, _standard=standard, **kwargs):
                if _applies(_parts, cache, hidden_states, args, kwargs):
                    return _fused_forward(_parts, cache, hidden_states, kwargs["position_embeddings"], carry,
                                          exchange)
                carry.pop(_parts.layer_idx, None)  # a norm input handed to this layer, unused, is not kept
                return _standard(_layer, hidden_states, *args, **kwargs)

            layer.forward = forward
            patched.append(layer)
        yield len(patched)
    finally:
        carry.clear()
        for layer in patched:
            del layer.forward  # the class's forward again


@contextlib.contextmanager
def fused_steps(model, cache, enabled: bool, exchange=None):
    """The fused layers (draft steps, and from `FULL_STEP_MIN_BATCH` rows on verification and dense steps), and the
    one-launch projections of the layers they do not cover (`fused_projections`, in draft steps only: elsewhere those
    layers keep the model's own projections); a no-op context when not `enabled`. `exchange`: see `fused_layers`.
    Yields the number of layers fused."""
    if not enabled:
        yield 0
        return
    # A fused layer calls the sparse kernel itself: it would skip a policy that chooses in the attention function.
    layers = (contextlib.nullcontext(0) if cache.selection.policy.selects_while_drafting
              else fused_layers(model, cache, exchange))
    with layers as fused, fused_projections(model, active=lambda: cache.plan.mode == "draft"):
        yield fused
