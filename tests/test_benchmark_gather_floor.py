"""`benchmarks/gather_floor.py`: its bare gather kernel reads exactly the shares of each row's list that it claims
(against the plain-PyTorch reference, on the CPU through Triton's interpreter, into NaN-poisoned outputs), and the
script refuses bad arguments before any GPU work."""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import gather_floor  # noqa: E402


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("splits, block_n", [(1, 16), (3, 16), (4, 32)])
def test_gather_sums_matches_the_reference(index_dtype, splits, block_n):
    """Odd shapes: 3 rows with lists of 0, 37 and 53 slots (none a whole number of blocks, one empty), 2 KV heads
    of 16, splits that leave some shares empty."""
    torch.manual_seed(0)
    batch, slots, kv_heads, head_dim, width = 3, 61, 2, 16, 53
    k_cache = torch.randn(batch, slots, kv_heads, head_dim, dtype=torch.bfloat16)
    v_cache = torch.randn(batch, slots, kv_heads, head_dim, dtype=torch.bfloat16)
    count = torch.tensor([0, 37, 53], dtype=torch.int32)
    sel_idx = torch.stack([torch.randperm(slots)[:width].sort().values for _ in range(batch)]).to(index_dtype)
    out = torch.full((batch * kv_heads * splits, head_dim), float("nan"))
    gather_floor.gather_sums(k_cache, v_cache, sel_idx, count, splits, block_n, out=out)
    expected = gather_floor.gather_sums_reference(k_cache, v_cache, sel_idx, count, splits, block_n)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    assert out.view(batch, kv_heads, splits, head_dim)[0].eq(0).all()  # an empty list reads nothing


def test_gather_sums_refuses_what_it_cannot_read_or_write():
    k_cache = torch.zeros(1, 8, 1, 16)
    sel_idx, count = torch.zeros(1, 4, dtype=torch.int64), torch.tensor([4])
    for args, kwargs in [((k_cache, k_cache, torch.zeros(1, 8, dtype=torch.int64)[:, ::2], count), {}),
                         ((k_cache, torch.zeros(1, 8, 1, 8), sel_idx, count), {}),
                         ((k_cache, k_cache, sel_idx, torch.tensor([4, 4])), {}),
                         ((k_cache, k_cache, sel_idx, count), {"out": torch.zeros(2, 16)})]:
        with pytest.raises(ValueError, match="gather_sums"):
            gather_floor.gather_sums(*args, 1, 16, **kwargs)


@pytest.mark.parametrize("argv", [["--selected", "0"], ["--selected", "7494"], ["--copies", "0"]])
def test_bad_arguments_are_refused_before_any_gpu_work(monkeypatch, capsys, argv):
    monkeypatch.setattr(sys, "argv", ["gather_floor.py", *argv])
    with pytest.raises(SystemExit):
        gather_floor.main()
    assert "--selected at most --context - 7" in capsys.readouterr().err
