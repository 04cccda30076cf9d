"""Which decoder layers run as fused layers (`hf_vegas.fused_layers`), and what they read: `layer_parts(layer)`.

A layer qualifies when its decoder layer, attention and norms run exactly the code of transformers' own Llama classes
(compared as source text against the installed release: a model whose code differs in anything, a bias on the
output projection, a soft cap, another rotary convention, keeps its own forward), or Qwen3's attention (Llama's with
RMSNorms over each query and key head), with plain `nn.Linear` projections and no hooks. The parts are the layer's own
parameters, never copies.

Under transformers' tensor parallelism (`tp_plan="auto"`) a layer qualifies in draft steps when q/k/v and gate/up are
its column-parallel and the output and down projections its row-parallel linears (`compat.column_parallel_shard`,
`compat.row_parallel_shard`): the parts are this rank's shards, and `tp_sums` sums a row-parallel partial product over
the ranks with transformers' own method, as the projection's own forward does.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys

import torch

from ._compat import internals as compat
from .fused_projections import _gate_up, _gated_mlp_activation, _hookless_linear, _large, _linear_parts, _max_rows
from .ops import backend


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


@dataclasses.dataclass(frozen=True)
class RowParallelSum:
    """A row-parallel projection's sum over the tensor-parallel ranks: its partial product handed to transformers' own
    method (`RowwiseParallel.transform_output_post_forward`: the all-reduce, then the bias, which fused layers never
    have: `_row_parts` refuses a biased projection), as its forward does."""

    module: torch.nn.Module
    style: object
    mesh: object

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        return self.style.transform_output_post_forward(self.module, partial, self.mesh)


@dataclasses.dataclass
class LayerParts:
    """What a fused layer reads: the layer's own parameters (never copies), its head layout, and in which steps it
    runs fused."""

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
    full_steps: bool  # small weights, folded norms: the verification and dense steps fuse too (`fused_layers`)
    attention: torch.nn.Module  # the layer's attention module, for the attention dispatch of verification/dense steps
    hands_on: bool = False  # the next layer is fused too: it gets the rotary tables (and its norm's input, below)
    next_norm: tuple[torch.Tensor, float] | None = None  # that next layer's input norm (weight, eps), if `hands_on`
    folds_next: bool = False  # both fold their norms: this layer's last projection writes the next norm's input
    # Under tensor parallelism: the output and down projections' sums over the ranks, and whether this rank adds the
    # residual to its partial product (the first rank only, so that the sum holds it once).
    tp_sums: tuple[RowParallelSum, RowParallelSum] | None = None
    adds_residual: bool = True


def layer_parts(layer) -> LayerParts | None:
    """The parts of `layer` if it can run as a fused layer, else None (it keeps its own forward)."""
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
    if any(m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m) for m in (layer, attn, mlp, *norms)):
        return None
    if any((m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m)) and not compat.replicated_norm(m)
           for m in head_norms):  # (under TP, transformers' replicated norm: without gradients, the class's forward)
        return None
    q, k, v, o = (getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
    act = _gated_mlp_activation(mlp)  # (a standard gated MLP whose gate/up have no bias)
    columns = None if None in (q, k, v, o) else _linear_parts(q, k, v)
    rows = None if columns is None else _row_parts(o, mlp.down_proj)
    if act is None or rows is None:
        return None
    (wq, bq), (wk, bk), (wv, bv) = columns
    (gate, _), (up, _) = _gate_up(mlp)
    (o_weight, down), tp_sums = rows
    sharded = "forward" in vars(q)  # transformers' column-parallel forward: every projection must be sharded alike
    if sharded != (tp_sums is not None) or sharded != ("forward" in vars(mlp.gate_proj)):
        return None
    if sharded and not _even_shards((q, k, v, mlp.gate_proj, mlp.up_proj), (o, mlp.down_proj), tp_sums[0].mesh):
        return None
    if wq.device != gate.device or wq.shape[1] != gate.shape[1]:  # (one input feeds attention and MLP alike)
        return None
    if len({b is None for b in (bq, bk, bv)}) != 1:
        return None
    head_dim = getattr(attn, "head_dim", None)  # (shapes from the weights read: under TP, this rank's heads)
    if not head_dim or head_dim % 2 or wq.shape[0] % head_dim or wv.shape[0] != wk.shape[0]:
        return None
    if wk.shape[0] % head_dim or o_weight.shape[1] != wq.shape[0]:
        return None
    if head_norms and (any(norm.weight.shape != (head_dim,) for norm in head_norms)
                       or head_norms[0].variance_epsilon != head_norms[1].variance_epsilon):
        return None
    weights = (wq, o_weight, gate, down, *(norm.weight for norm in (*norms, *head_norms)))
    if len({t.dtype for t in weights}) != 1:
        return None
    linear = backend.kernels().linear  # (q/k/v run in `qkv_rope_write`, which takes any even head_dim)
    # (large weights whose sizes share no block of 16 for `qkv_linear` keep the one launch: slower, not wrong)
    split_qkv = _large(wq, wk, wv) and linear.block_n_for(wq.shape[0], wk.shape[0]) is not None
    if linear.block_n_for(gate.shape[0]) is None:
        return None
    # (under TP a rank's partial products run the kernel, which needs a column block: else it is refused on the ranks
    # without the residual, while the first rank's `linear_residual_op` would take cuBLAS)
    if sharded and linear.block_n_for(o_weight.shape[0]) is None:
        return None
    # Under TP the residual sums follow the ranks' sum of the partial products, so the norms cannot ride in them.
    fold_norms = not sharded and wq.dtype != torch.float16 and linear.block_n_for(o_weight.shape[0]) is not None
    # Verification and dense steps fuse only where every launch is one of the kernels, at any row count: small weights
    # (large ones keep cuBLAS past a few rows) and folded norms (else a residual sum may take cuBLAS' `addmm`).
    small = not any(_large(*w) for w in ((wq, wk, wv), (gate, up), (o_weight,), (down,)))
    return LayerParts(
        layer_idx=attn.layer_idx, qkv=(wq, wk, wv), qkv_bias=None if bq is None else (bq, bk, bv),
        norm_in=norms[0].weight, eps_in=norms[0].variance_epsilon, o_weight=o_weight, gate=gate, up=up, down=down,
        act=act, norm_post=norms[1].weight, eps_post=norms[1].variance_epsilon,
        q_heads=wq.shape[0] // head_dim, kv_heads=wk.shape[0] // head_dim, head_dim=head_dim,
        scaling=attn.scaling, split_qkv=split_qkv,
        head_norms=(*(norm.weight for norm in head_norms), head_norms[0].variance_epsilon) if head_norms else None,
        max_rows=min(_max_rows(wq, wk, wv), _max_rows(gate, up)),
        fold_norms=fold_norms, full_steps=small and fold_norms, attention=attn,
        tp_sums=tp_sums, adds_residual=tp_sums is None or _first_rank(tp_sums[0].mesh),
    )


def _row_parts(o, down) -> tuple | None:
    """`((output weight, down weight), None)` for plain bias-free `nn.Linear`s on one device; `((this rank's shards),
    (their RowParallelSum))` where both are transformers' row-parallel linears, without bias (the fused layer adds a
    rank's partial product and the residual before the sum, not a bias after it); else None."""
    if not (_hookless_linear(o) and _hookless_linear(down)) or o.bias is not None or down.bias is not None:
        return None
    if "forward" not in vars(o) and "forward" not in vars(down):
        plain = (_linear_parts(o), _linear_parts(down))
        return None if None in plain else ((plain[0][0][0], plain[1][0][0]), None)
    shards = (compat.row_parallel_shard(o), compat.row_parallel_shard(down))
    if None in shards:
        return None
    (o_weight, o_style, o_mesh), (down_weight, down_style, down_mesh) = shards
    if o_weight.stride(-1) != 1 or down_weight.stride(-1) != 1:
        return None
    return (o_weight, down_weight), (RowParallelSum(o, o_style, o_mesh), RowParallelSum(down, down_style, down_mesh))


