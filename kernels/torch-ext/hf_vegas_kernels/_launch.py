"""Launch parameters that depend on the device, not on the op."""

from __future__ import annotations

import functools

import torch

# Launch parameters of the attention kernel, per kind of call, chosen on an H100 with `benchmarks/kernel_bandwidth.py --sweep`
# (results in benchmarks/results/kernels_sweep.jsonl). `waves`: programs per SM the splits aim for. Verification
# (several query tokens) with head_dim 128 and at least 32 (row, KV head) pairs wanted many more splits (Qwen3-8B,
# batch 4 x 32K: 212 us at 8 waves, 258 us at 2), but not at batch 1 (1 x 128K: 196 us at 2 waves, 217 us at 8),
# and head_dim 64 fewer (SmolLM2, batch 64 x 8K: 161 us at 2 waves, 189 us at 8). The benchmark overrides these
# to sweep; nothing else should.
TUNING = {
    "sparse": {"block_n": 64, "num_warps": 4, "num_stages": 2, "waves": 4},
    "dense": {"block_n": 64, "num_warps": 4, "num_stages": 3, "waves": 2},
    "verify": {"block_n": 64, "num_warps": 4, "num_stages": 3, "waves": 2},
    "verify_wide_head": {"block_n": 64, "num_warps": 4, "num_stages": 3, "waves": 8},
}

# Under TRITON_INTERPRET=1 on the CPU there are no SMs; split as if a small GPU, so split-K paths are exercised.
_CPU_PROGRAMS = 4


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return _CPU_PROGRAMS


def empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a kernel writes comes from here, so tests can poison them all (NaN) through one name."""
    return torch.empty(*shape, dtype=dtype, device=device)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (the CPU reference's precision); half types use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"
