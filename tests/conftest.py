import os

import pytest
import torch

if not torch.cuda.is_available():
    # No GPU: the Triton kernels run in Triton's CPU interpreter. The switch is read when `hf_vegas_kernels` is
    # imported (at `triton.jit`), so it is set here, before any test imports it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker gets its share of the cores: torch's default, one thread per core in every worker,
# oversubscribes them.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))

import hf_vegas  # noqa: F401,E402  (registers the "vegas" attention and short name)
from hf_vegas.real_models import load_gemma3, load_smollm2  # noqa: E402


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


@pytest.fixture
def short_windows_draft(monkeypatch):
    """Tiny models' windows (tens of slots) draft sparsely, as windows longer than `hf_vegas.config.SHORT_WINDOW`
    (1024) do when the budget pays; keeps the tests' prompts short."""
    monkeypatch.setattr(hf_vegas.config, "SHORT_WINDOW", 0)


@pytest.fixture(scope="session")
def smollm2():
    """Real SmolLM2-135M-Instruct in fp32 on the CPU, with its tokenizer."""
    return load_smollm2(torch.float32)


@pytest.fixture(scope="session")
def gemma3():
    """Real Gemma-3-270M (base, hybrid sliding-window) in fp32 on the CPU, with its tokenizer."""
    return load_gemma3(torch.float32)
