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

The same launches run the narrow verification and dense steps (`FULL_STEPS`: at most `attention.MAX_KERNEL_QUERY_ROWS`
query rows per KV head, e.g. SmolLM2's 7 tokens x 3 query heads), with the attention the model's own layer would call
(`attention.attend`: full attention and the selection it yields) in place of the sparse draft attention. The model's
own compiled forward runs ~15 launches per layer there (H100: 456 kernels in a SmolLM2 dense step of 30 layers,
`benchmarks/profile_forward.py`). These steps pick the tokens, so their rounding is the kernels' (fp32 accumulation,
like cuBLAS, in another order, and the norms folded as above) rather than the model's: the verification and our dense
path (`gamma=0`) round alike, which `benchmarks/throughput.py` checks (`agreement_with_dense`); on the CPU, in fp32,
the tokens stay vanilla's (the plain-PyTorch backend runs no fused layer). `fuse_projections=False` keeps the model's
own layers in every step. Drafts only decide how many tokens are accepted, never which.

Which layers: the decoder layer, its attention and its norms run exactly the code of transformers' own Llama classes
(compared as source text against the installed release, so a model whose code differs in anything, a bias on the
output projection, a soft cap, another rotary convention, keeps its own forward), or Qwen3's attention, with plain
`nn.Linear` projections, in forwards of few enough rows for the one-launch kernels to pay
(`fused_projections._max_rows`: any narrow step of small weights, a few rows of large ones), no hooks, and full
attention in this generation (sliding-window layers keep their window). Everything else, and every prefill, runs
the model's own forward. Instance `forward` attributes are removed when the block exits. Every kernel is a
`torch.library` custom op, so a compiled step (`vegas_compile`) traces the fused layer with the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys

import torch

from .fused_projections import _gated_mlp_activation, _large, _max_rows, _plain_linears, fused_projections
from ._compat import internals as compat
from .attention import MAX_KERNEL_QUERY_ROWS, attend
from .ops import backend
from .rotary_tables import rotary_tables


# The steps besides drafts whose narrow forwards the fused layers run (`StepPlan.MODES`: "decode" is a dense step).
FULL_STEPS = ("verify", "decode")


@functools.lru_cache(maxsize=256)  # asked for every layer of every generate call: read each function's file once
def _source(function) -> str | None:
    try:
        return "".join(inspect.getsource(function).split())
    except (OSError, TypeError):
        return None


@functools.cache
def _llama_sources() -> dict[str, str | None]:
    """The code a layer must run to be fused: transformers' own Llama classes, as the installed release has them."""
    from transformers.models.llama import modeling_llama as llama

    return {
        "layer": _source(llama.LlamaDecoderLayer.forward), "attention": _source(llama.LlamaAttention.forward),
        "norm": _source(llama.LlamaRMSNorm.forward), "rotary": _source(llama.apply_rotary_pos_emb),
        "rotate_half": _source(llama.rotate_half),
    }


@functools.cache
def _head_norm_attention_source() -> str | None:
    """Qwen3's attention: Llama's, with `q_norm` and `k_norm` over each head before the rotation."""
    try:
        from transformers.models.qwen3 import modeling_qwen3
    except ImportError:  # (a release without Qwen3: no attention of its kind to fuse)
        return None
    return _source(modeling_qwen3.Qwen3Attention.forward)


@dataclasses.dataclass
class _Parts:
    """What a fused draft layer reads: the layer's own parameters (never copies) and its head layout."""

    layer_idx: int
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    qkv_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    norm_in: torch.Tensor
    eps_in: float
    o_weight: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    act: str
    norm_post: torch.Tensor
    eps_post: float
    q_heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    head_norms: tuple[torch.Tensor, torch.Tensor, float] | None  # Qwen3's q_norm and k_norm weights, their eps
    split_qkv: bool  # weights too large for a program per head: `qkv_linear`, then `rope_write_kv`
    max_rows: int  # the largest draft forward the fused kernels pay for (`fused_projections._max_rows`)
    fold_norms: bool  # the norms ride in the projections (else: launches of their own)
    attention: torch.nn.Module  # the layer's attention module, for the attention dispatch of verification/dense steps
    next_norm: tuple[torch.Tensor, float] | None = None  # the next fused layer's input norm (weight, eps)
    hands_on: bool = False  # the next layer is fused too: it gets the rotary tables (and `next_norm`'s input)


