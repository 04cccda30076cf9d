"""Which ops run the attention: the plain-PyTorch ops (`hf_vegas_kernels.naive`), the CPU path (`eager`), or the Triton
kernels (`hf_vegas_kernels`).

All three are modules with the same ops under the same signatures (`naive` defines them): `dense_attention`,
`sparse_draft_attention`, `verify_attention` (dense attention that emits the scored rows' logits),
`finalize_scores` (emitted logits to Collect-2-Query scores), `select_topk` and `write_kv`. Callers pick a module
once (`hf_vegas.cache.VegasCache.ops`) and never branch on which it is.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from ..config import BACKENDS


@functools.cache
def _kernels_or_reason():
    """`(module, None)` when the Triton kernels import, else `(None, why)`. The package itself needs only torch; its
    Triton ops load on first use, so all of them are loaded here, once."""
    try:
        module = importlib.import_module("hf_vegas_kernels")
        module.load_triton_ops()
        return module, None
    except Exception as error:  # noqa: BLE001  (no Triton on this platform, or an install that fails to import)
        return None, f"{type(error).__name__}: {error}"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """`"torch"` or `"triton"` for a model on `device` in `dtype`; raises before any forward if `"triton"` cannot run
    there.

    `"auto"` picks the kernels on CUDA when Triton imports, the plain-PyTorch ops elsewhere. On the CPU the kernels
    run only in Triton's interpreter (`TRITON_INTERPRET=1`, set before the first import), which is for tests, in fp32
    or fp16: its bf16 products are wrong (a 16x16 bf16 `tl.dot` was off by 2e10 under Triton 3.9).
    """
    if requested not in BACKENDS:
        raise ValueError(f"`vegas_backend` must be one of {list(BACKENDS)}, got {requested!r}.")
    if requested == "torch":
        return "torch"
    device = torch.device(device)
    if requested == "auto":
        return "triton" if device.type == "cuda" and _kernels_or_reason()[0] is not None else "torch"
    module, reason = _kernels_or_reason()
    if module is None:
        raise ValueError(
            f"`vegas_backend='triton'` needs Triton and hf_vegas_kernels ({reason}); use 'torch' or 'auto'."
        )
    if device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"`vegas_backend='triton'` needs the model on a CUDA device, got {device}. On the CPU the kernels run "
            "only in Triton's interpreter (TRITON_INTERPRET=1, for tests); use 'torch' or 'auto'."
        )
    if device.type != "cuda" and dtype == torch.bfloat16:
        raise ValueError(
            "`vegas_backend='triton'` under TRITON_INTERPRET=1 cannot run a bfloat16 model: Triton's interpreter "
            "computes bf16 products wrongly. Use float32/float16, or 'torch' or 'auto'."
        )
    return "triton"


def kernels():
    """The `hf_vegas_kernels` module (after `resolve_backend` returned "triton")."""
    module, reason = _kernels_or_reason()
    if module is None:
        raise RuntimeError(f"hf_vegas_kernels is not importable: {reason}")
    return module
