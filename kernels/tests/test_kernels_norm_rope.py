"""A fused layer's own kernels (`norm.py`, `qkv_rope.py`): RMSNorm, and the q/k/v projection with its rotary
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


def _heads_case(tokens, heads, seed, with_bias=False, head_norm=False, batch=19, slots=11, width=40):
    """Inputs of a q/k/v + rotary + cache-write case: `x`, the three weights and biases, `cos`, `sin`, the slots,
    four NaN caches (two for the reference, two for the kernel) and, with `head_norm`, Qwen3-like head norm
    weights far from one and their eps."""
    q_heads, kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, width, generator=gen).to(DEVICE)
    weights = [torch.randn(h * head_dim, width, generator=gen).to(DEVICE) / 4 for h in (q_heads, kv_heads, kv_heads)]
    biases = [torch.randn(w.shape[0], generator=gen).to(DEVICE) if with_bias else None for w in weights]
    angles = torch.rand(batch, tokens, head_dim // 2, generator=gen).to(DEVICE) * 6
    cos = torch.cat([angles.cos(), (angles + 0.3).cos()], dim=-1)
    sin = torch.cat([angles.sin(), (angles + 0.3).sin()], dim=-1)
    slot_ids = torch.stack([torch.randperm(slots, generator=gen)[:tokens] for _ in range(batch)]).to(DEVICE)
    caches = [torch.full((batch, slots, kv_heads, head_dim), NAN, device=DEVICE) for _ in range(4)]
    norms = ((torch.rand(head_dim, generator=gen) * 2 + 0.2).to(DEVICE), (torch.rand(head_dim, generator=gen) + 1).to(
        DEVICE), 1e-3) if head_norm else (None, None, 0.0)
    return x, weights, biases, cos, sin, slot_ids, caches, norms


def _assert_same_caches(caches):
    for got, want in ((caches[2], caches[0]), (caches[3], caches[1])):
        assert torch.equal(got.isnan(), want.isnan()), "only the given slots are written"
        assert_fp32_close(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("heads", [(6, 2, 20), (4, 4, 16), (3, 1, 64)])
@pytest.mark.parametrize("extras", ["none", "bias", "bias and head norms"])
def test_qkv_rope_write_matches_reference(tokens, heads, extras, poison):
    """The projection, (Qwen3's head norms,) rotation and cache write of one launch against the reference's
    composition: rows that span several row blocks (19 x 3 tokens), odd head counts, a head dim whose half (10) is no
    power of two, input width 40 (not a multiple of the K block); caches NaN outside the written slots, outputs from
    NaN-poisoned buffers."""
    with_bias, head_norm = extras != "none", "norms" in extras
    x, weights, biases, cos, sin, slot_ids, caches, norms = _heads_case(
        tokens, heads, tokens * 7 + heads[2] + with_bias + 2 * head_norm, with_bias, head_norm)
    want_q = naive.qkv_rope_write(x, *weights, *biases, cos, sin, caches[0], caches[1], slot_ids, *heads, None, 0.0,
                                  *norms)
    got_q = kernels.qkv_rope_write(x, *weights, *biases, cos, sin, caches[2], caches[3], slot_ids, *heads, None, 0.0,
                                   *norms)
    assert_fp32_close(got_q, want_q)
    _assert_same_caches(caches)
    # The reference is the two-launch path it replaces, kept in fp32 until the rotation.
    qkv = naive.grouped_linear(x, weights, biases if with_bias else None)
    two_step = [torch.full_like(caches[0], NAN) for _ in range(2)]
    assert_fp32_close(naive.rope_write_kv(qkv, cos, sin, *two_step, slot_ids, *heads, *norms), want_q)
    assert_fp32_close(two_step[0].nan_to_num(), caches[0].nan_to_num())


def test_head_norms_are_transformers_qwen3_norms(poison):
    """The reference's head norms are Qwen3's own `q_norm` / `k_norm` modules, applied before the rotation."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    heads = (4, 2, 16)
    x, weights, _, cos, sin, slot_ids, caches, norms = _heads_case(1, heads, 3, head_norm=True, batch=3)
    q_norm, k_norm = Qwen3RMSNorm(16, eps=norms[2]).to(DEVICE), Qwen3RMSNorm(16, eps=norms[2]).to(DEVICE)
    q_norm.weight.data, k_norm.weight.data = norms[0], norms[1]
    with torch.no_grad():
        q = q_norm((x @ weights[0].T).view(3, 1, 4, 16)).transpose(1, 2)
        k = k_norm((x @ weights[1].T).view(3, 1, 2, 16)).transpose(1, 2)
        want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q = naive.qkv_rope_write(x, *weights, None, None, None, cos, sin, caches[0], caches[1], slot_ids, *heads,
                                 None, 0.0, *norms)
    assert_fp32_close(got_q, want_q.transpose(1, 2))
    rows = torch.arange(3, device=DEVICE)
    assert_fp32_close(caches[0][rows, slot_ids[:, 0]], want_k[:, :, 0])


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("heads", [(6, 2, 24), (3, 1, 64)])  # (sizes a block of 16 divides, for `qkv_linear`)
@pytest.mark.parametrize("head_norm", [False, True])
def test_rope_write_kv_matches_reference(tokens, heads, head_norm, poison):
    """The launch after a large projection (`qkv_linear`): the same queries and cache writes as the reference, and
    with that projection the same as the one launch of `qkv_rope_write`, its input norm folded into the projection
    (`row_sumsq`) with the biases after the row scale."""
    x, weights, biases, cos, sin, slot_ids, caches, norms = _heads_case(tokens, heads, 5 + tokens + head_norm,
                                                                        True, head_norm)
    qkv = torch.randn(x.shape[0], tokens, sum(w.shape[0] for w in weights), device=DEVICE)
    want_q = naive.rope_write_kv(qkv, cos, sin, caches[0], caches[1], slot_ids, *heads, *norms)
    got_q = kernels.rope_write_kv(qkv, cos, sin, caches[2], caches[3], slot_ids, *heads, *norms)
    assert_fp32_close(got_q, want_q)
    _assert_same_caches(caches)

    sumsq = torch.rand(x.shape[0] * tokens, 3, device=DEVICE) * x.shape[-1]
    one_launch = [torch.full_like(caches[0], NAN) for _ in range(2)]
    want_q = kernels.qkv_rope_write(x, *weights, *biases, cos, sin, *one_launch, slot_ids, *heads, sumsq, 1e-5,
                                    *norms)
    product = kernels.qkv_linear(x, *weights, *biases, sumsq, 1e-5)
    assert_fp32_close(product, naive.grouped_linear(x, weights, biases, sumsq, 1e-5))
    got_q = kernels.rope_write_kv(product, cos, sin, caches[2], caches[3], slot_ids, *heads, *norms)
    assert_fp32_close(got_q, want_q)
    _assert_same_caches([*one_launch, *caches[2:]])


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


def test_head_norms_come_in_pairs_of_head_dim_vectors():
    x, weights, _, cos, sin, slot_ids, caches, norms = _heads_case(1, (4, 2, 16), 1, head_norm=True, batch=2)
    qkv = torch.randn(2, 1, 128, device=DEVICE)
    with pytest.raises(ValueError, match="q_norm and k_norm must both be"):
        kernels.qkv_rope_write(x, *weights, None, None, None, cos, sin, caches[0], caches[1], slot_ids, 4, 2, 16, None,
                               0.0, norms[0], None, 1e-6)
    with pytest.raises(ValueError, match="q_norm and k_norm must both be"):
        kernels.rope_write_kv(qkv, cos, sin, caches[0], caches[1], slot_ids, 4, 2, 16, norms[0], norms[1][:8], 1e-6)
    with pytest.raises(ValueError, match="of one dtype"):
        kernels.rope_write_kv(qkv, cos, sin, caches[0], caches[1], slot_ids, 4, 2, 16, norms[0], norms[1].double(),
                              1e-6)
    with pytest.raises(ValueError, match="rope_write_kv: qkv must hold 4 \\+ 2 x 2 heads"):
        kernels.rope_write_kv(qkv[..., :96], cos, sin, caches[0], caches[1], slot_ids, 4, 2, 16)
