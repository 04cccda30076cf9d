"""On the CPU, a generation's linear layers over a few rows run as `(W @ x^T)^T`: the same products, with the weights
as the BLAS call's left operand.

`F.linear(x, W)` over a handful of rows (a draft or decode step is `batch` rows, a verification `batch x (gamma + 1)`)
hands BLAS a shape it runs far from the speed of reading the weights; the transposed product reads the same weights
in a shape it runs well. Measured on a 2-core AMD EPYC, torch 2.13 (MKL), fp32, SmolLM2-135M's 211 linears
(`python benchmarks/cpu_linears.py`): 7 rows 58.4 -> 43.6 ms, 4 rows 53.8 -> 22.3 ms, 1 row 43.1 -> 35.8 ms; its
lm_head alone over 7 rows 23.4 -> 6.6 ms. From about 28 rows on the two are even, so longer inputs (prefills) keep
`F.linear`. The sums are the same products added in another order: the logits may differ in the last bits, as they
already do between vanilla's one-row steps and a verification's seven rows.

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
        # Contiguous like `F.linear`'s output: models view it as they would (DeepSeek-V2's complex RoPE needs it).
        out = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()
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
