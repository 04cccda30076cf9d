"""`vegas_gamma=0`: plain decoding over the Vegas cache and kernels (the benchmarks' dense baseline) is vanilla."""

import pytest
import torch

from tiny_models import BUILDERS, ragged_batch, tiny_model
from hf_vegas._compat.internals import CACHE_KEYWORD

SHAPES = {"batch1": [40], "ragged3": [40, 29, 13]}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("arch", list(BUILDERS))
def test_dense_greedy_matches_vanilla(arch, shape):
    model = tiny_model(arch)
    ids, mask = ragged_batch(SHAPES[shape])
    common = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **common)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=0, return_dict_in_generate=True)
    torch.testing.assert_close(out.sequences, expected, rtol=0, atol=0)
    assert bool((out.accepted[out.accepted >= 0] == 0).all()), "no drafts: every step keeps exactly one token"
    assert not getattr(out, CACHE_KEYWORD).selection.has_selection, "the dense path never selects"


def test_dense_sampling_is_vanilla_token_for_token():
    """Each step samples from the processed target scores with one multinomial call, exactly as vanilla does, so
    with the same seed the tokens are the same (a stronger check than equal distributions)."""
    model = tiny_model("llama", seed=2)
    ids, mask = ragged_batch([30, 22], seed=2)
    common = dict(attention_mask=mask, max_new_tokens=20, do_sample=True, temperature=0.7, top_k=20, top_p=0.9,
                  pad_token_id=0)
    torch.manual_seed(123)
    expected = model.generate(ids, **common)
    torch.manual_seed(123)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=0)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_dense_path_runs_the_dense_kernel(monkeypatch):
    from kernel_cases import DEVICE, import_kernels

    hf_vegas_kernels = import_kernels()

    calls = []
    original = hf_vegas_kernels.dense_attention
    monkeypatch.setattr(hf_vegas_kernels, "dense_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = tiny_model("qwen3").to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in ragged_batch([20, 11]))
    common = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **common)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=0, vegas_backend="triton")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert calls, "gamma = 0 must decode through the dense kernel"
