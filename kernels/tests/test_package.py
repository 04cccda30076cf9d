"""The package without Triton: `import hf_vegas_kernels` and its naive ops need only torch; a Triton op, asked for,
raises Triton's own import error."""

import subprocess
import sys

import pytest
from kernel_cases import import_kernels

# Triton ops whose naive twin has another name: the `torch.library` forms of three products, and the q/k/v and single
# projections (`grouped_linear` of three weights, of one).
NAIVE_TWIN = {"gated_linear_op": "gated_linear", "linear_residual_op": "linear_residual",
              "linear_residual_norm_into": "linear_residual_norm", "qkv_linear": "grouped_linear",
              "linear_op": "grouped_linear", "exchange_sum_norm": "all_reduce_norm"}

WITHOUT_TRITON = r"""
import sys
sys.modules["triton"] = None  # any import of Triton fails, as on a machine without it
import torch
import hf_vegas_kernels
from hf_vegas_kernels import naive

out = naive.dense_attention(torch.randn(1, 2, 1, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8),
                            torch.tensor([[3]]), torch.tensor([4]), 0.5)
assert out.shape == (1, 1, 2, 8) and "dense_attention" in dir(hf_vegas_kernels)
try:
    hf_vegas_kernels.dense_attention
except ImportError as error:
    print("refused:", error)
"""


def test_the_package_and_its_naive_ops_import_without_triton():
    run = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "refused: import of triton halted" in run.stdout


def test_every_triton_op_loads_and_unknown_names_are_attribute_errors():
    kernels = import_kernels()  # loads every Triton op
    assert set(kernels.TRITON_OPS) <= set(vars(kernels)) and set(kernels.__all__) <= set(dir(kernels))
    for name in kernels.TRITON_OPS:
        twin = NAIVE_TWIN.get(name, name)
        assert callable(getattr(kernels, name)) and callable(getattr(kernels.naive, twin)), f"{name}: no naive {twin}"
    with pytest.raises(AttributeError, match="has no attribute 'no_such_op'"):
        kernels.no_such_op


def test_loading_all_ops_keeps_an_op_already_replaced(monkeypatch):
    """`load_triton_ops` (which hf_vegas calls when it first resolves the Triton backend) loads only what is missing:
    a spy a test put in place before stays the op hf_vegas calls."""
    kernels = import_kernels()

    def spy(*args, **kwargs):
        raise AssertionError("not called here")

    monkeypatch.setattr(kernels, "sparse_draft_attention", spy)
    monkeypatch.setattr(kernels, "top_p_filter", spy)
    monkeypatch.delattr(kernels, "top_p")  # as before the module's first import
    kernels.load_triton_ops()
    assert kernels.sparse_draft_attention is spy and kernels.top_p_filter is spy
    assert kernels.top_p.MIN_TOP_P > 0, "every module is imported and bound, replaced ops or not"
