"""One launch for a layer's q/k/v projections and one for its gate/up projections + activation, in draft steps; and
the tuned kernel for a large output or down projection.

A draft step of a small model at batch 64 is bound by its kernel count, not its bytes: SmolLM2's seven cuBLAS
projections per layer take ~25 us of a ~60 us layer (`benchmarks/profile_forward.py`). Inside `fused_projections`,
while `active()` says so (the generation loop: in draft steps), the attention modules' `q_proj` computes q, k and v
in one kernel (`hf_vegas_kernels.qkv_linear`) and `k_proj` / `v_proj` hand out their slices of it; a standard gated
MLP (`down(act(gate(x)) * up(x))`) computes `act(gate) * up` in one kernel. The kernels round differently from
cuBLAS, which a draft may (it only decides how many tokens are accepted, never which); the verification and dense
steps, whose logits pick the tokens, keep these layers' own projections. (Layers running exactly Llama's code take
all three kinds of steps through `hf_vegas.fused_layers` instead, where verification and dense steps round alike.)

Under transformers' tensor parallelism (`tp_plan="auto"`) q/k/v and gate/up are column-parallel: each rank computes
its own output columns from its shard of the weights, and the kernels do the same from the same shards.

A layer whose q/k/v or gate/up are fused also runs its output (`o_proj`) or down (`down_proj`) projection through
the kernel (`hf_vegas_kernels.linear_op`) where its weight is large (over `MAX_WEIGHT_BYTES`), in forwards of at most
`LARGE_WEIGHT_MAX_ROWS` rows: no launch is saved there, but the kernel reads such a weight faster than cuBLAS does
from a few rows (Qwen3-8B at 16 rows on an H200, commit b89507d: 11.4 against 14.1 us, 28.2 against 31.2;
`_launch.LINEAR_TUNING`'s "linear_large"). Small single projections keep cuBLAS, which is as fast there. Under
tensor parallelism those two are row-parallel: where a rank's shard is large, the kernel computes its partial product
and transformers' own method (`RowwiseParallel.transform_output_post_forward`) sums the ranks' and adds the bias, as
the forward it replaces does (at one rank's tp2 shards of Qwen3-8B the kernel's best settings read the down
projection in 15.4 against cuBLAS' 18.7 us: H200, 2f97021, `projections.py --sweep --shapes qwen3-8b-tp2`).

The weights are read where they are (no fused copy, no extra memory) and the model is changed only by instance-level
`forward` attributes, put back as they were when the block exits (none, or transformers' tensor-parallel forward),
also on an exception. Forwards of more rows than `MAX_ROWS` keep
cuBLAS, which is faster there; so do forwards of more than a few rows (`LARGE_WEIGHT_MAX_ROWS`) through weights
large enough for cuBLAS to reach the bandwidth (`MAX_WEIGHT_BYTES`), inputs `nn.Linear` would cast or refuse, and
modules with hooks or unknown shapes.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn

from ._compat import internals as compat
from .ops import backend

# Rows (tokens x batch) up to which a draft forward uses the fused kernels (a draft's rows are its batch).
MAX_ROWS = 512
# The kernels pay where a projection is latency-bound, i.e. its weights are small. Measured on an H100
# (`benchmarks/projections.py`, bf16): SmolLM2-135M's q/k/v (1.1 MB) 10.8 -> 5.4 us and gate/up (3.5 MB) 11.1 -> 9.3 us
# at 64 rows; Qwen3-8B's (50 MB, 200 MB) no faster at 64 rows and up to 2x slower at 448, where cuBLAS reaches the
# bandwidth. Above this many weight bytes per fused launch a layer keeps cuBLAS, except in forwards of at most
# `LARGE_WEIGHT_MAX_ROWS` rows: there cuBLAS picks split-K GEMMs (a second, reducing launch) and the kernels read the
# weights faster (Qwen3-8B at 4 rows: q/k/v 31.9 -> 21.2 us, gate/up 82.2 -> 74.1; at 16 rows 34.6 -> 21.4 and
# 81.2 -> 74.4; H100, commit b725a73, benchmarks/results/projections.jsonl).
MAX_WEIGHT_BYTES = 16 << 20  # (as `hf_vegas_kernels._launch.LINEAR_LARGE_WEIGHT_BYTES`, where their settings change)
LARGE_WEIGHT_MAX_ROWS = 16

# The forward of a standard gated MLP, whitespace removed (Llama, Mistral, Qwen2/3, Gemma-3 and their kin).
_GATED_MLP_FORWARDS = (
    "defforward(self,x):down_proj=self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))returndown_proj",
    "defforward(self,x):returnself.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))",
)
_ACTIVATIONS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh",
                "GELUPytorchTanh": "gelu_tanh"}


def _linear_parts(*modules) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
    """The (weight, bias) each projection's kernel reads, or None if one of `modules` is not a projection the kernels
    can run. A projection is exactly `nn.Linear` (no subclass: quantised layers) without hooks, and either has no
    forward of its own (its weight and bias) or is transformers' column-parallel linear under tensor parallelism (its
    rank's shard, `compat.column_parallel_shard`: the output columns its own forward computes), all of one kind, with
    one dtype, device and input width, and weights (and biases) whose rows are contiguous, as the kernels read them."""
    parts, sharded = [], set()
    for m in modules:
        if not _hookless_linear(m):
            return None
        if "forward" in vars(m):
            shard = compat.column_parallel_shard(m)  # this rank's plain tensors, or None
        else:  # a DTensor weight without transformers' column-parallel forward: not a tensor a kernel can read
            shard = None if _distributed(m.weight) or _distributed(m.bias) else (m.weight, m.bias)
        if shard is None:
            return None
        sharded.add("forward" in vars(m))
        parts.append(shard)
    if len(sharded) != 1 or len({(w.dtype, w.device, w.shape[-1]) for w, _ in parts}) != 1:
        return None
    if any(w.dim() != 2 or w.stride(-1) != 1 or (b is not None and b.stride(-1) != 1) for w, b in parts):
        return None
    return parts


def _hookless_linear(module) -> bool:
    """Exactly `nn.Linear` (no subclass: quantised layers) without forward hooks: a forward a kernel may replace."""
    return type(module) is nn.Linear and not (module._forward_hooks or module._forward_pre_hooks)


def _distributed(tensor) -> bool:
    """A `DTensor` (a kernel must read a plain tensor: the whole weight, or this rank's shard)."""
    if tensor is None or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _large(*weights) -> bool:
    """Whether one launch over these weights reads more than `MAX_WEIGHT_BYTES`."""
    return sum(w.numel() * w.element_size() for w in weights) > MAX_WEIGHT_BYTES


def _max_rows(*weights) -> int:
    """The most rows a forward may have for projections of these weights to run as one kernel: all draft-sized
    forwards for small weights, only the smallest for weights that cuBLAS reads at full bandwidth from a few more
    rows on."""
    return LARGE_WEIGHT_MAX_ROWS if _large(*weights) else MAX_ROWS


def _use_kernel(x: torch.Tensor, weight: torch.Tensor, active, max_rows: int) -> bool:
    """A draft-sized step (at most `max_rows` rows) in the weights' own dtype: anything else (a prefill, a
    verification, autocast, an input that `nn.Linear` would refuse) runs the plain projection, with its own checks
    and casts."""
    return (active() and x.numel() // x.shape[-1] <= max_rows and x.dtype == weight.dtype
            and not torch.is_autocast_enabled(x.device.type))


class _FusedQKV:
    """The forwards that replace `q_proj`, `k_proj`, `v_proj` of one attention module. Outside draft-sized steps
    each projection runs the forward it had (its class's, or under TP transformers' column-parallel one)."""

    def __init__(self, projections, parts, op, active):
        self.own = [m.forward for m in projections]
        (self.wq, self.bq), (self.wk, self.bk), (self.wv, self.bv) = parts
        self.op, self.active = op, active
        self.max_rows = _max_rows(self.wq, self.wk, self.wv)
        self.split = (self.wq.shape[0], self.wq.shape[0] + self.wk.shape[0])
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (input, fused output) until v reads it

    def q_forward(self, x):
        if not _use_kernel(x, self.wq, self.active, self.max_rows):
            return self.own[0](x)
        fused = self.op(x, self.wq, self.wk, self.wv, self.bq, self.bk, self.bv)
        self.pending = (x, fused)
        return fused[..., : self.split[0]]

    def k_forward(self, x):
        if self.pending is not None and self.pending[0] is x:
            return self.pending[1][..., self.split[0] : self.split[1]]
        return self.own[1](x)

    def v_forward(self, x):
        if self.pending is not None and self.pending[0] is x:
            out, self.pending = self.pending[1][..., self.split[1] :], None
            return out
        return self.own[2](x)


def _fuse_attention(module, kernels, active) -> list[tuple[nn.Module, object]] | None:
    projections = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    parts = None if None in projections else _linear_parts(*projections)
    if parts is None or len({b is None for _, b in parts}) != 1:
        return None
    if kernels.linear.block_n_for(*(w.shape[0] for w, _ in parts)) is None:
        return None
    fused = _FusedQKV(projections, parts, kernels.qkv_linear, active)
    patched = [(projection, vars(projection).get("forward")) for projection in projections]
    for projection, forward in zip(projections, (fused.q_forward, fused.k_forward, fused.v_forward)):
        projection.forward = forward
    return patched


def _fuse_single(module, name: str, kernels, active) -> list[tuple[nn.Module, object]] | None:
    """`module`'s projection `name` (`o_proj`, `down_proj`) as one launch of the tuned kernel in draft forwards of at
    most `LARGE_WEIGHT_MAX_ROWS` rows, if it is a plain `nn.Linear` of a large weight, or a row-parallel one under
    tensor parallelism whose shard is large (the kernel computes this rank's partial product; transformers' own
    method then sums the ranks' and adds the bias)."""
    projection = getattr(module, name, None)
    if projection is None:
        return None
    own = projection.forward
    if "forward" in vars(projection):  # transformers' row-parallel forward, or one no kernel may replace
        row_parallel = compat.row_parallel_shard(projection) if _hookless_linear(projection) else None
        if row_parallel is None:
            return None
        weight, style, mesh = row_parallel
        bias = None  # added after the sum, by `transform_output_post_forward`
    else:
        row_parallel, parts = None, _linear_parts(projection)
        if parts is None:
            return None
        ((weight, bias),) = parts
    if weight.stride(-1) != 1 or not _large(weight) or kernels.linear.block_n_for(weight.shape[0]) is None:
        return None

    def forward(x):
        if not _use_kernel(x, weight, active, LARGE_WEIGHT_MAX_ROWS):
            return own(x)
        if row_parallel is None:
            return kernels.linear_op(x, weight, bias)
        # transformers' local fast path, as its forward takes it: no gradients, a plain input of this rank's columns
        if torch.is_grad_enabled() or _distributed(x) or x.shape[-1] != weight.shape[1]:
            return own(x)
        return style.transform_output_post_forward(projection, kernels.linear_op(x, weight, None), mesh)

    projection.forward = forward
    return [(projection, own if row_parallel is not None else None)]  # (None: the class's forward again)


def _gated_mlp_activation(module) -> str | None:
    """The activation name if `module` is a standard gated MLP the kernel can run, else None."""
    parts = _gate_up(module)
    if parts is None or parts[0][1] is not None or parts[1][1] is not None:
        return None
    if parts[0][0].shape[0] != parts[1][0].shape[0] or "forward" in vars(module):
        return None
    try:
        source = "".join(inspect.getsource(type(module).forward).split())
    except (OSError, TypeError):
        return None
    if source not in _GATED_MLP_FORWARDS:
        return None
    return _ACTIVATIONS.get(type(getattr(module, "act_fn", None)).__name__)


def _gate_up(module):
    """The (weight, bias) pairs of `module`'s gate and up projections (`_linear_parts`), or None."""
    projections = [getattr(module, name, None) for name in ("gate_proj", "up_proj")]
    return None if None in projections else _linear_parts(*projections)


def _fuse_mlp(module, kernels, active) -> list[tuple[nn.Module, object]] | None:
    act = _gated_mlp_activation(module)
    if act is None:
        return None
    (gate, _), (up, _) = _gate_up(module)
    if kernels.linear.block_n_for(gate.shape[0]) is None:
        return None
    standard = type(module).forward
    max_rows = _max_rows(gate, up)

    def forward(x):  # (under TP, `down_proj`'s own forward sums the ranks' partial products)
        if not _use_kernel(x, gate, active, max_rows):
            return standard(module, x)
        return module.down_proj(kernels.gated_linear_op(x, gate, up, act))

    module.forward = forward
    return [(module, None)]


@contextlib.contextmanager
def fused_projections(model, active=lambda: True):
    """Run `model`'s attention and gated-MLP projections as one launch each inside the block (Triton backend), in the
    forwards during which `active()` is true (it is asked in every projection call; with CUDA graphs, at capture).

    Yields the number of attention modules and MLPs fused, and of output and down projections run by the kernel
    (`"output"`).
    """
    kernels = backend.kernels()
    patched: list[tuple[nn.Module, object]] = []  # (module, the forward attribute it had, or None)
    counts = {"attention": 0, "mlp": 0, "output": 0}
    # Only the language model's layers run in draft steps (a multimodal class's vision tower never does).
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    try:
        for module in decoder.modules():
            for kind, fuse, single in (("attention", _fuse_attention, "o_proj"), ("mlp", _fuse_mlp, "down_proj")):
                done = fuse(module, kernels, active)
                if done:
                    patched += done
                    counts[kind] += 1
                    done = _fuse_single(module, single, kernels, active)
                    if done:
                        patched += done
                        counts["output"] += 1
        yield counts
    finally:
        for module, own in patched:
            if own is None:
                del module.forward  # the class's forward again
            else:
                module.forward = own  # e.g. transformers' tensor-parallel forward
