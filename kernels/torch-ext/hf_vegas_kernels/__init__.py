"""hf_vegas_kernels: the Triton kernels of hf_vegas (sparse draft attention, verification attention with fused
Collect-2-Query logits, top-k selection, top-p filtering, the cache write, one-launch decode projections, RMSNorm,
and for fused draft layers the q/k/v projection with its rotary embedding and cache write, and the output projections
with their residual). Each one reproduces an op of `hf_vegas.ops.reference`, with its signature; the ops a model
forward calls are `torch.library` custom ops (`ops.py`), which `torch.compile` traces through.

Installed with hf_vegas under this name, never as a top-level `kernels` module (that name is HF's `kernels` library).
"""

from .linear import gated_linear, gated_linear_op, grouped_linear, linear_residual, linear_residual_op, qkv_linear
from .ops import (dense_attention, finalize_scores, qkv_rope_write, rms_norm, select_topk,
                  sparse_draft_attention, verify_attention, write_kv)
from .race import race_argmax
from .top_p import top_p_filter

__all__ = ["dense_attention", "finalize_scores", "gated_linear", "gated_linear_op", "grouped_linear",
           "linear_residual", "linear_residual_op", "qkv_linear", "qkv_rope_write", "race_argmax", "rms_norm",
           "select_topk", "sparse_draft_attention", "top_p_filter", "verify_attention", "write_kv"]
