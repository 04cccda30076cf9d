"""Projections of a decode step in one launch each: q/k/v together, and gate/up with the activation and product.

At a decode step's few rows (a draft: one token per row) a projection reads a few hundred kilobytes of weights and
takes a cuBLAS launch of ~3-4 us on an H100, most of it latency: SmolLM2's seven projections per layer are 40 % of
its draft step. These kernels read the separate weight matrices of one layer in a single launch (no fused copy of the
weights is made, so the model is untouched and no memory is added):

- `grouped_linear(x, (w0, w1, w2), biases)` = `cat([x @ w0.T + b0, x @ w1.T + b1, x @ w2.T + b2], -1)`;
- `gated_linear(x, w_gate, w_up, act)` = `act(x @ w_gate.T) * (x @ w_up.T)`, `act` "silu" or "gelu_tanh";
- `linear_residual(x, w, residual)` = `residual + x @ w.T`, the residual read in the epilogue.

A single small projection in one such launch is no faster than cuBLAS (SmolLM2's output and down projections at 64
rows took 3.3 and 5.0 us against cuBLAS' 3.6 and 5.0, `benchmarks/projections.py --sweep`). With the residual it is:
a compiled draft layer's `torch.addmm(residual, ...)` is a copy of the residual into the output (a `memcpy` launch
of ~1.2 us) before the GEMM, twice per layer (the in-place `addmm_` is functionalised into the same pair), where
`linear_residual` is one launch.

A program owns `BLOCK_M` rows and `BLOCK_N` output columns that all lie in one weight (segment sizes are multiples
of `BLOCK_N`), and accumulates in fp32. Block sizes, warps and stages per op: `_launch.LINEAR_TUNING`.
Semantics: `naive.grouped_linear` / `gated_linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch

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
def _tile(X, W, rows, cols, m_ok, n_ok, K, stride_xm, stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + cols[None, :] * stride_wn + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    return acc


@triton.jit
def _grouped_linear(
    X, W0, W1, W2, B0, B1, B2, Res, Out, M, K, N0, N1, N2,
    stride_xm, stride_w0, stride_w1, stride_w2, stride_rm, stride_om,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    if USE_GDC:  # programmatic dependent launch (`_launch.pdl`): the input is the previous kernel's output
        tl.extra.cuda.gdc_wait()
    n_start = tl.program_id(0) * BLOCK_N  # in the concatenated output (gated: in the gate's columns)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rows < M
    out_cols = n_start + tl.arange(0, BLOCK_N)
    if GATED:
        n_ok = out_cols < N0
        gate = _tile(X, W0, rows, out_cols, m_ok, n_ok, K, stride_xm, stride_w0, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        up = _tile(X, W1, rows, out_cols, m_ok, n_ok, K, stride_xm, stride_w1, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        if USE_GDC:
            tl.extra.cuda.gdc_launch_dependents()
        result = _activate(gate, ACT) * up
    else:
        # Which weight this tile reads: segments are multiples of BLOCK_N, so a tile never straddles two.
        if n_start < N0:
            W, B, stride_w, start, size = W0, B0, stride_w0, 0 * N0, N0
        elif n_start < N0 + N1:
            W, B, stride_w, start, size = W1, B1, stride_w1, N0, N1
        else:
            W, B, stride_w, start, size = W2, B2, stride_w2, N0 + N1, N2
        cols = out_cols - start
        n_ok = cols < size
        result = _tile(X, W, rows, cols, m_ok, n_ok, K, stride_xm, stride_w, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        if USE_GDC:
            tl.extra.cuda.gdc_launch_dependents()
        if HAS_BIAS:
            result += tl.load(B + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_RESIDUAL:  # one rounding of the fp32 sum, as cuBLAS' addmm (beta = 1) rounds
            result += tl.load(Res + rows[:, None] * stride_rm + out_cols[None, :], mask=m_ok[:, None] & n_ok[None, :],
                              other=0.0).to(tl.float32)
    tl.store(Out + rows[:, None] * stride_om + out_cols[None, :], result.to(Out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def block_n_for(*sizes: int, widest: int = 64) -> int | None:
    """The widest column block (at most `widest`) that divides every segment, or None (the projections then stay
    separate)."""
    for block in (128, 64, 32, 16):
        if block <= widest and all(size % block == 0 for size in sizes):
            return block
    return None


def _setting(kind: str, rows: int, sizes: list[int], element_bytes: int) -> dict:
    """Launch parameters of `kind` ("qkv", "gated", "linear") for `rows` rows and output segments of `sizes`, from
    `_launch.LINEAR_TUNING`."""
    setting = dict(_launch.LINEAR_TUNING[kind if rows <= _launch.LINEAR_TUNED_ROWS else "generic"])
    # No wider row block than the rows need (a draft of 4 sequences computes a 16-row tile, not 64).
    setting["block_m"] = min(setting["block_m"], max(16, triton.next_power_of_2(rows)))
    setting["block_n"] = block_n_for(*sizes, widest=setting["block_n"])

    def shared_bytes():  # x and weight tiles per pipeline stage, twice for gate and up
        tile = (setting["block_m"] + setting["block_n"]) * setting["block_k"] * element_bytes
        return setting["num_stages"] * tile * (2 if kind == "gated" else 1)

    while shared_bytes() > _launch.LINEAR_SHARED_BYTES and setting["num_stages"] > 1:
        setting["num_stages"] -= 1
    while shared_bytes() > _launch.LINEAR_SHARED_BYTES and setting["block_k"] > 16:
        setting["block_k"] //= 2
    return setting


def _launch_linear(kind, x2, weights, biases, out, act=0, residual=None):
    """One launch of `_grouped_linear` over 1 to 3 weights (gated: gate and up) into `out` (plus `residual`, rows
    like `out`, for one weight)."""
    sizes = [w.shape[0] for w in weights]
    setting = _setting(kind, x2.shape[0], sizes, x2.element_size())
    # Triton's CPU interpreter (tests) pays per program: there the widest column block that fits, not the GPU's.
    interpreted = x2.device.type != "cuda" and INTERPRETER_BLOCK_N
    block_n = block_n_for(*sizes, widest=INTERPRETER_BLOCK_N) if interpreted else setting["block_n"]
    gated = kind == "gated"
    out_cols = sizes[0] if gated else sum(sizes)
    padded = weights + [weights[0]] * (3 - len(weights))
    has_bias = biases is not None and biases[0] is not None
    bias = (list(biases) if has_bias else [x2] * len(weights)) + [x2] * (3 - len(weights))
    _grouped_linear[(triton.cdiv(out_cols, block_n), triton.cdiv(x2.shape[0], setting["block_m"]))](
        x2, *padded, *bias, out if residual is None else residual, out, x2.shape[0], x2.shape[1],
        *(sizes + [0] * (3 - len(sizes))), x2.stride(0), *(w.stride(0) for w in padded),
        out.stride(0) if residual is None else residual.stride(0), out.stride(0),
        HAS_BIAS=has_bias, HAS_RESIDUAL=residual is not None, GATED=gated, ACT=act, BLOCK_M=setting["block_m"],
        BLOCK_N=block_n, BLOCK_K=setting["block_k"], PRECISION=_launch.dot_precision(x2.dtype),
        USE_GDC=_launch.pdl(x2.device), num_warps=setting["num_warps"], num_stages=setting["num_stages"],
        **_launch.pdl_launch(x2.device),
    )
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def grouped_linear(x: torch.Tensor, weights, biases=None) -> torch.Tensor:
    """`cat([x @ w.T (+ b) for w, b in zip(weights, biases)], -1)` for 1 to 3 weights `(N_i, K)`. `x` `(..., K)`."""
    weights = list(weights)
    sizes = [w.shape[0] for w in weights]
    if block_n_for(*sizes) is None or not 1 <= len(weights) <= 3:
        raise ValueError(f"grouped_linear: 1 to 3 weights whose sizes share a block of 16, got {sizes}")
    x2 = _rows(x)
    out = _launch.empty(x2.shape[0], sum(sizes), dtype=x.dtype, device=x.device)
    _launch_linear("qkv" if len(weights) > 1 else "linear", x2, weights, biases, out)
    return out.reshape(*x.shape[:-1], sum(sizes))


def gated_linear(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, act: str) -> torch.Tensor:
    """`act(x @ w_gate.T) * (x @ w_up.T)`, `act` in "silu", "gelu_tanh". `x` `(..., K)`, weights `(N, K)`."""
    if act not in ACTIVATIONS:
        raise ValueError(f"gated_linear: act must be one of {list(ACTIVATIONS)}, got {act!r}")
    size = w_gate.shape[0]
    if block_n_for(size) is None or w_up.shape[0] != size:
        raise ValueError(
            f"gated_linear: gate and up must have one size, a multiple of 16; got {size}, {w_up.shape[0]}"
        )
    x2 = _rows(x)
    out = _launch.empty(x2.shape[0], size, dtype=x.dtype, device=x.device)
    _launch_linear("gated", x2, [w_gate, w_up], None, out, act=ACTIVATIONS[act])
    return out.reshape(*x.shape[:-1], size)


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`residual + x @ weight.T` as a new tensor, rounded once. `x` `(..., K)`, `weight` `(N, K)`, `residual`
    `(..., N)` in `x`'s dtype. An output size that no block of 16 divides runs as `torch.addmm` (the same sum)."""
    size = weight.shape[0]
    if residual.shape != (*x.shape[:-1], size) or residual.dtype != x.dtype:
        raise ValueError(f"linear_residual: residual must be {(*x.shape[:-1], size)} in {x.dtype}, got "
                         f"{tuple(residual.shape)} in {residual.dtype}")
    x2, res2 = _rows(x), _rows(residual)
    if block_n_for(size) is None:
        return torch.addmm(res2, x2, weight.t()).reshape(residual.shape)
    out = _launch.empty(x2.shape[0], size, dtype=x.dtype, device=x.device)
    _launch_linear("linear", x2, [weight], None, out, residual=res2)
    return out.reshape(residual.shape)


