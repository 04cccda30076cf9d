"""hf_vegas' fixtures: the real models and the tiny models' short windows. The environment (Triton's interpreter on the
CPU, threads per xdist worker, the seed) is set by the root `conftest.py`."""

import pytest
import torch

import hf_vegas  # noqa: F401  (registers the "vegas" attention and short name)
from hf_vegas.real_models import load_gemma3, load_smollm2


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
