"""Fixtures of the kernel tests."""

import pytest
import torch
from kernel_cases import NAN, import_kernels


@pytest.fixture
def poison(monkeypatch):
    """Every buffer the kernels allocate starts as NaN (integers: the most negative value), so an entry a kernel
    forgets to write shows."""
    def nan_empty(*shape, dtype, device):
        return torch.full(shape, NAN if dtype.is_floating_point else torch.iinfo(dtype).min, dtype=dtype,
                          device=device)

    monkeypatch.setattr(import_kernels()._launch, "empty", nan_empty)
