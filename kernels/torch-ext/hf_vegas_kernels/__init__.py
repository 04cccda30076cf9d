"""hf_vegas_kernels: the ops of hf_vegas, each in plain PyTorch (`naive`, the contract) and in Triton beside it (sparse
draft attention, verification attention with fused Collect-2-Query logits, top-k selection, top-p filtering, the
draft token's race, the cache write, one-launch decode projections, RMSNorm, and for fused layers the q/k/v
projection with its rotary embedding and cache write, the output projections with their residual and the next
RMSNorm's input, and under two-rank tensor parallelism the sum over the ranks with the RMSNorm after it). Each
Triton op takes its naive op's signature, but `linear_residual_norm_into`, the launch of `linear_residual_norm` into
buffers it is given, and `exchange_sum_norm`, `all_reduce_norm` through buffers registered by name (`exchanges.py`);
those a model forward calls are `torch.library` custom ops (`ops.py`, `linear_ops.py`), which `torch.compile` traces
through.

`import hf_vegas_kernels` and `naive` need only torch: the Triton modules load on first use of one of their ops
(`hf_vegas_kernels.dense_attention`), so a machine without Triton still has the contract, and a broken Triton install
surfaces where a Triton op is asked for, with its own error. That holds for every way of asking: without Triton,
`hasattr`, `getattr` with a default and `from hf_vegas_kernels import *` raise the ImportError too, as the op names
are listed (`__all__`, `dir`) but cannot load.

Installed with hf_vegas under this name, never as a top-level `kernels` module (that name is HF's `kernels` library).
"""

import importlib

from . import naive

# Each Triton op and the module of this package that defines it.
_TRITON_OPS = {
    **dict.fromkeys(("gated_linear", "grouped_linear", "linear_residual"), "linear"),
    **dict.fromkeys(("gated_linear_op", "linear_op", "linear_residual_op", "linear_residual_norm",
                     "linear_residual_norm_into", "qkv_linear"), "linear_ops"),
    **dict.fromkeys(("dense_attention", "exchange_sum_norm", "finalize_scores", "qkv_rope_write", "rms_norm",
                     "rope_write_kv", "select_topk", "sparse_draft_attention", "verify_attention", "write_kv"), "ops"),
    "race_argmax": "race",
    "all_reduce_norm": "two_rank_sum",
    "top_p_filter": "top_p",
}
TRITON_OPS = tuple(sorted(_TRITON_OPS))

__all__ = ["TRITON_OPS", "load_triton_ops", "naive", *TRITON_OPS]


def load_triton_ops() -> None:
    """Import every Triton module now (registering their `torch.library` ops, and binding the modules as attributes);
    raises what a failing import raises. An op already bound, or replaced (a test's spy), stays as it is."""
    for module in sorted(set(_TRITON_OPS.values())):  # bound here too: an import's binding happens only once
        globals().setdefault(module, importlib.import_module(f".{module}", __name__))
    for name in TRITON_OPS:
        if name not in globals():
            __getattr__(name)


def __getattr__(name: str):
    """A Triton op, importing its module (and Triton) the first time one is asked for."""
    if name not in _TRITON_OPS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    op = getattr(importlib.import_module(f".{_TRITON_OPS[name]}", __name__), name)
    globals()[name] = op
    return op


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
