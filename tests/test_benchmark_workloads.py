"""The throughput benchmark's windowed workload (`benchmarks/workloads.py`, `smollm2-window2048`): a Llama model's
own weights behind Mistral's sliding window, tested here on a tiny Llama (the benchmark runs it on the GPU)."""

import pathlib
import sys

import pytest
import torch

from tiny_models import ragged_batch, tiny_model

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
from workloads import parse_workload, with_sliding_window  # noqa: E402


def test_a_window_longer_than_the_text_is_the_model_itself_and_shares_its_weights():
    llama = tiny_model("llama")
    ids, _ = ragged_batch([50])
    long, short = with_sliding_window(llama, 4096), with_sliding_window(llama, 16)
    with torch.no_grad():
        expected = llama(ids).logits
        torch.testing.assert_close(long(ids).logits, expected, rtol=0, atol=0)
        assert not torch.allclose(short(ids).logits, expected), "a 16-slot window must change a 50-token forward"
    assert short.model.embed_tokens.weight.data_ptr() == llama.model.embed_tokens.weight.data_ptr()
    assert short.config.sliding_window == 16 and not short.training


@pytest.mark.usefixtures("short_windows_draft")
def test_vegas_on_the_windowed_workload_is_vanilla():
    model = with_sliding_window(tiny_model("llama"), 40)
    ids, mask = ragged_batch([80, 61])
    common = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=3, vegas_sparsity=0.1,
                         vegas_min_tokens=8)
    assert torch.equal(out, model.generate(ids, **common))


def test_workload_names():
    assert str(parse_workload("smollm2-window2048:64x7500")) == "smollm2-window2048:64x7500"
    assert parse_workload("smollm2-window2048:4x100").real_weights
    with pytest.raises(ValueError, match="MODEL:BATCHxPROMPT_TOKENS"):
        parse_workload("smollm2-window:4x100")


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (real SmolLM2 behind a window, kernels and graphs); the tiny-model tests "
                           "above and tests/test_sliding_windows.py cover it on the CPU")
def test_real_windowed_model_on_the_gpu_is_vanilla_in_fp32():
    """The benchmark's windowed SmolLM2 in fp32 on the GPU (Triton kernels, CUDA graphs), prompts past the window:
    greedy tokens are vanilla's, so a bf16 difference from the dense path is rounding, not a wrong draft mask."""
    from hf_vegas.real_models import load_smollm2, long_prompt

    model, tokenizer = load_smollm2(torch.float32, "cuda")
    model = with_sliding_window(model, 2048)
    rows = [long_prompt(tokenizer, 3000)[0], long_prompt(tokenizer, 2600, topic_offset=1)[0]]
    width = max(len(r) for r in rows)
    ids = torch.full((2, width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row):], mask[b, width - len(row):] = row, 1
    ids, mask = ids.cuda(), mask.cuda()
    common = dict(attention_mask=mask, max_new_tokens=48, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    expected = model.generate(ids, **common)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_min_tokens=64, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.tokens_per_iteration > 1.5