# As `torch.library` ops with shape-only fakes, so `torch.compile` (`vegas_compile`) traces a step's forward through
# them instead of breaking its graph at every projection.
@torch.library.custom_op("hf_vegas::qkv_linear", mutates_args=())
def qkv_linear(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b0: torch.Tensor | None,
               b1: torch.Tensor | None, b2: torch.Tensor | None) -> torch.Tensor:
    """`grouped_linear(x, (w0, w1, w2), (b0, b1, b2))` as one op."""
    return grouped_linear(x, (w0, w1, w2), None if b0 is None else (b0, b1, b2))


@qkv_linear.register_fake
def _(x, w0, w1, w2, b0, b1, b2):
    return x.new_empty(*x.shape[:-1], w0.shape[0] + w1.shape[0] + w2.shape[0])


@torch.library.custom_op("hf_vegas::gated_linear", mutates_args=())
def gated_linear_op(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, act: str) -> torch.Tensor:
    """`gated_linear` as one op."""
    return gated_linear(x, w_gate, w_up, act)


@gated_linear_op.register_fake
def _(x, w_gate, w_up, act):
    return x.new_empty(*x.shape[:-1], w_gate.shape[0])


@torch.library.custom_op("hf_vegas::linear_residual", mutates_args=())
def linear_residual_op(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`linear_residual` as one op."""
    return linear_residual(x, weight, residual)


@linear_residual_op.register_fake
def _(x, weight, residual):
    return residual.new_empty(residual.shape)
