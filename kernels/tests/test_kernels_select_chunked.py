"""The chunked radix passes (`select_chunked.py`, rows longer than `SELECT_TUNING["row_in_registers"]`): the same
list, slot for slot, as the threshold passes of one program per row. `test_kernels_selection.py` runs its
property tests on them too (its "chunked passes" variant)."""

import pytest
import torch
from kernel_cases import DEVICE, import_kernels
from test_kernels_selection import UNTOUCHED, _check_topk

kernels = import_kernels()


@pytest.mark.parametrize("chunk, bits", [(16, 4), (64, 8), (128, 4), (1024, 4)])
def test_chunked_passes_select_the_tiled_passes_slots(chunk, bits, monkeypatch):
    """The chunked passes search the k-th key by radix buckets (4 or 8 bits a pass) from per-chunk counts, the
    tiled kernel by thresholds: both must find the same k-th key and write the same list, slot for slot: ties (taken
    in slot order across chunk borders), -0.0 (ordered below +0.0 by both), -inf and NaN candidates, budgets of 0,
    1 and every candidate, rows ending inside, at and before a chunk, a chunk size that does not divide the row, and
    a subset of layers with a budget per layer."""
    from hf_vegas_kernels import _launch

    monkeypatch.setitem(_launch.SELECT_TUNING, "row_in_registers", 0)
    monkeypatch.setitem(_launch.SELECT_TUNING, "bits", bits)
    monkeypatch.setitem(_launch.SELECT_TUNING, "chunk_warps", 2 if chunk == 16 else 4)
    gen = torch.Generator().manual_seed(chunk)
    slots = 1000
    scores = (torch.randint(-3, 4, (3, 4, slots), generator=gen).float() * 0.25).to(DEVICE)  # heavy ties
    scores[0, 0, :40] = -0.0  # its budget of 500 ends among the zeros: +0.0 ranks above -0.0 in both kernels
    scores[0, 1, 500:] = float("-inf")
    scores[2, 0, 7] = float("nan")  # ranks above every number in both kernels: selected in a budget of 142
    scores[2, 3] = torch.randn(slots, generator=gen).to(DEVICE)
    cand_end = torch.tensor([1000, 768, 17, 999], device=DEVICE)
    count = torch.tensor([[500, 700, 0, 1], [0, 0, 0, 0], [142, 768, 17, 998]], device=DEVICE)
    layers = torch.tensor([0, 2], device=DEVICE)
    chosen = {}
    for name, chunk_setting in (("chunked", chunk), ("tiled", 0)):
        monkeypatch.setitem(_launch.SELECT_TUNING, "chunk", chunk_setting)
        chosen[name] = torch.full((3, 4, 1004), UNTOUCHED, dtype=torch.long, device=DEVICE)
        kernels.select_topk(scores, count, cand_end, chosen[name], layers=layers)
    assert torch.equal(chosen["chunked"], chosen["tiled"])
    assert (chosen["chunked"][1] == UNTOUCHED).all(), "a layer not listed is not written"
    assert torch.equal(chosen["chunked"][2, 2, :17].cpu(), torch.arange(17)), "a budget of every candidate takes all"
    assert 7 in chosen["chunked"][2, 0, :142].tolist(), "the NaN score is taken"
    zeros = chosen["chunked"][0, 0, :500]
    assert int((scores[0, 0][zeros] == 0).sum()) > 0, "the budget ends among the zeros (the test's premise)"
    _check_topk(scores[0], count[0], cand_end, chosen["chunked"][0])


def test_an_older_triton_keeps_one_program_per_row(monkeypatch):
    """Without a masked `tl.histogram` (Triton before 3.4) long rows take the threshold passes of one program per
    row instead of failing at the chunked passes' launch."""
    from hf_vegas_kernels import _launch, select_chunked

    def unavailable(*args, **kwargs):
        raise AssertionError("the chunked passes ran on a Triton that cannot compile them")

    monkeypatch.setitem(_launch.SELECT_TUNING, "row_in_registers", 0)
    monkeypatch.setattr(select_chunked, "supported", lambda: False)
    monkeypatch.setattr(select_chunked, "select_topk_chunked", unavailable)
    scores = torch.randn(2, 300, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    count, cand_end = torch.tensor([30, 7], device=DEVICE), torch.tensor([300, 250], device=DEVICE)
    out = torch.full((2, 34), UNTOUCHED, dtype=torch.long, device=DEVICE)
    kernels.select_topk(scores, count, cand_end, out)
    _check_topk(scores, count, cand_end, out)


@pytest.mark.parametrize("setting, value, message", [("chunk", 1000, r"SELECT_TUNING\['chunk'\].*power of two"),
                                                     ("bits", 5, r"SELECT_TUNING\['bits'\].*4 or 8")])
def test_settings_the_passes_cannot_run_are_refused_by_name(setting, value, message, monkeypatch):
    from hf_vegas_kernels import _launch

    monkeypatch.setitem(_launch.SELECT_TUNING, "row_in_registers", 0)
    monkeypatch.setitem(_launch.SELECT_TUNING, setting, value)
    with pytest.raises(ValueError, match=message):
        out = torch.full((2, 8), UNTOUCHED, dtype=torch.long, device=DEVICE)
        kernels.select_topk(torch.randn(2, 300, device=DEVICE), torch.tensor([3, 4], device=DEVICE),
                            torch.tensor([300, 300], device=DEVICE), out)
