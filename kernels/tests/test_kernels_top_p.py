"""Triton top-p filtering (threshold search, no sort) against the reference rule and transformers' own warper."""

import pytest
import torch
from transformers.generation.logits_process import TopPLogitsWarper

from hf_vegas_kernels import naive
from kernel_cases import DEVICE, import_kernels

kernels = import_kernels()

TOP_P = (1e-3, 0.02, 0.9, 0.999)


def _rows(kind: str, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(5, vocab, generator=gen) * torch.linspace(0.5, 6.0, 5)[:, None]
    if kind == "ties":  # bf16 logits upcast to fp32: many equal scores, also at the cut
        scores = scores.to(torch.bfloat16).float()
    elif kind == "masked":  # after a top-k warper: most of the row is -inf
        scores[:, torch.randperm(vocab, generator=gen)[: vocab * 3 // 4]] = float("-inf")
    elif kind == "one_token":
        scores[:, 1:] = float("-inf")
    elif kind == "adjacent":  # distinct scores one float apart: a cut between neighbouring keys, no ties
        steps = torch.arange(vocab, dtype=torch.int32)[torch.randperm(vocab, generator=gen)]
        base = torch.tensor([1.0, 2.5, 7.0, 0.25, 3.0]).view(torch.int32)[:, None]
        scores = (base + steps[None, :]).view(torch.float32) * torch.tensor([1.0, 1.0, 1.0, 40.0, 4.0])[:, None]
    elif kind == "adjacent_ties":  # each of 8 neighbouring floats many times: ties at the cut and just above it
        steps = torch.randint(0, 8, (5, vocab), generator=gen, dtype=torch.int32)
        scores = (torch.tensor(3.0).view(torch.int32) + steps).view(torch.float32)
    elif kind == "peaked":  # a trained model's shape: a few raised tokens, so the lists above t_lo stay short
        scores[:, torch.randperm(vocab, generator=gen)[:5]] += 12.0
    elif kind == "signed_zeros":  # -0.0 and +0.0 are equal scores: ties broken by index, as the sort does
        scores[:, : vocab // 2] -= 30.0
        scores[:, ::7] = 0.0
        scores[:, 3::14] = -0.0
    return scores.to(DEVICE)


def _filter(scores, top_p, poison):
    # Every buffer the kernels allocate starts as NaN (integers: junk), so an unwritten entry shows.
    poison(kernels.top_p)
    return kernels.top_p_filter(scores, top_p)


@pytest.fixture
def poison(monkeypatch):
    def apply(module):
        def nan_empty(*shape, dtype, device):
            junk = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
            return torch.full(shape, junk, dtype=dtype, device=device)

        monkeypatch.setattr(module._launch, "empty", nan_empty)

    return apply


@pytest.mark.parametrize("kind", ["plain", "ties", "masked", "one_token", "signed_zeros", "adjacent", "adjacent_ties",
                                  "peaked"])
@pytest.mark.parametrize("vocab", [301, 700, 1000])  # 2, 3 (fewer than the power of two) and 4 chunks
def test_top_p_kernel_matches_the_stable_rule(kind, vocab, poison):
    scores = _rows(kind, vocab, seed=vocab)
    for top_p in TOP_P:
        out = _filter(scores, top_p, poison)
        expected = naive.top_p_filter(scores.cpu(), top_p)
        if kind == "adjacent_ties":
            # Hundreds of near-equal probabilities: how many ties at the cut go is floor((1 - top_p - below) / p),
            # a ratio that can sit within fp32 rounding of an integer, and the kernel sums `below` in another order
            # than the sort's scan: one token per row may fall on the other side (the module docstring's caveat).
            assert int((out.cpu().isinf() != expected.isinf()).sum(dim=1).max()) <= 1, f"top_p {top_p}"
            continue
        torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0, equal_nan=False)
        assert bool((~out.isinf()).any(dim=1).all()), "every row keeps at least one token"


def test_top_p_kernel_matches_transformers_warper_without_ties(poison):
    scores = _rows("plain", 777, seed=1)
    assert all(row.unique().numel() == row.numel() for row in scores), "this comparison needs distinct scores"
    for top_p in TOP_P:
        expected = TopPLogitsWarper(top_p)(None, scores.cpu().clone())
        torch.testing.assert_close(_filter(scores, top_p, poison).cpu(), expected, rtol=0, atol=0)


def test_top_p_kernel_keeps_a_custom_filter_value_and_refuses_bad_arguments():
    scores = _rows("plain", 301, seed=2)
    out = kernels.top_p_filter(scores, 0.5, filter_value=-123.0)
    torch.testing.assert_close(out.cpu(), naive.top_p_filter(scores.cpu(), 0.5, -123.0), rtol=0, atol=0)
    for bad in (0.0, 1e-8, 1.0):  # tiny top_p: fp32 cannot tell 1 - top_p from the total mass; the warper keeps them
        with pytest.raises(ValueError, match="top_p"):
            kernels.top_p_filter(scores, bad)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        kernels.top_p_filter(scores.double(), 0.5)
    for bad in (0.0, -1.0, float("nan"), "0.6"):
        with pytest.raises(ValueError, match="temperature"):
            kernels.top_p_filter(scores, 0.5, temperature=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["plain", "ties", "peaked"])
def test_top_p_kernel_with_the_temperature_folded_in(kind, dtype, poison):
    """Temperature then top-p in one call, reading the logits in the model's dtype: the reference's scores (the fp32
    copy times the fp32 reciprocal, as CUDA divides by a Python number) and kept set, exactly."""
    logits = (_rows(kind, 700, seed=5) * 3).to(dtype)
    for top_p, temperature in ((0.9, 0.6), (0.5, 1.7), (0.999, 0.3)):
        poison(kernels.top_p)
        out = kernels.top_p_filter(logits, top_p, temperature=temperature)
        assert out.dtype == torch.float32
        expected = naive.top_p_filter(logits.cpu(), top_p, temperature=temperature)
        torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU versions above cover it")
def test_top_p_kernel_at_a_real_vocabulary_on_the_gpu():
    gen = torch.Generator().manual_seed(3)
    scores = (torch.randn(448, 49152, generator=gen) * 4).to(torch.bfloat16).float().cuda()
    for top_p in (0.5, 0.95):
        expected = naive.top_p_filter(scores, top_p)  # CUDA's stable sort, same rule
        mismatched = (kernels.top_p_filter(scores, top_p).isinf() != expected.isinf()).any(dim=1)
        # fp32 sums in two orders: a row may differ only where a cumulative sum sits within rounding of 1 - top_p
        assert int(mismatched.sum()) <= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU test above checks the reference")
def test_folded_temperature_is_the_warpers_own_on_the_gpu():
    """On CUDA the folded temperature gives the scores `TemperatureLogitsWarper` gives, bit for bit."""
    from transformers.generation.logits_process import TemperatureLogitsWarper

    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(64, 49152, generator=gen) * 4).to(torch.bfloat16).cuda()
    for temperature in (0.6, 0.7, 1.3):
        warped = TemperatureLogitsWarper(temperature)(None, logits.float())
        out = kernels.top_p_filter(logits, 0.95, temperature=temperature)
        kept = ~out.isinf()
        assert torch.equal(out[kept], warped[kept])
        expected = naive.top_p_filter(logits, 0.95, temperature=temperature)
        assert int((out.isinf() != expected.isinf()).any(dim=1).sum()) <= 1
