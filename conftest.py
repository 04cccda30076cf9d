"""Test set-up shared by hf_vegas' tests (`tests/`) and its kernels' (`kernels/tests/`)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # No GPU: the Triton kernels run in Triton's CPU interpreter. The switch is read when a kernel module is imported
    # (at `triton.jit`), so it is set here, before any test imports one.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker gets its share of the cores: torch's default, one thread per core in every worker,
# oversubscribes them.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
