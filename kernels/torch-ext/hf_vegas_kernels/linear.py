"""Projections of a decode step in one launch each: q/k/v together, and gate/up with the activation and product.

At a decode step's few rows (a draft: one token per row) a projection reads a few hundred kilobytes of weights and
takes a cuBLAS launch of ~3-4 us on an H100, most of it latency: SmolLM2's seven projections per layer are 40 % of
its draft step. These kernels read the separate weight matrices of one layer in a single launch (no fused copy of the
weights is made, so the model is untouched and no memory is added):

- `grouped_linear(x, (w0, w1, w2), biases)` = `cat([x @ w0.T + b0, x @ w1.T + b1, x @ w2.T + b2], -1)`;
- `gated_linear(x, w_gate, w_up, act)` = `act(x @ w_gate.T) * (x @ w_up.T)`, `act` "silu" or "gelu_tanh";
- `linear_residual(x, w, residual)` = `residual + x @ w.T`, the residual read in the epilogue (a compiled
  `torch.addmm(residual, ...)` is a copy of the residual, then the GEMM: two launches);
- `linear_residual_norm(x, w, residual, norm_weight)`: the same, and for the RMSNorm after it `h * norm_weight` and
  per-block sums of squares of `h`, which `gated_linear` / `qkv_rope.qkv_rope_write` turn into the norm's row
  factor (`row_sumsq`): a fused layer's norms need no launch of their own (`hf_vegas.fused_layers`).

A program owns `BLOCK_M` rows and `BLOCK_N` output columns that all lie in one weight (segment sizes are multiples
of `BLOCK_N`), and accumulates in fp32. Block sizes, warps and stages per op: `_launch.LINEAR_TUNING`, as
`linear_settings.launch_setting` applies it.
Semantics: `naive.grouped_linear` / `gated_linear` / `linear_residual` / `linear_residual_norm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._pdl import lines, prefetch_rows, release_dependents, wait_for_inputs
from .linear_settings import block_n_for, launch_setting

ACTIVATIONS = {"silu": 1, "gelu_tanh": 2}
# Widest column block under Triton's CPU interpreter (0: the GPU settings, which tests of those settings ask for).
INTERPRETER_BLOCK_N = 128


@triton.jit
def _activate(x, ACT: tl.constexpr):
    if ACT == 1:
        return x * tl.sigmoid(x)
    # gelu, tanh approximation: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))


@triton.jit
def _tiles(X, W0, W1, rows, cols, m_ok, n_ok, K, stride_xm, stride_w0, stride_w1, PAIR: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """`x @ W0[cols].T` and, with `PAIR`, `x @ W1[cols].T`, in one pass over the K tiles: each x tile is loaded
    once for both products (gate and up), and the chain of dependent loads is as long as for one."""
    acc0 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = n_ok[None, :] & k_ok[:, None]
        w0 = tl.load(W0 + cols[None, :] * stride_w0 + k[:, None], mask=w_ok, other=0.0)
        acc0 += tl.dot(x, w0.to(x.dtype), input_precision=PRECISION)
        if PAIR:
            w1 = tl.load(W1 + cols[None, :] * stride_w1 + k[:, None], mask=w_ok, other=0.0)
            acc1 += tl.dot(x, w1.to(x.dtype), input_precision=PRECISION)
    return acc0, acc1


@triton.jit
def _row_scale(SumSq, rows, m_ok, K, eps, stride_sm, parts, BLOCK_P: tl.constexpr):
    """`rsqrt(mean(x^2) + eps)` per row, from the partial sums of squares `SumSq[row, :parts]` its producer wrote."""
    p = tl.arange(0, BLOCK_P)
    partial = tl.load(SumSq + rows[:, None] * stride_sm + p[None, :], mask=m_ok[:, None] & (p < parts)[None, :],
                      other=0.0)
    return tl.rsqrt(tl.sum(partial, axis=1) / K + eps)


@triton.jit
def _grouped_linear(
    X, W0, W1, W2, B0, B1, B2, Res, Out, SumSqIn, NormW, Scaled, SumSqOut, M, K, N0, N1, N2, eps, parts_in,
    stride_xm, stride_w0, stride_w1, stride_w2, stride_rm, stride_om, stride_si, stride_sc, stride_so,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
    ROW_SCALE: tl.constexpr, NORM_OUT: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr, EARLY_TRIGGER: tl.constexpr, PREFETCH: tl.constexpr, K_LINES: tl.constexpr,
):
    n_start = tl.program_id(0) * BLOCK_N  # in the concatenated output (gated: in the gate's columns)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rows < M
    out_cols = n_start + tl.arange(0, BLOCK_N)
    # Which weight this tile reads: segments are multiples of BLOCK_N, so a tile never straddles two (gated: the
    # gate's, and W1 the up weight beside it).
    if n_start < N0:
        W, B, stride_w, start, size = W0, B0, stride_w0, 0 * N0, N0
    elif n_start < N0 + N1:
        W, B, stride_w, start, size = W1, B1, stride_w1, N0, N1
    else:
        W, B, stride_w, start, size = W2, B2, stride_w2, N0 + N1, N2
    cols = out_cols - start
    n_ok = cols < size
    if PREFETCH:  # the weights are no earlier kernel's output: L2 fetches them while the kernel before still runs
        prefetch_rows(W, cols, n_ok, stride_w, K, K_LINES, tl.program_id(1), tl.num_programs(1))
        if GATED:
            prefetch_rows(W1, cols, n_ok, stride_w1, K, K_LINES, tl.program_id(1), tl.num_programs(1))
    wait_for_inputs(USE_GDC, EARLY_TRIGGER)  # the input is the previous kernel's output
    # The epilogue's operands are asked for before the main loop, so that their latency hides behind it: read after
    # it, each was one more memory round trip on the critical path of a draft layer's chain of launches.
    ok = m_ok[:, None] & n_ok[None, :]
    if ROW_SCALE:  # the input was `x * norm_weight`: the RMSNorm's per-row factor scales the products
        scale = _row_scale(SumSqIn, rows, m_ok, K, eps, stride_si, parts_in, BLOCK_P)[:, None]
    if HAS_BIAS and not GATED:
        bias = tl.load(B + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL and not GATED:
        residual = tl.load(Res + rows[:, None] * stride_rm + out_cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if NORM_OUT:
        norm_weight = tl.load(NormW + out_cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        gate, up = _tiles(X, W0, W1, rows, cols, m_ok, n_ok, K, stride_xm, stride_w0, stride_w1, True, BLOCK_M,
                          BLOCK_N, BLOCK_K, PRECISION)
        release_dependents(USE_GDC, EARLY_TRIGGER)
        if ROW_SCALE:
            gate, up = gate * scale, up * scale
        result = _activate(gate, ACT) * up
    else:
        result, _ = _tiles(X, W, W, rows, cols, m_ok, n_ok, K, stride_xm, stride_w, stride_w, False, BLOCK_M,
                           BLOCK_N, BLOCK_K, PRECISION)
        release_dependents(USE_GDC, EARLY_TRIGGER)
        if ROW_SCALE:  # (before the bias, as the gated products are scaled before their activation)
            result *= scale
        if HAS_BIAS:
            result += bias
        if HAS_RESIDUAL:  # one rounding of the fp32 sum, as cuBLAS' addmm (beta = 1) rounds
            result += residual
    out = result.to(Out.dtype.element_ty)
    tl.store(Out + rows[:, None] * stride_om + out_cols[None, :], out, mask=ok)
    if NORM_OUT:  # for the next RMSNorm: this block's sum of squares of each rounded row, and the row times its weight
        rounded = tl.where(ok, out.to(tl.float32), 0.0)
        tl.store(SumSqOut + rows * stride_so + tl.program_id(0), tl.sum(rounded * rounded, axis=1), mask=m_ok)
        tl.store(Scaled + rows[:, None] * stride_sc + out_cols[None, :],
                 (rounded * norm_weight).to(Scaled.dtype.element_ty), mask=ok)


def _column_block(setting: dict, sizes: list[int], device: torch.device) -> int:
    # Triton's CPU interpreter (tests) pays per program: there the widest column block that fits, not the GPU's.
    if device.type != "cuda" and INTERPRETER_BLOCK_N:
        return block_n_for(*sizes, widest=INTERPRETER_BLOCK_N)
    return setting["block_n"]


def check_row_sumsq(name: str, row_sumsq, rows: int) -> None:
    """A consumer's `row_sumsq` (`linear_residual_norm`'s partial sums): contiguous fp32 `(rows, P)`, or None."""
    if row_sumsq is not None and (row_sumsq.dim() != 2 or row_sumsq.shape[0] != rows
                                  or row_sumsq.dtype != torch.float32 or row_sumsq.stride(-1) != 1):
        raise ValueError(f"{name}: row_sumsq must be contiguous fp32 ({rows}, P), got {tuple(row_sumsq.shape)} in "
                         f"{row_sumsq.dtype}")


def _launch_linear(kind, x2, weights, biases, out, act=0, residual=None, row_sumsq=None, eps=0.0, norm_out=None):
    """One launch of `_grouped_linear` over 1 to 3 weights (gated: gate and up) into `out` (plus `residual`, rows
    like `out`, for one weight). `row_sumsq` `(M, P)` (gated, or without a residual): the input is
    `x * norm_weight` and these partial sums of squares give the RMSNorm's row factor. `norm_out` `(norm_weight,
    scaled, sumsq)` (with `residual`): also write `out * norm_weight` into `scaled` and each column block's sums of
    squares into `sumsq` `(M, blocks)`."""
    sizes = [w.shape[0] for w in weights]
    setting = launch_setting(kind, x2.shape[0], sizes, x2.element_size(), x2.shape[1])
    block_n = _column_block(setting, sizes, x2.device)
    gated = kind == "gated"
    out_cols = sizes[0] if gated else sum(sizes)
    padded = weights + [weights[0]] * (3 - len(weights))
    has_bias = biases is not None and biases[0] is not None
    bias = (list(biases) if has_bias else [x2] * len(weights)) + [x2] * (3 - len(weights))
    norm_weight, scaled, sumsq_out = norm_out if norm_out is not None else (x2, out, None)
    sumsq_in = row_sumsq if row_sumsq is not None else out
    _grouped_linear[(triton.cdiv(out_cols, block_n), triton.cdiv(x2.shape[0], setting["block_m"]))](
        x2, *padded, *bias, out if residual is None else residual, out, sumsq_in, norm_weight, scaled,
        out if sumsq_out is None else sumsq_out,
        x2.shape[0], x2.shape[1], *(sizes + [0] * (3 - len(sizes))), float(eps),
        1 if row_sumsq is None else row_sumsq.shape[1], x2.stride(0), *(w.stride(0) for w in padded),
        out.stride(0) if residual is None else residual.stride(0), out.stride(0), sumsq_in.stride(0),
        scaled.stride(0), out.stride(0) if sumsq_out is None else sumsq_out.stride(0),
        HAS_BIAS=has_bias, HAS_RESIDUAL=residual is not None, GATED=gated, ACT=act, ROW_SCALE=row_sumsq is not None,
        NORM_OUT=norm_out is not None,
        BLOCK_P=max(2, triton.next_power_of_2(1 if row_sumsq is None else row_sumsq.shape[1])),
        BLOCK_M=setting["block_m"], BLOCK_N=block_n, BLOCK_K=setting["block_k"],
        PRECISION=_launch.dot_precision(x2.dtype), USE_GDC=_launch.pdl(x2.device),
        EARLY_TRIGGER=_launch.pdl_option(x2.device, "early_trigger"),
        PREFETCH=_launch.prefetch_weights(x2.device, weights),
        K_LINES=lines(x2.shape[1], weights[0].element_size()),
        num_warps=setting["num_warps"], num_stages=setting["num_stages"], **_launch.pdl_launch(x2.device),
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def grouped_linear(x: torch.Tensor, weights, biases=None, row_sumsq=None, eps: float = 0.0) -> torch.Tensor:
    """`cat([x @ w.T (+ b) for w, b in zip(weights, biases)], -1)` for 1 to 3 weights `(N_i, K)`. `x` `(..., K)`.
    With `row_sumsq`, the products are of the RMSNorm whose input times its weight `x` is (`gated_linear` explains),
    scaled before the biases."""
    weights = list(weights)
    sizes = [w.shape[0] for w in weights]
    if block_n_for(*sizes) is None or not 1 <= len(weights) <= 3:
        raise ValueError(f"grouped_linear: 1 to 3 weights whose sizes share a block of 16, got {sizes}")
    x2 = _rows(x)
    check_row_sumsq("grouped_linear", row_sumsq, x2.shape[0])
    out = _launch.empty(x2.shape[0], sum(sizes), dtype=x.dtype, device=x.device)
    _launch_linear("qkv" if len(weights) > 1 else "linear", x2, weights, biases, out, row_sumsq=row_sumsq, eps=eps)
    return out.reshape(*x.shape[:-1], sum(sizes))


def gated_linear(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, act: str, row_sumsq=None,
                 eps: float = 0.0) -> torch.Tensor:
    """`act(x @ w_gate.T) * (x @ w_up.T)`, `act` in "silu", "gelu_tanh". `x` `(..., K)`, weights `(N, K)`.

    With `row_sumsq` `(rows, P)` (`linear_residual_norm`'s partial sums of squares of each row of the norm's input
    `h`, with `x = h * norm_weight`), both products are of `rms_norm(h, norm_weight, eps)`: scaled per row by
    `rsqrt(row_sumsq.sum(-1) / K + eps)` before the activation, so no norm launch comes between."""
    if act not in ACTIVATIONS:
        raise ValueError(f"gated_linear: act must be one of {list(ACTIVATIONS)}, got {act!r}")
    size = w_gate.shape[0]
    if block_n_for(size) is None or w_up.shape[0] != size:
        raise ValueError(
            f"gated_linear: gate and up must have one size, a multiple of 16; got {size}, {w_up.shape[0]}"
        )
    x2 = _rows(x)
    check_row_sumsq("gated_linear", row_sumsq, x2.shape[0])
    out = _launch.empty(x2.shape[0], size, dtype=x.dtype, device=x.device)
    _launch_linear("gated", x2, [w_gate, w_up], None, out, act=ACTIVATIONS[act], row_sumsq=row_sumsq, eps=eps)
    return out.reshape(*x.shape[:-1], size)


def _check_residual(name: str, x: torch.Tensor, size: int, residual: torch.Tensor) -> None:
    if residual.shape != (*x.shape[:-1], size) or residual.dtype != x.dtype:
        raise ValueError(f"{name}: residual must be {(*x.shape[:-1], size)} in {x.dtype}, got "
                         f"{tuple(residual.shape)} in {residual.dtype}")


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`residual + x @ weight.T` as a new tensor, rounded once. `x` `(..., K)`, `weight` `(N, K)`, `residual`
    `(..., N)` in `x`'s dtype. An output size that no block of 16 divides runs as `torch.addmm` (the same sum)."""
    size = weight.shape[0]
    _check_residual("linear_residual", x, size, residual)
    x2, res2 = _rows(x), _rows(residual)
    if block_n_for(size) is None:
        return torch.addmm(res2, x2, weight.t()).reshape(residual.shape)
    out = _launch.empty(x2.shape[0], size, dtype=x.dtype, device=x.device)
    _launch_linear("linear", x2, [weight], None, out, residual=res2)
    return out.reshape(residual.shape)


def norm_partials(rows: int, size: int, x: torch.Tensor) -> int:
    """Partial sums of squares per row that `linear_residual_norm` writes for `rows` outputs of `size` from `x`'s
    dtype, width and device: one per column block (of the launch setting those choose)."""
    setting = launch_setting("linear", rows, [size], x.element_size(), x.shape[-1])
    return triton.cdiv(size, _column_block(setting, [size], x.device))
