"""The per-row causal prefill equals the reference's masked dense attention on every real query row."""

import pytest
import torch

from hf_vegas.ops import prefill, reference


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
    expected = reference.dense_attention(q, k.nan_to_num(), v.nan_to_num(), q_slot, lengths, 0.25, window)
    real = offsets >= pads[:, None]
    torch.testing.assert_close(got[real], expected[real])
    assert (got[~real] == 0).all()
