"""A fused draft layer's own kernels (`norm.py`, `qkv_rope.py`): RMSNorm, and the q/k/v projection with its rotary
embedding and cache write in one launch, against the naive ops and transformers' Llama norm, from NaN-poisoned
buffers."""

import pytest
import torch
from hf_vegas_kernels import naive
from kernel_cases import DEVICE, NAN, assert_fp32_close, import_kernels

kernels = import_kernels()


@pytest.mark.parametrize("rows", [1, 7, 70])
@pytest.mark.parametrize("width", [96, 100])
def test_rms_norm_matches_reference(rows, width, poison):
    gen = torch.Generator().manual_seed(rows + width)
    x = (3 * torch.randn(2, rows, width, generator=gen) + 1).to(DEVICE)  # far from unit RMS: the scale matters
    weight = (torch.rand(width, generator=gen) + 0.5).to(DEVICE)
    assert_fp32_close(kernels.rms_norm(x, weight, 1e-5), naive.rms_norm(x, weight, 1e-5))


def test_rms_norm_matches_transformers_llama_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(48, eps=1e-6).to(DEVICE)
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    x = torch.randn(5, 48, device=DEVICE) * 4
    with torch.no_grad():
        assert_fp32_close(kernels.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))
        assert_fp32_close(naive.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))


def test_a_norm_weight_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="weight must be a contiguous \\(32,\\) vector"):
        kernels.rms_norm(torch.randn(3, 32, device=DEVICE), torch.ones(16, device=DEVICE), 1e-6)


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("heads", [(6, 2, 20), (4, 4, 16), (3, 1, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_qkv_rope_write_matches_reference(tokens, heads, with_bias, poison):
    """The projection, rotation and cache write of one launch against the reference's composition: rows that span
    several row blocks (19 x 3 tokens), odd head counts, a head dim whose half (10) is no power of two, input width 40
    (not a multiple of the K block); caches NaN outside the written slots, outputs from NaN-poisoned buffers."""
    q_heads, kv_heads, head_dim = heads
    batch, slots, width = 19, 11, 40
    gen = torch.Generator().manual_seed(tokens * 7 + head_dim + with_bias)
    x = torch.randn(batch, tokens, width, generator=gen).to(DEVICE)
    weights = [torch.randn(h * head_dim, width, generator=gen).to(DEVICE) / 4 for h in (q_heads, kv_heads, kv_heads)]
    biases = [torch.randn(w.shape[0], generator=gen).to(DEVICE) if with_bias else None for w in weights]
    angles = torch.rand(batch, tokens, head_dim // 2, generator=gen).to(DEVICE) * 6
    cos = torch.cat([angles.cos(), (angles + 0.3).cos()], dim=-1)
    sin = torch.cat([angles.sin(), (angles + 0.3).sin()], dim=-1)
    slot_ids = torch.stack([torch.randperm(slots, generator=gen)[:tokens] for _ in range(batch)]).to(DEVICE)
    caches = [torch.full((batch, slots, kv_heads, head_dim), NAN, device=DEVICE) for _ in range(4)]
    layout = (q_heads, kv_heads, head_dim)
    want_q = naive.qkv_rope_write(x, *weights, *biases, cos, sin, caches[0], caches[1], slot_ids, *layout)
    got_q = kernels.qkv_rope_write(x, *weights, *biases, cos, sin, caches[2], caches[3], slot_ids, *layout)
    assert_fp32_close(got_q, want_q)
    for got, want in ((caches[2], caches[0]), (caches[3], caches[1])):
        assert torch.equal(got.isnan(), want.isnan()), "only the given slots are written"
        assert_fp32_close(got.nan_to_num(), want.nan_to_num())
    # The reference is the two-launch path it replaces, kept in fp32 until the rotation.
    qkv = naive.grouped_linear(x, weights, biases if with_bias else None)
    two_step = [torch.full_like(caches[0], NAN) for _ in range(2)]
    assert_fp32_close(naive.rope_write_kv(qkv, cos, sin, *two_step, slot_ids, *layout), want_q)
    assert_fp32_close(two_step[0].nan_to_num(), caches[0].nan_to_num())


@pytest.mark.parametrize("with_bias", [False, True])
def test_qkv_rope_write_takes_its_input_norm_from_the_projection_before(with_bias, poison):
    """With `row_sumsq` (from `linear_residual_norm`), the launch projects `rms_norm(h)` given `h * norm_weight`: the
    same queries, keys and values as the norm first, the biases added after the row scale."""
    batch, tokens, width, layout = 5, 3, 48, (6, 2, 16)
    gen = torch.Generator().manual_seed(11 + with_bias)
    attn = torch.randn(batch * tokens, 32, generator=gen).to(DEVICE)
    w_o = torch.randn(width, 32, generator=gen).to(DEVICE) / 4
    residual = torch.randn(batch * tokens, width, generator=gen).to(DEVICE)
    norm_weight = torch.rand(width, generator=gen).to(DEVICE) + 0.5
    weights = [torch.randn(h * 16, width, generator=gen).to(DEVICE) / 4 for h in (6, 2, 2)]
    biases = [torch.randn(w.shape[0], generator=gen).to(DEVICE) if with_bias else None for w in weights]
    angles = torch.rand(batch, tokens, 8, generator=gen).to(DEVICE) * 6
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    slot_ids = torch.stack([torch.randperm(9, generator=gen)[:tokens] for _ in range(batch)]).to(DEVICE)
    caches = [torch.full((batch, 9, 2, 16), NAN, device=DEVICE) for _ in range(4)]
    h, scaled, sumsq = kernels.linear_residual_norm(attn, w_o, residual, norm_weight)
    normed = naive.rms_norm(h, norm_weight, 1e-6).view(batch, tokens, width)
    want_q = naive.qkv_rope_write(normed, *weights, *biases, cos, sin, caches[0], caches[1], slot_ids, *layout)
    got_q = kernels.qkv_rope_write(scaled.view(batch, tokens, width), *weights, *biases, cos, sin, caches[2],
                                   caches[3], slot_ids, *layout, sumsq, 1e-6)
    assert_fp32_close(got_q, want_q)
    for got, want in ((caches[2], caches[0]), (caches[3], caches[1])):
        assert torch.equal(got.isnan(), want.isnan()), "only the given slots are written"
        assert_fp32_close(got.nan_to_num(), want.nan_to_num())
    with pytest.raises(ValueError, match="row_sumsq must be"):
        kernels.qkv_rope_write(scaled.view(batch, tokens, width), *weights, *biases, cos, sin, caches[2], caches[3],
                               slot_ids, *layout, sumsq.double(), 1e-6)


def test_qkv_rope_write_refuses_weights_that_are_not_the_heads():
    x = torch.randn(2, 1, 32, device=DEVICE)
    weights = [torch.randn(n, 32, device=DEVICE) for n in (64, 16, 16)]
    cos = sin = torch.ones(2, 1, 16, device=DEVICE)
    cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="qkv_rope_write: weights"):
        kernels.qkv_rope_write(x, *weights, None, None, None, cos, sin, cache, cache.clone(),
                               torch.zeros(2, 1, dtype=torch.long, device=DEVICE), 3, 1, 16)
