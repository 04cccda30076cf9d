"""Triton top-k selection: exactly `count[b]` slots per row, a valid top-k of the candidates, ascending, no sync."""

import pytest
import torch

from hf_vegas_kernels import naive
from kernel_cases import DEVICE, import_kernels

kernels = import_kernels()

UNTOUCHED = -7


@pytest.fixture(params=["row in registers", "tiled passes", "chunked passes"], autouse=True)
def kernel_variant(request, monkeypatch):
    """Every test runs the three kernels: a row held in registers (short rows), and for long rows the threshold
    passes in one program per row (`chunk` 0) or in one launch per pass over chunks of the row (256 slots here, so
    that the tests' rows of a few hundred to a few thousand slots span several chunks)."""
    from hf_vegas_kernels import _launch

    if request.param != "row in registers":
        monkeypatch.setitem(_launch.SELECT_TUNING, "row_in_registers", 0)
        monkeypatch.setitem(_launch.SELECT_TUNING, "chunk", 256 if request.param == "chunked passes" else 0)
    return request.param


def _check_topk(scores, count, cand_end, out):
    for b in range(scores.shape[0]):
        k, n = int(count[b]), int(cand_end[b])
        chosen = out[b, :k]
        assert (out[b, k:] == UNTOUCHED).all(), "entries past the row's budget must be left alone"
        assert (chosen >= 0).all() and (chosen < n).all(), "only candidates may be selected"
        assert torch.equal(chosen, torch.sort(chosen).values) and chosen.unique().numel() == k, "ascending, distinct"
        picked = torch.zeros(n, dtype=torch.bool, device=scores.device)
        picked[chosen] = True
        row = scores[b, :n]
        if 0 < k < n:  # a top-k: nothing left out scores higher than anything kept
            assert row[picked].min() >= row[~picked].max()


def _run(scores, count, cand_end):
    out = torch.full((scores.shape[0], int(count.max()) + 4), UNTOUCHED, dtype=torch.long, device=scores.device)
    return kernels.select_topk(scores, count, cand_end, out)


