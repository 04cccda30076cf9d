"""On the CPU, a generation's linear layers over a few rows run as `(W @ x^T)^T`: the same products, with the weights
as the BLAS call's left operand.

`F.linear(x, W)` over a handful of rows (a draft or decode step is `batch` rows, a verification `batch x (gamma + 1)`)
hands BLAS a shape it runs far from the speed of reading the weights; the transposed product reads the same weights
in a shape it runs well. A single row is computed as two (the row twice): one row would go to BLAS's matrix-vector
routine, which ran 2-3x slower than the two-row product. Measured on a 2-core AMD EPYC, torch 2.13 (MKL), fp32,
SmolLM2-135M's 211 linears (`python benchmarks/cpu_linears.py`): see its records; at 7 rows 58.4 -> 43.6 ms and the
lm_head alone 23.4 -> 6.6 ms. From about 28 rows on the two are even, so longer inputs (prefills) keep `F.linear`.
Other CPUs and BLAS builds may rank the shapes differently: the benchmark measures both. The sums are the same
products added in another order: the logits may differ in the last bits, as they already do between vanilla's
one-row steps and a verification's seven rows.

Like `fused_projections`, the model is changed only by instance-level `forward` attributes, removed when the block
exits (also on an exception); quantised or hooked layers, other dtypes and autocast keep their own forward.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

# Rows (tokens x batch) up to which a linear runs with the weights on the left.
MAX_ROWS = 16


def _weights_left(module: nn.Linear):
    weight, bias = module.weight, module.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not 0 < rows <= MAX_ROWS or x.dtype != weight.dtype or torch.is_autocast_enabled("cpu"):
            return nn.functional.linear(x, weight, bias)
        flat = x.reshape(rows, x.shape[-1])
        if rows == 1:  # one row would take BLAS's matrix-vector path, 2-3x slower here than a product of two rows
            out = torch.mm(weight, flat.repeat(2, 1).t())[:, :1].t()  # a real copy: BLAS cannot read a 0 stride
        else:
            out = torch.mm(weight, flat.t()).t()
        # Contiguous like `F.linear`'s output: models view it as they would (DeepSeek-V2's complex RoPE needs it).
        out = out.contiguous()
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.shape[0])

    return forward


def _eligible(module: nn.Module) -> bool:
    return (type(module) is nn.Linear and not module._forward_hooks and not module._forward_pre_hooks
            and "forward" not in vars(module) and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.float32 and module.weight.is_contiguous())


@contextlib.contextmanager
def weights_left_linears(model, enabled: bool = True):
    """Run `model`'s plain fp32 CPU linear layers as `(W @ x^T)^T` on inputs of at most `MAX_ROWS` rows inside the
    block (a no-op when not `enabled`). Yields the number of layers changed."""
    patched = [m for m in model.modules() if _eligible(m)] if enabled else []
    try:
        for module in patched:
            module.forward = _weights_left(module)
        yield len(patched)
    finally:
        for module in patched:
            vars(module).pop("forward", None)
