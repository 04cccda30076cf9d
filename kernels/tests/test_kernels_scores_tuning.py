"""The score finalisation's launch settings (`_launch.SELECT_TUNING["finalize_tile"]`, `"finalize_warps"`) decide
which program computes which slots and how its threads share a tile. The warps change the order in which a slot's
heads are summed (on an H100, 8 warps over a 1,024-slot tile gave other last bits than the default), so a setting
gives the default's values up to fp32 rounding, and the same bits each time it runs (values checked against the
reference in `test_kernels_attention.py`)."""

import pytest
import torch

from kernel_cases import DEVICE, NAN, import_kernels

kernels = import_kernels()


@pytest.mark.parametrize("tile, warps", [(64, 2), (1024, 8), (32768, 4)])
@pytest.mark.parametrize("weights", [False, True])
def test_finalize_settings_give_the_default_values(tile, warps, weights, monkeypatch):
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
    for name, setting in (("default", None), ("tuned", (tile, warps)), ("tuned again", (tile, warps))):
        if setting is not None:
            monkeypatch.setitem(_launch.SELECT_TUNING, "finalize_tile", setting[0])
            monkeypatch.setitem(_launch.SELECT_TUNING, "finalize_warps", setting[1])
        results[name] = [kernels.finalize_scores(emitted, lse, score_rows, cand_end, heads, weights, mean_rows)
                         for mean_rows in (True, False)]
    for default, tuned, again in zip(results["default"], results["tuned"], results["tuned again"]):
        assert not default.isnan().any() and not tuned.isnan().any(), "a slot past the candidates was read"
        assert torch.equal(tuned, again), "a launch setting must give the same bits each time it runs"
        # Six heads summed in another order: within a few fp32 roundings of the terms (-inf past the candidates).
        torch.testing.assert_close(tuned, default, rtol=2e-6, atol=2e-6)


def test_a_tile_that_is_not_a_power_of_two_is_refused_by_name(monkeypatch):
    from hf_vegas_kernels import _launch

    monkeypatch.setitem(_launch.SELECT_TUNING, "finalize_tile", 1000)
    emitted = torch.zeros(1, 1, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"SELECT_TUNING\['finalize_tile'\] must be a power of two"):
        kernels.finalize_scores(emitted, torch.zeros(1, 1, 2, device=DEVICE), torch.tensor([0], device=DEVICE),
                                torch.tensor([16], device=DEVICE), 2, True, True)
