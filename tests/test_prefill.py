"""The per-row causal prefill equals the reference's masked dense attention on every real query row, also after
tokens the rows already hold; a chunked prefill (`prefill_chunk_size`) equals one forward."""

import pytest
import torch

from hf_vegas.ops import prefill
from hf_vegas_kernels import naive


@pytest.mark.parametrize("window", [None, 7, 100])
def test_causal_per_row_matches_masked_reference(window):
    gen = torch.Generator().manual_seed(0)
    batch, q_heads, kv_heads, head_dim, tokens, slots = 3, 6, 2, 16, 21, 30
    left_pad = [0, 5, 13]
    q = torch.randn(batch, q_heads, tokens, head_dim, generator=gen)
    k = torch.randn(batch, slots, kv_heads, head_dim, generator=gen)
    v = torch.randn(batch, slots, kv_heads, head_dim, generator=gen)
    pads = torch.tensor(left_pad)
    offsets = torch.arange(tokens)[None, :]
    q_slot = (offsets - pads[:, None]).clamp_min(0)  # as VegasCache lays out a prefill
    lengths = tokens - pads
    k[torch.arange(slots)[None, :] >= lengths[:, None]] = float("nan")  # nothing past a row's tokens may be read
    got = prefill.causal_per_row(q, k, v, left_pad, 0.25, window)
    expected = naive.dense_attention(q, k.nan_to_num(), v.nan_to_num(), q_slot, lengths, 0.25, window)
    real = offsets >= pads[:, None]
    torch.testing.assert_close(got[real], expected[real])
    assert (got[~real] == 0).all()


@pytest.mark.parametrize("window", [None, 7, 100])
def test_causal_per_row_after_cached_tokens_matches_masked_reference(window):
    """A prefill after tokens the rows already hold (a chunk of a chunked prefill, or a user's prefix cache): row
    `b`'s real queries sit at slots `start[b]..` and see every slot up to their own (inside the window)."""
    gen = torch.Generator().manual_seed(1)
    batch, q_heads, kv_heads, head_dim, tokens, slots = 4, 6, 2, 16, 9, 40
    left_pad, start = [0, 3, 9, 0], [0, 11, 4, 20]  # a fresh row, a cached one with pads, one all pads, a long one
    q = torch.randn(batch, q_heads, tokens, head_dim, generator=gen)
    k = torch.randn(batch, slots, kv_heads, head_dim, generator=gen)
    v = torch.randn(batch, slots, kv_heads, head_dim, generator=gen)
    pads, first = torch.tensor(left_pad), torch.tensor(start)
    offsets = torch.arange(tokens)[None, :]
    q_slot = (first[:, None] + offsets - pads[:, None]).clamp_min(0)  # as VegasCache lays out such a forward
    lengths = first + tokens - pads
    k[torch.arange(slots)[None, :] >= lengths[:, None]] = float("nan")  # nothing past a row's tokens may be read
    got = prefill.causal_per_row(q, k, v, left_pad, 0.25, window, start)
    expected = naive.dense_attention(q, k.nan_to_num(), v.nan_to_num(), q_slot, lengths, 0.25, window)
    real = offsets >= pads[:, None]
    torch.testing.assert_close(got[real], expected[real])
    assert (got[~real] == 0).all()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_chunked_prefill_equals_one_forward(monkeypatch, arch):
    """`prefill_chunk_size`: the prompt in forwards of 5 positions (a row's pads span three chunks) leaves the same
    keys and values, the same last logits and the same first selection as one forward; only the last chunk
    selects."""
    from transformers import LogitsProcessorList

    import hf_vegas.attention as attention
    from hf_vegas.attention import active_cache, vegas_attention
    from hf_vegas.cache import VegasCache
    from hf_vegas.config import VegasConfig
    from hf_vegas.runner import StepRunner
    from tiny_models import ragged_batch, tiny_model

    model = tiny_model(arch)
    ids, mask = ragged_batch([23, 17, 9])
    left_pad = (mask == 0).sum(dim=1)
    selecting = []
    original = attention._select
    monkeypatch.setattr(attention, "_select", lambda cache, *args: selecting.append(cache.plan.lengths.tolist())
                        or original(cache, *args))
    results = {}
    for chunk in (None, 5):
        cache = VegasCache(model.config, 3, 40, VegasConfig(gamma=2, sparsity=0.3, min_tokens=4), device="cpu")
        runner = StepRunner(model, cache, LogitsProcessorList(), do_sample=False)
        selecting.clear()
        with torch.no_grad(), vegas_attention(model), active_cache(cache):
            logits = runner.prefill(ids, left_pad=left_pad, chunk_size=chunk)
        assert selecting and all(lengths == [23, 17, 9] for lengths in selecting), "only the last chunk selects"
        sel = cache.selection
        results[chunk] = (logits, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers],
                          sel.sel_count.clone(), sel.sel_idx.clone(), cache.plan.lengths.clone())
    one, caches_one, count_one, idx_one, len_one = results[None]
    chunked, caches_chunked, count_chunked, idx_chunked, len_chunked = results[5]
    torch.testing.assert_close(chunked, one)
    assert torch.equal(len_chunked, len_one)
    slots = torch.arange(41)[None, :] < len_one[:, None]  # the real slots (the scratch slot takes the pads)
    for (k1, v1), (k2, v2) in zip(caches_one, caches_chunked):
        torch.testing.assert_close(k2[slots], k1[slots])
        torch.testing.assert_close(v2[slots], v1[slots])
    assert torch.equal(count_chunked, count_one)
    for layer in range(idx_one.shape[0]):
        for row in range(3):
            n = int(count_one[layer, row])
            assert torch.equal(idx_chunked[layer, row, :n], idx_one[layer, row, :n])
