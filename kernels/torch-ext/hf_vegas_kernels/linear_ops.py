"""The projection kernels of `linear.py` as `torch.library` ops with shape-only fakes, so that `torch.compile`
(`vegas_compile`) traces a step's forward through them instead of breaking its graph at every projection:
`qkv_linear` (three weights), `linear_op` (one), `gated_linear_op`, `linear_residual_op` and
`linear_residual_norm_into` (the launch of `linear_residual_norm`, here too, into buffers it is given).
Semantics: `naive.grouped_linear` / `gated_linear` / `linear_residual` / `linear_residual_norm`.
"""

from __future__ import annotations

import torch

from . import _launch
from .linear import _check_residual, _launch_linear, _rows, block_n_for, gated_linear, grouped_linear, \
    linear_residual, norm_partials


def linear_residual_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor):
    """`h = linear_residual(x, weight, residual)` and what the RMSNorm after it needs, from the same launch:
    `(h, h * norm_weight, sumsq)`, `sumsq` `(rows, P)` fp32 partial sums of squares of each rounded row of `h`
    (`sumsq.sum(-1) = (h.float() ** 2).sum(-1)`), for `gated_linear(..., row_sumsq=sumsq)`,
    `qkv_rope_write(..., row_sumsq=sumsq)` or `qkv_linear(..., row_sumsq=sumsq)`. The output size must be a
    multiple of 16.

    The launch is the op `linear_residual_norm_into`, which writes the three buffers allocated here: a compiled
    forward chains it layer after layer, and an op with several outputs in that chain makes inductor print each
    output's whole history (exponential in the depth) while compiling."""
    size = weight.shape[0]
    _check_residual("linear_residual_norm", x, size, residual)
    if block_n_for(size) is None or norm_weight.shape != (size,) or norm_weight.stride(-1) != 1:
        raise ValueError(f"linear_residual_norm: an output size divisible by 16 and a contiguous ({size},) "
                         f"norm_weight, got {size} and {tuple(norm_weight.shape)}")
    rows = residual.numel() // size
    out = _launch.empty(*residual.shape, dtype=x.dtype, device=x.device)
    scaled = _launch.empty(*residual.shape, dtype=x.dtype, device=x.device)
    sumsq = _launch.empty(rows, norm_partials(rows, size, x), dtype=torch.float32, device=x.device)
    linear_residual_norm_into(x, weight, residual, norm_weight, out, scaled, sumsq)
    return out, scaled, sumsq


@torch.library.custom_op("hf_vegas::qkv_linear", mutates_args=())
def qkv_linear(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b0: torch.Tensor | None,
               b1: torch.Tensor | None, b2: torch.Tensor | None, row_sumsq: torch.Tensor | None = None,
               eps: float = 0.0) -> torch.Tensor:
    """`grouped_linear(x, (w0, w1, w2), (b0, b1, b2), row_sumsq, eps)` as one op."""
    return grouped_linear(x, (w0, w1, w2), None if b0 is None else (b0, b1, b2), row_sumsq, eps)


@qkv_linear.register_fake
def _(x, w0, w1, w2, b0, b1, b2, row_sumsq=None, eps=0.0):
    return x.new_empty(*x.shape[:-1], w0.shape[0] + w1.shape[0] + w2.shape[0])


@torch.library.custom_op("hf_vegas::linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`grouped_linear(x, (weight,), (bias,))` as one op: `F.linear` in one launch of the tuned kernel."""
    return grouped_linear(x, (weight,), None if bias is None else (bias,))


@linear_op.register_fake
def _(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("hf_vegas::gated_linear", mutates_args=())
def gated_linear_op(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, act: str,
                    row_sumsq: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """`gated_linear` as one op."""
    return gated_linear(x, w_gate, w_up, act, row_sumsq, eps)


@gated_linear_op.register_fake
def _(x, w_gate, w_up, act, row_sumsq=None, eps=0.0):
    return x.new_empty(*x.shape[:-1], w_gate.shape[0])


@torch.library.custom_op("hf_vegas::linear_residual", mutates_args=())
def linear_residual_op(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`linear_residual` as one op."""
    return linear_residual(x, weight, residual)


@linear_residual_op.register_fake
def _(x, weight, residual):
    return residual.new_empty(residual.shape)


@torch.library.custom_op("hf_vegas::linear_residual_norm_into", mutates_args=("out", "scaled", "sumsq"))
def linear_residual_norm_into(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                              out: torch.Tensor, scaled: torch.Tensor, sumsq: torch.Tensor) -> None:
    """`linear_residual_norm`'s launch, into its buffers: `out` and `scaled` like `residual`, `sumsq` contiguous
    fp32 `(rows, norm_partials(rows, size, x))` (the column blocks of this launch's setting)."""
    size = weight.shape[0]
    rows = residual.numel() // size
    parts = norm_partials(rows, size, x)
    if out.shape != residual.shape or scaled.shape != residual.shape or sumsq.shape != (rows, parts) \
            or sumsq.dtype != torch.float32 or not sumsq.is_contiguous():
        raise ValueError(f"linear_residual_norm_into: out and scaled must be {tuple(residual.shape)} and sumsq "
                         f"contiguous fp32 ({rows}, {parts}), got {tuple(out.shape)}, {tuple(scaled.shape)}, "
                         f"{tuple(sumsq.shape)} in {sumsq.dtype}")
    _launch_linear("linear", _rows(x), [weight], None, out.view(-1, size), residual=_rows(residual),
                   norm_out=(norm_weight, scaled.view(-1, size), sumsq))


@linear_residual_norm_into.register_fake
def _(*args):
    return None