def _even_shards(columns, rows, mesh) -> bool:
    """Whether every column-parallel weight's rows and every row-parallel weight's columns split evenly over the
    mesh's tensor-parallel ranks. transformers lets the last rank hold a shorter slice: then the ranks' shards differ,
    and one rank could fuse a layer (adding the residual to its partial product, or not) while another runs the
    model's own, whose sum adds it after: the ranks would draft different tokens."""
    dim = _tp_dim(mesh)
    if dim is None:  # (transformers' sum would not find its group either)
        return False
    ranks = mesh.size(dim)
    return (all(m.weight.shape[0] == m.weight.to_local().shape[0] * ranks for m in columns)
            and all(m.weight.shape[1] == m.weight.to_local().shape[1] * ranks for m in rows))


def _tp_dim(mesh) -> int | None:
    """`mesh`'s tensor-parallel dimension as transformers picks it (its only dimension, or the one named "tp")."""
    names = list(mesh.mesh_dim_names or ())
    return 0 if mesh.ndim == 1 else names.index("tp") if "tp" in names else None


def _first_rank(mesh) -> bool:
    """Whether this process is the first rank of `mesh`'s tensor-parallel dimension (checked by `_even_shards`)."""
    return mesh.get_local_rank(_tp_dim(mesh)) == 0


def link_norms(decoder, parts: dict) -> None:
    """Each fused layer of `decoder.layers` whose successor is fused too hands it the rotary tables, and where both
    fold their norms writes that layer's norm input (under TP the sum over the ranks may write that norm)."""
    layers = list(getattr(decoder, "layers", []))
    for layer, following in zip(layers, layers[1:]):
        if layer in parts and following in parts and parts[following].layer_idx == parts[layer].layer_idx + 1:
            parts[layer] = dataclasses.replace(
                parts[layer], hands_on=True, next_norm=(parts[following].norm_in, parts[following].eps_in),
                folds_next=parts[layer].fold_norms and parts[following].fold_norms)
