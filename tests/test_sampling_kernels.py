"""hf_vegas' sampling on the kernels: the logits pipeline folds `[temperature, top-p]` into one `KernelTopP`, and the
draft token's one-launch race draws what `torch.multinomial` draws. The kernels' own tests:
`kernels/tests/test_kernels_top_p.py` and `test_kernels_race.py`."""

import torch
from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from hf_vegas import sampling
from hf_vegas.sampling import KernelTopP, LogitsPipeline
from hf_vegas_kernels import naive
from kernel_cases import DEVICE, import_kernels

kernels = import_kernels()


def test_pipeline_folds_the_temperature_into_the_kernel():
    """With the kernels, `[temperature, top-p]` is one `KernelTopP`; a temperature elsewhere stays the warper."""
    pipeline = LogitsPipeline(LogitsProcessorList([TemperatureLogitsWarper(0.6), TopPLogitsWarper(0.9)]), kernels=True)
    assert [type(p) for p in pipeline.processors] == [KernelTopP] and pipeline.processors[0].temperature == 0.6
    assert pipeline.batched and pipeline.capture_key is not None
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(5, 700, generator=gen) * torch.linspace(1.5, 18.0, 5)[:, None]).to(DEVICE, torch.bfloat16)
    torch.testing.assert_close(pipeline.history_free(logits).cpu(),
                               naive.top_p_filter(logits.cpu(), 0.9, temperature=0.6), rtol=0, atol=0)
    # float64 logits (which the kernel does not read) still get vanilla's fp32 copy first
    torch.testing.assert_close(pipeline.history_free(logits.double()).cpu(),
                               naive.top_p_filter(logits.cpu(), 0.9, temperature=0.6), rtol=0, atol=0)
    apart = LogitsPipeline(LogitsProcessorList([TemperatureLogitsWarper(0.6), TopKLogitsWarper(50),
                                                TopPLogitsWarper(0.9)]), kernels=True)
    assert [type(p) for p in apart.processors] == [TemperatureLogitsWarper, TopKLogitsWarper, KernelTopP]
    assert apart.processors[2].temperature is None


def test_kernel_race_draws_multinomials_tokens():
    """`choose_draft(kernels=True)` draws the tokens `torch.multinomial` draws under the same seed, and leaves the
    generator where multinomial leaves it."""
    gen = torch.Generator().manual_seed(1)
    scores = (torch.randn(33, 5003, generator=gen) * 4).to(DEVICE)
    scores[:, ::3] = float("-inf")
    for seed in range(5):
        torch.manual_seed(seed)
        expected = sampling.choose(scores, do_sample=True), torch.rand(4, device=DEVICE)
        torch.manual_seed(seed)
        got = sampling.choose_draft(scores, do_sample=True, kernels=True), torch.rand(4, device=DEVICE)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_kernel_greedy_draft_is_the_argmax(monkeypatch):
    """Greedy, `choose_draft(kernels=True)` is `race_argmax` without draws, which is `torch.argmax` of the logits in
    their own dtype (ties: the lowest index), and draws nothing from the generator."""
    calls = []
    original = kernels.race_argmax
    monkeypatch.setattr(kernels, "race_argmax", lambda scores, race: calls.append(race) or original(scores, race))
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(9, 3001, generator=gen) * 3).to(DEVICE, torch.bfloat16)
    logits[4] = 1.0  # a row of ties
    torch.manual_seed(0)
    got = sampling.choose_draft(logits, do_sample=False, kernels=True)
    after = torch.rand(4, device=DEVICE)
    torch.manual_seed(0)
    assert torch.equal(got, logits.argmax(dim=-1)) and int(got[4]) == 0
    assert torch.equal(after, torch.rand(4, device=DEVICE))
    assert calls == [None]
