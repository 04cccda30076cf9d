"""The score finalisation's launch settings (`_launch.SELECT_TUNING["finalize_tile"]`, `"finalize_warps"`) decide
only which program computes which slots: any setting gives the default's bits (values checked against the
reference in `test_kernels_attention.py`)."""

import pytest
import torch

from kernel_cases import DEVICE, NAN, import_kernels

kernels = import_kernels()


@pytest.mark.parametrize("tile, warps", [(64, 2), (1024, 8), (32768, 4)])
@pytest.mark.parametrize("weights", [False, True])
def test_finalize_settings_give_the_default_bits(tile, warps, weights, monkeypatch):
    from hf_vegas_kernels import _launch

    gen = torch.Generator().manual_seed(tile + warps)
    batch, rows, heads, slots = 3, 2, 6, 301
    emitted = torch.randn(batch, rows, heads, slots, generator=gen).to(DEVICE)
    lse = (torch.randn(batch, 7, heads, generator=gen) + 6).to(DEVICE)
    score_rows = torch.tensor([0, 6], device=DEVICE)
    cand_end = torch.tensor([301, 150, 9], device=DEVICE)
    emitted[1, :, :, 150:] = NAN  # past the row's candidates: never read
    emitted[2, :, :, 9:] = NAN
    results = {}
    for name, setting in (("default", None), ("tuned", (tile, warps))):
        if setting is not None:
            monkeypatch.setitem(_launch.SELECT_TUNING, "finalize_tile", setting[0])
            monkeypatch.setitem(_launch.SELECT_TUNING, "finalize_warps", setting[1])
        results[name] = [kernels.finalize_scores(emitted, lse, score_rows, cand_end, heads, weights, mean_rows)
                         for mean_rows in (True, False)]
    for default, tuned in zip(results["default"], results["tuned"]):
        assert not default.isnan().any(), "a slot past the candidates was read"
        assert torch.equal(default, tuned)


def test_a_tile_that_is_not_a_power_of_two_is_refused_by_name(monkeypatch):
    from hf_vegas_kernels import _launch

    monkeypatch.setitem(_launch.SELECT_TUNING, "finalize_tile", 1000)
    emitted = torch.zeros(1, 1, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"SELECT_TUNING\['finalize_tile'\] must be a power of two"):
        kernels.finalize_scores(emitted, torch.zeros(1, 1, 2, device=DEVICE), torch.tensor([0], device=DEVICE),
                                torch.tensor([16], device=DEVICE), 2, True, True)
