"""Inputs for the kernel-vs-naive tests: ragged rows, odd lengths, caches poisoned where no op may read, and the fp32
tolerance. hf_vegas' own tests (`tests/`) use them too (pytest puts this folder on the path: `pyproject.toml`)."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import pytest
import torch
from hf_vegas_kernels.naive import selected_slots

NAN = float("nan")
# Kernels run on the GPU when there is one, else on the CPU in Triton's interpreter (see the root conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def import_kernels():
    """`hf_vegas_kernels`, or a skip where Triton is not installed. Where it is, a kernel module that fails to import
    fails the tests (a skip would hide a broken kernel behind dozens of quiet skips)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed on this platform", allow_module_level=True)
    kernels = importlib.import_module("hf_vegas_kernels")
    kernels.load_triton_ops()
    return kernels


@dataclass
class Case:
    q: torch.Tensor  # (B, Hq, T, D)
    k: torch.Tensor  # (B, S, Hkv, D), clean
    v: torch.Tensor
    q_slot: torch.Tensor  # (B, T)
    kv_len: torch.Tensor  # (B,)
    sel_idx: torch.Tensor  # (B, k_max); entries past sel_count are junk that must never be read
    sel_count: torch.Tensor
    sel_end: torch.Tensor
    scaling: float


def make_case(lengths, tails, tokens, head_dim, q_heads, kv_heads, slots=None, dtype=torch.float32,
              device=DEVICE, seed=0, sparsity=0.3, v_dim=None) -> Case:
    """Rows of `lengths` cached slots whose last `tails[b]` were written after the selection; `tokens` queries.
    `v_dim`: the values' head dim when it differs from the keys' (latent attention: DeepSeek-V2/V3, MiniCPM3)."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    slots = slots or max(lengths) + 7  # the buffer is longer than any row, as in VegasCache

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    kv_len = torch.tensor(lengths, device=device)
    sel_end = kv_len - torch.tensor(tails, device=device)
    counts = [max(1, int(sparsity * int(e))) for e in sel_end.tolist()]
    k_max = max(counts) + 3
    sel_idx = torch.full((batch, k_max), -(10**6), dtype=torch.long)
    for b, (end, count) in enumerate(zip(sel_end.tolist(), counts)):
        sel_idx[b, :count] = torch.randperm(end, generator=gen)[:count]
    q_slot = kv_len[:, None] - tokens + torch.arange(tokens, device=device)[None, :]
    return Case(
        q=randn(batch, q_heads, tokens, head_dim), k=randn(batch, slots, kv_heads, head_dim),
        v=randn(batch, slots, kv_heads, v_dim or head_dim), q_slot=q_slot, kv_len=kv_len, sel_idx=sel_idx.to(device),
        sel_count=torch.tensor(counts, device=device), sel_end=sel_end, scaling=head_dim**-0.5,
    )


def poisoned(cache: torch.Tensor, readable: torch.Tensor) -> torch.Tensor:
    """A copy of a `(B, S, H, D)` cache with NaN in every slot outside `readable` `(B, S)`."""
    out = cache.clone()
    out[~readable] = NAN
    return out


def dense_readable(case: Case, window: int | None = None) -> torch.Tensor:
    slots = torch.arange(case.k.shape[1], device=case.k.device)[None, :]
    readable = slots < case.kv_len[:, None]
    if window is not None:
        readable &= slots > case.q_slot.min(dim=1).values[:, None] - window
    return readable


def sparse_readable(case: Case) -> torch.Tensor:
    slots = torch.arange(case.k.shape[1], device=case.k.device)[None, :]
    chosen = selected_slots(case.sel_idx.clamp_min(0), case.sel_count, case.k.shape[1])
    return (chosen | (slots >= case.sel_end[:, None])) & (slots < case.kv_len[:, None])


def assert_fp32_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 products summed in another order: equal to a few ulps of the largest magnitude involved."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
