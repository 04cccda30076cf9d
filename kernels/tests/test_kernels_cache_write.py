"""Triton cache write (keys and values of a forward's tokens, one launch) against the reference `index_put`."""

import pytest
import torch

from hf_vegas_kernels import naive
from kernel_cases import DEVICE, import_kernels

kernels = import_kernels()


@pytest.mark.parametrize("heads, head_dim, v_dim, tokens", [(3, 64, 64, 1), (1, 80, 48, 7), (5, 16, 16, 13)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_write_kv_matches_reference(heads, head_dim, v_dim, tokens, cache_dtype):
    gen = torch.Generator().manual_seed(heads * 100 + tokens)
    batch, slots = 3, 41
    # The model's K/V arrive as transposed views (B, H, T, D) of (B, T, H, D) projections.
    key = torch.randn(batch, tokens, heads, head_dim, generator=gen).transpose(1, 2).to(DEVICE)
    value = torch.randn(batch, tokens, heads, v_dim, generator=gen).transpose(1, 2).to(DEVICE)
    # Distinct slots per row, the last one the scratch slot where left pads of a prefill go.
    write = torch.stack([torch.randperm(slots - 1, generator=gen)[:tokens] for _ in range(batch)])
    write[0, 0] = slots - 1
    write = write.to(DEVICE)
    # NaN everywhere first: every slot the write leaves alone must stay NaN, every written one must be exact.
    caches = [torch.full((batch, slots, heads, d), float("nan"), dtype=cache_dtype, device=DEVICE)
              for d in (head_dim, v_dim)]
    expected = [c.clone() for c in caches]
    kernels.write_kv(*caches, key, value, write)
    naive.write_kv(*expected, key, value, write)
    for got, want in zip(caches, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert not caches[0][torch.arange(batch)[:, None], write.cpu()].isnan().any()