@pytest.mark.parametrize("n_slots", [37, 1100, 3000])
def test_select_matches_torch_topk_without_ties(n_slots):
    gen = torch.Generator().manual_seed(n_slots)
    scores = torch.randn(3, n_slots, generator=gen).to(DEVICE)
    cand_end = torch.tensor([n_slots, n_slots - 5, n_slots // 2], device=DEVICE)
    scores[torch.arange(n_slots, device=DEVICE)[None, :] >= cand_end[:, None]] = float("-inf")
    count = torch.tensor([1, n_slots // 7, n_slots // 2], device=DEVICE)
    out = _run(scores, count, cand_end)
    _check_topk(scores, count, cand_end, out)
    for b in range(3):
        expected = torch.topk(scores[b], int(count[b])).indices.sort().values
        assert torch.equal(out[b, : count[b]], expected)


def test_select_with_ties_negative_zero_and_whole_range():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(-2, 3, (4, 1500), generator=gen).float() * 0.5  # heavy ties
    scores[0, :10] = -0.0
    scores[2] = 1e-30  # all equal: the first k in slot order
    scores[3, 100] = float("inf")
    scores = scores.to(DEVICE)
    cand_end = torch.tensor([1500, 1024, 800, 1499], device=DEVICE)
    count = torch.tensor([700, 1024, 33, 1], device=DEVICE)  # row 1 takes every candidate
    out = _run(scores, count, cand_end)
    _check_topk(scores, count, cand_end, out)
    assert torch.equal(out[2, :33].cpu(), torch.arange(33))
    assert out[3, 0] == 100


def test_candidates_past_the_scores_count_as_their_width():
    """A `cand_end` past the scores' slots (here a view of a wider buffer whose next slots score highest, and NaN past
    that) selects from the scores' slots only and writes exactly `count` entries, as the reference does."""
    wide = torch.full((3, 2048), float("nan"))
    wide[:, :1100] = torch.randn(3, 1100, generator=torch.Generator().manual_seed(5))
    wide[:, 1000:1100] = 100.0  # past the view: would win if read
    scores = wide.to(DEVICE)[:, :1000]
    cand_end = torch.tensor([1100, 1000, 2000], device=DEVICE)
    count = torch.tensor([4, 300, 999], device=DEVICE)
    out = _run(scores, count, cand_end)
    expected = torch.full_like(out, UNTOUCHED)
    naive.select_topk(scores, count, cand_end, expected)
    assert torch.equal(out, expected)
    _check_topk(scores, count, torch.full_like(cand_end, 1000), out)


def test_select_handles_extreme_magnitudes():
    scores = torch.tensor([[3.4e38, -3.4e38, 1e-45, -1e-45, 0.0, 1.0, -1.0, float("-inf")]], device=DEVICE)
    out = _run(scores, torch.tensor([4], device=DEVICE), torch.tensor([7], device=DEVICE))
    assert out[0, :4].tolist() == [0, 2, 4, 5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU versions above cover it")
@pytest.mark.gpu
@pytest.mark.parametrize("slots", [131_072, 16_384, 7_519])
def test_select_at_real_sizes_on_gpu(slots):
    scores = torch.randn(8, slots, device="cuda")
    ends = [131_072, 100_000, 32_768, 8192, 300, 256, 131_000, 65_536]
    cand_end = torch.tensor([min(end, slots - i) for i, end in enumerate(ends)], device="cuda")
    scores[torch.arange(slots, device="cuda")[None, :] >= cand_end[:, None]] = float("-inf")
    count = torch.clamp(torch.ceil(0.07 * cand_end), min=256).long().minimum(cand_end)
    out = _run(scores, count, cand_end)
    _check_topk(scores, count, cand_end, out)


def test_select_all_layers_in_one_launch():
    """Verification selects for every full-attention layer at once: (L, B, S) scores, a subset of layers."""
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(4, 2, 300, generator=gen).to(DEVICE)
    count = torch.tensor([30, 7], device=DEVICE)
    cand_end = torch.tensor([300, 250], device=DEVICE)
    out = torch.full((4, 2, 34), UNTOUCHED, dtype=torch.long, device=DEVICE)
    kernels.select_topk(scores, count, cand_end, out, layers=torch.tensor([0, 3], device=DEVICE))
    assert (out[1:3] == UNTOUCHED).all(), "layers not listed are not written"
    for layer in (0, 3):
        _check_topk(scores[layer], count, cand_end, out[layer])


def test_select_with_a_budget_per_layer_and_a_window():
    """A sliding-window layer's budget counts its window's candidates only, and the slots before the window score
    -inf: with `(L, B)` counts each layer takes its own budget, and never a slot outside its window."""
    gen = torch.Generator().manual_seed(6)
    scores = torch.randn(3, 2, 300, generator=gen).to(DEVICE)
    cand_end = torch.tensor([300, 250], device=DEVICE)
    cand_start = torch.tensor([[0, 0], [0, 0], [201, 151]], device=DEVICE)  # layer 2: a window of 100 slots
    slots = torch.arange(300, device=DEVICE)
    scores[2][slots[None, :] < cand_start[2][:, None]] = float("-inf")
    count = torch.tensor([[30, 7], [0, 0], [12, 99]], device=DEVICE)  # layer 2's second row takes all but one
    out = torch.full((3, 2, 34 + 70), UNTOUCHED, dtype=torch.long, device=DEVICE)
    kernels.select_topk(scores, count, cand_end, out, layers=torch.tensor([0, 2], device=DEVICE))
    assert (out[1] == UNTOUCHED).all(), "layers not listed are not written"
    for layer in (0, 2):
        _check_topk(scores[layer], count[layer], cand_end, out[layer])
    for b in range(2):
        assert (out[2, b, : count[2, b]] >= cand_start[2, b]).all(), "a window's selection stays in the window"
    with pytest.raises(ValueError, match="count must be"):
        kernels.select_topk(scores, count[:, :1], cand_end, out)


def test_a_row_longer_than_16k_held_in_registers_selects_what_the_passes_do(monkeypatch):
    """`_launch.SELECT_TUNING["row_in_registers"]` raised past 16K slots (a 32K block on 32 warps on the GPU): the
    same slots, ties included, as the threshold passes of one program per row and the chunked radix passes."""
    from hf_vegas_kernels import _launch

    gen = torch.Generator().manual_seed(20000)
    scores = torch.randn(2, 20000, generator=gen).round(decimals=1).to(DEVICE)  # many ties
    count = torch.tensor([700, 33], device=DEVICE)
    cand_end = torch.tensor([20000, 17001], device=DEVICE)
    chosen = {}
    for name, longest, chunk in (("registers", 32768, 0), ("tiled", 0, 0), ("chunked", 0, 2048)):
        monkeypatch.setitem(_launch.SELECT_TUNING, "row_in_registers", longest)
        monkeypatch.setitem(_launch.SELECT_TUNING, "chunk", chunk)
        chosen[name] = _run(scores, count, cand_end)
    _check_topk(scores, count, cand_end, chosen["registers"])
    assert torch.equal(chosen["registers"], chosen["tiled"])
    assert torch.equal(chosen["registers"], chosen["chunked"])