def layer_parts(layer) -> _Parts | None:
    """The parts of `layer` if it can run as a fused draft layer, else None (it keeps its own forward)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if attn is None or mlp is None or None in norms or getattr(attn, "layer_idx", None) is None:
        return None
    sources = _llama_sources()
    module = sys.modules.get(type(attn).__module__)
    attention = _source(type(attn).forward)
    head_norms = (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))
    if attention is not None and attention == sources["attention"]:
        head_norms = ()  # Llama's attention: no head norms
    elif (attention is None or attention != _head_norm_attention_source() or None in head_norms
          or any(_source(type(n).forward) != sources["norm"] for n in head_norms)):
        return None
    if (_source(type(layer).forward) != sources["layer"]
            or _source(getattr(module, "apply_rotary_pos_emb", None)) != sources["rotary"]
            or _source(getattr(module, "rotate_half", None)) != sources["rotate_half"]
            or any(_source(type(norm).forward) != sources["norm"] for norm in norms)):
        return None
    if any(m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m)
           for m in (layer, attn, mlp, *norms, *head_norms)):
        return None
    q, k, v, o = (getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
    act = _gated_mlp_activation(mlp)
    if act is None or not _plain_linears(q, k, v, mlp.gate_proj, mlp.up_proj):
        return None
    if len({p.bias is None for p in (q, k, v)}) != 1:
        return None
    if not (_plain_linears(o) and _plain_linears(mlp.down_proj)) or o.bias is not None:
        return None
    if mlp.down_proj.bias is not None:
        return None
    head_dim = getattr(attn, "head_dim", None)
    if not head_dim or head_dim % 2 or q.out_features % head_dim or v.out_features != k.out_features:
        return None
    if k.out_features % head_dim or o.in_features != q.out_features:
        return None
    if head_norms and (any(norm.weight.shape != (head_dim,) for norm in head_norms)
                       or head_norms[0].variance_epsilon != head_norms[1].variance_epsilon):
        return None
    weights = (q.weight, o.weight, mlp.gate_proj.weight, mlp.down_proj.weight,
               *(norm.weight for norm in (*norms, *head_norms)))
    if len({t.dtype for t in weights}) != 1:
        return None
    linear = backend.kernels().linear  # (q/k/v run in `qkv_rope_write`, which takes any even head_dim)
    # (large weights whose sizes share no block of 16 for `qkv_linear` keep the one launch: slower, not wrong)
    split_qkv = _large(q.weight, k.weight, v.weight) and linear.block_n_for(q.out_features, k.out_features) is not None
    if linear.block_n_for(mlp.gate_proj.out_features) is None:
        return None
    return _Parts(
        layer_idx=attn.layer_idx, qkv=(q.weight, k.weight, v.weight),
        qkv_bias=None if q.bias is None else (q.bias, k.bias, v.bias), norm_in=norms[0].weight,
        eps_in=norms[0].variance_epsilon, o_weight=o.weight, gate=mlp.gate_proj.weight, up=mlp.up_proj.weight,
        down=mlp.down_proj.weight, act=act, norm_post=norms[1].weight, eps_post=norms[1].variance_epsilon,
        q_heads=q.out_features // head_dim, kv_heads=k.out_features // head_dim, head_dim=head_dim,
        scaling=attn.scaling, split_qkv=split_qkv,
        head_norms=(*(norm.weight for norm in head_norms), head_norms[0].variance_epsilon) if head_norms else None,
        max_rows=min(_max_rows(q.weight, k.weight, v.weight), _max_rows(mlp.gate_proj.weight, mlp.up_proj.weight)),
        fold_norms=q.weight.dtype != torch.float16 and linear.block_n_for(o.out_features) is not None,
        attention=attn,
    )


def _applies(parts: _Parts, cache, hidden_states: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether this forward is a step the fused layer runs: a one-token sparse draft, or a verification or dense
    step narrow enough for the attention kernels (`attention.MAX_KERNEL_QUERY_ROWS` query rows per KV head), of at
    most `parts.max_rows` rows, in the weights' dtype, without autocast, with per-token rotary factors over the whole
    head (anything else, every prefill among them, runs the model's own forward)."""
    if args or cache is None or kwargs.get(compat.CACHE_KEYWORD) is not cache or hidden_states.dim() != 3:
        return False
    batch, tokens = hidden_states.shape[:2]
    mode = cache.plan.mode
    if mode == "draft":
        narrow = tokens == 1
    else:  # (the longest verification decides for the dense steps too: fused, or not, they round alike)
        longest = cache.vegas_config.max_gamma + 1
        narrow = (mode in FULL_STEPS and tokens <= longest and batch * longest <= parts.max_rows
                  and parts.q_heads // parts.kv_heads * longest <= MAX_KERNEL_QUERY_ROWS)
    position_embeddings = kwargs.get("position_embeddings")
    return (narrow and position_embeddings is not None
            and position_embeddings[0].shape == (batch, tokens, parts.head_dim)
            and not cache.layers[parts.layer_idx].is_sliding and cache.layers[parts.layer_idx].is_initialized
            and batch * tokens <= parts.max_rows and hidden_states.dtype == parts.o_weight.dtype
            and not torch.is_autocast_enabled(hidden_states.device.type))


def _fused_forward(parts: _Parts, cache, hidden_states: torch.Tensor, position_embeddings,
                   carry: dict) -> torch.Tensor:
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
    # Each residual sum is one launch that reads the residual in its epilogue (`torch.addmm` would copy it first),
    # and writes what the norm after it needs.
    attn = attn.reshape(batch * tokens, -1)
    if parts.fold_norms:
        x, scaled, row_sumsq = kernels.linear_residual_norm(attn, parts.o_weight, x, parts.norm_post)
        gated = kernels.gated_linear_op(scaled, parts.gate, parts.up, parts.act, row_sumsq, parts.eps_post)
    else:
        x = kernels.linear_residual_op(attn, parts.o_weight, x)
        gated = kernels.gated_linear_op(kernels.rms_norm(x, parts.norm_post, parts.eps_post), parts.gate, parts.up,
                                        parts.act)
    if parts.next_norm is None:  # (always, without fold_norms: `_link_norms`)
        out, scaled, sums = kernels.linear_residual_op(gated, parts.down, x).view(batch, tokens, hidden), None, None
    else:
        out, scaled, sums = kernels.linear_residual_norm(gated, parts.down, x, parts.next_norm[0])
        out, scaled = out.view(batch, tokens, hidden), scaled.view(batch, tokens, hidden)
    if parts.hands_on:
        carry[parts.layer_idx + 1] = (out, scaled, sums, rope)
    return out


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A forward's rotary tables `(2, *cos.shape)`, written once for a chain of fused layers, which hand them down
    with the norm input. Compiled, inductor would give each fused layer its own copy of `cos` and `sin` (its input to
    an op), and on a GPU it computes some of those copies in launches of their own between the layers: 7 per
    SmolLM2 draft step of 30 layers, each a break in the chain of dependent launches. Written by an op (the one the
    compiled verification and dense forwards use, `rotary_tables`), the tables are one buffer that every layer
    reads."""
    return rotary_tables(cos, sin)


def _link_norms(decoder, parts: dict) -> None:
    """Each fused layer of `decoder.layers` whose successor is fused too hands it the rotary tables, and where both
    fold their norms writes that layer's norm input."""
    layers = list(getattr(decoder, "layers", []))
    for layer, following in zip(layers, layers[1:]):
        if layer in parts and following in parts and parts[following].layer_idx == parts[layer].layer_idx + 1:
            folding = parts[layer].fold_norms and parts[following].fold_norms
            parts[layer] = dataclasses.replace(
                parts[layer], hands_on=True,
                next_norm=(parts[following].norm_in, parts[following].eps_in) if folding else None)


@contextlib.contextmanager
def fused_draft_layers(model, cache):
    """Inside the block, the decoder layers of `model` that `layer_parts` accepts run their draft steps, and their
    narrow verification and dense steps, over `cache` as fused launches (Triton backend); every other forward runs as
    before. Yields the number of layers fused."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    all_parts = {layer: parts for layer in decoder.modules() if (parts := layer_parts(layer)) is not None}
    _link_norms(decoder, all_parts)
    carry = {}  # a norm input (and the rotary tables) one fused layer hands the next, by the next one's index
    patched = []
    try:
        for layer, parts in all_parts.items():
            standard = type(layer).forward

            def forward(hidden_states, *args, _layer=layer, _parts=parts, _standard=standard, **kwargs):
                if _applies(_parts, cache, hidden_states, args, kwargs):
                    return _fused_forward(_parts, cache, hidden_states, kwargs["position_embeddings"], carry)
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
def in_draft_steps(model, cache, enabled: bool):
    """The fused layers (for draft steps and narrow verification and dense steps), and the one-launch projections of
    the layers they do not cover (`fused_projections`, in draft steps only: elsewhere those layers keep the model's
    own projections); a no-op context when not `enabled`. Yields the number of layers fused."""
    if not enabled:
        yield 0
        return
    # A fused layer calls the sparse kernel itself: it would skip a policy that chooses in the attention function.
    layers = (contextlib.nullcontext(0) if cache.selection.policy.selects_while_drafting
              else fused_draft_layers(model, cache))
    with layers as fused, fused_projections(model, active=lambda: cache.plan.mode == "draft"):
        yield fused
