"""Llama's RMSNorm in one launch, for a fused layer (`hf_vegas.fused_layers`): the first layer's input norm, and
every norm where they cannot ride in the projections (fp16, or a hidden size no block of 16 divides).

Uncompiled, the model's own RMSNorm is six small PyTorch kernels (compiled, one inductor kernel). Elsewhere a fused
layer's norms ride in the projections around them (`linear_ops.linear_residual_norm`: the projection before writes the
norm's input times its weight and the sums of squares, the one after scales its products per row). Folding the whole
norm into the projection after it was measured slower on an H100 (SmolLM2 draft step, 64 rows: the q/k/v and gate/up
launches went from 4.3 to 11.7 us each, as the input tile, scaled in registers, no longer streams into the product).
One program normalises `BLOCK_M` rows in fp32 and rounds once. Semantics: `naive.rms_norm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch


@triton.jit
def _rms_norm(X, W, Out, M, K, eps, stride_xm, stride_om, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
              USE_GDC: tl.constexpr):
    if USE_GDC:  # programmatic dependent launch (`_launch.pdl`): the input is the previous kernel's output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    ok = (rows < M)[:, None] & (k < K)[None, :]
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + k[None, :], mask=ok, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=1) / K + eps)
    w = tl.load(W + k, mask=k < K, other=0.0).to(tl.float32)
    out = x * scale[:, None] * w[None, :]
    tl.store(Out + rows[:, None].to(tl.int64) * stride_om + k[None, :], out.to(Out.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x * rsqrt(mean(x^2) + eps)` over the last dimension of `x` `(..., K)`, `weight` `(K,)`."""
    if weight.shape != (x.shape[-1],) or weight.stride(-1) != 1:
        raise ValueError(f"rms_norm: weight must be a contiguous ({x.shape[-1]},) vector, got {tuple(weight.shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    rows, width = x2.shape
    out = _launch.empty(rows, width, dtype=x.dtype, device=x.device)
    block_k = triton.next_power_of_2(width)
    block_m = max(1, min(16, 4096 // block_k))  # a few rows per program, a bounded tile
    _rms_norm[(triton.cdiv(rows, block_m),)](
        x2, weight, out, rows, width, float(eps), x2.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_K=block_k,
        USE_GDC=_launch.pdl(x.device), num_warps=4, **_launch.pdl_launch(x.device),
    )
    return out.reshape(x.shape)
