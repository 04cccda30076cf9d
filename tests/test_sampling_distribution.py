"""Sampling keeps vanilla's distribution: Vegas samples against the exact distribution of vanilla sampling.

The exact distribution of the next 3 tokens is enumerated from vanilla `generate`'s own processed scores
(temperature, top-k, top-p); Vegas draws N independent rows of one batch; a chi-square test compares them. A
negative control runs the same test with a wrong draft probability and must fail, so the test has power.
"""

import pytest
import torch

import hf_vegas.loop as loop
from hf_vegas import sampling
from tiny_models import tiny_model

from distribution import NEW_TOKENS, ROWS, SAMPLING, chi_square_p_value, exact_distribution, vegas_samples  # noqa: F401


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama", seed=3)
    prompt = torch.randint(1, 128, (1, 48), generator=torch.Generator().manual_seed(3))
    return model, prompt, exact_distribution(model, prompt)


# A tiny budget makes the sparse draft clearly differ from the target, which is what the control needs.
DRAFT = dict(vegas_gamma=2, vegas_sparsity=0.05, vegas_min_tokens=2)


@pytest.mark.parametrize("policy", ["vegas", "streaming"])
def test_vegas_sampling_matches_vanilla_distribution(setup, policy):
    model, prompt, expected = setup
    counts, out = vegas_samples(model, prompt, vegas_policy=policy, **DRAFT)
    p_value = chi_square_p_value(counts, expected, ROWS)
    tv = 0.5 * sum(abs(counts.get(k, 0) / ROWS - expected.get(k, 0.0)) for k in set(counts) | set(expected))
    print(f"policy={policy} p={p_value:.3g} TV={tv:.3f} tokens/iteration={out.tokens_per_iteration:.2f}")
    assert (out.accepted < DRAFT["vegas_gamma"]).any(), "some drafts must be rejected to exercise resampling"
    assert p_value > 1e-3


def test_wrong_draft_probability_is_detected(setup, monkeypatch):
    """Control: accepting with q = 1 (no draft probabilities, as in vLLM #40149) must fail the same test."""
    model, prompt, expected = setup

    def accept_without_q(draft, draft_scores, target_scores):
        return sampling.accept_sampling(draft, torch.zeros_like(draft_scores), target_scores)

    monkeypatch.setattr(loop, "accept_sampling", accept_without_q)
    counts, _ = vegas_samples(model, prompt, **DRAFT)
    p_value = chi_square_p_value(counts, expected, ROWS)
    print(f"control p={p_value:.3g}")
    assert p_value < 1e-6


def test_sampling_with_a_repetition_penalty_matches_vanilla_distribution(setup):
    """A history-dependent processor (each row's own history, processed per history length) before top-p, in a
    batch of ROWS rows that accept different numbers of drafts."""
    model, prompt, _ = setup
    sampling = dict(SAMPLING, repetition_penalty=1.6)
    expected = exact_distribution(model, prompt, sampling)
    without = exact_distribution(model, prompt)
    tv = 0.5 * sum(abs(expected.get(k, 0.0) - without.get(k, 0.0)) for k in set(expected) | set(without))
    assert tv > 0.1, "the penalty must change the distribution for the test to see it applied"
    counts, out = vegas_samples(model, prompt, sampling, **DRAFT)
    p_value = chi_square_p_value(counts, expected, ROWS)
    print(f"repetition penalty: p={p_value:.3g} tokens/iteration={out.tokens_per_iteration:.2f}")
    assert len(set(out.accepted[:, 0].tolist())) > 1, "rows must accept different numbers of drafts"
    assert p_value > 1e-3


@pytest.mark.usefixtures("short_windows_draft")
def test_sampling_with_windowed_sparse_layers_matches_vanilla_distribution():
    """Mistral v0.1 past its window: every layer drafts sparsely inside a 24-slot window of a 48-token prompt."""
    from transformers import MistralConfig, MistralForCausalLM

    from tiny_models import COMMON

    torch.manual_seed(4)
    model = MistralForCausalLM(MistralConfig(**COMMON, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, sliding_window=24)).eval()
    prompt = torch.randint(1, 128, (1, 48), generator=torch.Generator().manual_seed(4))
    expected = exact_distribution(model, prompt)
    counts, out = vegas_samples(model, prompt, **DRAFT)
    p_value = chi_square_p_value(counts, expected, ROWS)
    print(f"windowed p={p_value:.3g} tokens/iteration={out.tokens_per_iteration:.2f}")
    from hf_vegas._compat.internals import CACHE_KEYWORD

    assert getattr(out, CACHE_KEYWORD).selection.windows == {0: 24, 1: 24}, "both layers draft inside the window"
    assert (out.accepted < DRAFT["vegas_gamma"]).any(), "some drafts must be rejected to exercise resampling"
    assert p_value > 1e-3


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_draft_sampler_draws_the_tokens_of_multinomial(device):
    """`choose_draft` is `torch.multinomial`'s one-sample race without its checks: the same seed gives the same
    tokens and leaves the generator where multinomial leaves it (so the next draws agree too)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; the CPU case checks the same race")
    gen = torch.Generator().manual_seed(0)
    scores = (torch.randn(33, 5003, generator=gen) * 4).to(device)
    scores[:, ::3] = float("-inf")  # filtered tokens (top-k, top-p) have probability 0 and are never drawn
    for seed in range(10):
        torch.manual_seed(seed)
        expected = sampling.choose(scores, do_sample=True), torch.rand(4, device=device)
        torch.manual_seed(seed)
        got = sampling.choose_draft(scores, do_sample=True), torch.rand(4, device=device)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert bool((got[0] % 3 != 0).all()), "a filtered token was drawn"
    assert torch.equal(sampling.choose_draft(scores, do_sample=False), scores.argmax(dim=-1))
