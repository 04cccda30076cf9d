"""One-launch decode projections (`linear.py`: q/k/v in one launch, gate/up with the activation, output with the
residual) against the naive ops, under every launch setting, on NaN-poisoned outputs; shapes they refuse."""

import pytest
import torch
from hf_vegas_kernels import naive
from kernel_cases import DEVICE, assert_fp32_close, import_kernels

kernels = import_kernels()


@pytest.mark.parametrize("rows", [1, 7, 40, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_linear_matches_reference(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(DEVICE)
    weights = [torch.randn(n, 96, generator=gen).to(DEVICE) for n in (80, 48, 16)]
    biases = [torch.randn(n, generator=gen).to(DEVICE) for n in (80, 48, 16)] if with_bias else None
    assert_fp32_close(kernels.grouped_linear(x, weights, biases), naive.grouped_linear(x, weights, biases))
    assert_fp32_close(kernels.qkv_linear(x, *weights, *(biases or [None] * 3)),
                       naive.grouped_linear(x, weights, biases))
    assert_fp32_close(kernels.grouped_linear(x, weights[:1], biases and biases[:1]),
                       naive.grouped_linear(x, weights[:1], biases and biases[:1]))
    assert_fp32_close(kernels.linear_op(x, weights[0], biases and biases[0]),
                       naive.grouped_linear(x, weights[:1], biases and biases[:1]))


@pytest.mark.parametrize("kind", ["qkv", "gated", "linear"])
def test_large_weight_settings_compute_the_same_product(monkeypatch, kind):
    """The "_large" launch settings (wide column blocks, a K block longer than this K, deep pipelines), taken here by
    small weights with the threshold at 0, on rows that fill one tile and part of another."""
    from hf_vegas_kernels import _launch, linear, linear_settings

    monkeypatch.setattr(linear, "INTERPRETER_BLOCK_N", 0)  # the tuned setting, also in the interpreter
    monkeypatch.setattr(_launch, "LINEAR_LARGE_WEIGHT_BYTES", 0)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(19, 96, generator=gen).to(DEVICE)
    weights = [torch.randn(n, 96, generator=gen).to(DEVICE) for n in (64, 32, 32)]
    large = _launch.LINEAR_TUNING[f"{kind}_large"]
    assert linear_settings.launch_setting(kind, 19, [64], 4, 96)["block_n"] == large["block_n"]
    if kind == "gated":
        got, want = kernels.gated_linear(x, weights[1], weights[2], "silu"), naive.gated_linear(
            x, weights[1], weights[2], "silu")
    else:
        used = weights if kind == "qkv" else weights[:1]
        got, want = kernels.grouped_linear(x, used), naive.grouped_linear(x, used)
    assert_fp32_close(got, want)


@pytest.mark.parametrize("setting", [dict(block_m=16, block_n=16, block_k=32, num_warps=2, num_stages=2),
                                     dict(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=4)])
def test_linear_kernels_under_other_launch_settings(monkeypatch, setting):
    """Every tuned setting computes the same product: several row tiles, column blocks that narrow to fit a segment
    (48 and 80 take 16 even where 128 is allowed), a K block longer than K."""
    from hf_vegas_kernels import _launch, linear

    monkeypatch.setattr(linear, "INTERPRETER_BLOCK_N", 0)  # the settings under test, also in the interpreter
    for kind in _launch.LINEAR_TUNING:
        monkeypatch.setitem(_launch.LINEAR_TUNING, kind, setting)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(50, 96, generator=gen).to(DEVICE)
    weights = [torch.randn(n, 96, generator=gen).to(DEVICE) for n in (80, 48, 16)]
    assert_fp32_close(kernels.grouped_linear(x, weights), naive.grouped_linear(x, weights))
    gate, up = (torch.randn(128, 96, generator=gen).to(DEVICE) for _ in range(2))
    assert_fp32_close(kernels.gated_linear(x, gate, up, "silu"), naive.gated_linear(x, gate, up, "silu"))
    assert_fp32_close(kernels.grouped_linear(x, [gate]), naive.grouped_linear(x, [gate]))
    # The norm's partial sums: as many as this setting's column blocks, each written, summing to the row's squares.
    residual, norm_weight = torch.randn(50, 96, generator=gen).to(DEVICE), torch.rand(96, generator=gen).to(DEVICE)
    w_o = torch.randn(96, 96, generator=gen).to(DEVICE) / 8
    h, scaled, sumsq = kernels.linear_residual_norm(x, w_o, residual, norm_weight)
    assert sumsq.shape == (50, 96 // linear.block_n_for(96, widest=setting["block_n"]))
    want_h, want_scaled, want_sumsq = naive.linear_residual_norm(x, w_o, residual, norm_weight)
    assert_fp32_close(sumsq.sum(-1, keepdim=True), want_sumsq)
    assert_fp32_close(kernels.gated_linear(scaled, gate[:, :96], up[:, :96], "silu", sumsq, 1e-5),
                      naive.gated_linear(naive.rms_norm(want_h, norm_weight, 1e-5), gate[:, :96], up[:, :96], "silu"))


@pytest.mark.parametrize("rows", [1, 7, 70])
@pytest.mark.parametrize("size", [48, 40])
def test_linear_residual_matches_reference(rows, size, monkeypatch):
    """`residual + x @ w.T` in one launch, from a NaN-poisoned output buffer; an output size no block of 16 divides
    (40) takes `torch.addmm`. The residual is a view with a row stride of its own, and stays untouched."""
    from hf_vegas_kernels import _launch

    monkeypatch.setattr(_launch, "empty", lambda *shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                                  device=device))
    gen = torch.Generator().manual_seed(rows + size)
    x = torch.randn(rows, 96, generator=gen).to(DEVICE)
    weight = torch.randn(size, 96, generator=gen).to(DEVICE) / 8
    residual = torch.randn(rows, size + 8, generator=gen).to(DEVICE)[:, :size]
    before = residual.clone()
    want = naive.linear_residual(x, weight, residual)
    assert not torch.allclose(want, naive.grouped_linear(x, [weight])), "the residual must count"
    assert_fp32_close(kernels.linear_residual(x, weight, residual), want)
    assert_fp32_close(kernels.linear_residual_op(x, weight, residual), want)
    assert torch.equal(residual, before)
    with pytest.raises(ValueError, match="residual must be"):
        kernels.linear_residual(x, weight, residual[:, :8])


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_linear_matches_reference(act):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 96, generator=gen).to(DEVICE)
    w_gate, w_up = (torch.randn(48, 96, generator=gen).to(DEVICE) / 8 for _ in range(2))
    want = naive.gated_linear(x, w_gate, w_up, act)
    other = naive.gated_linear(x, w_gate, w_up, "silu" if act == "gelu_tanh" else "gelu_tanh")
    assert not torch.allclose(want, other), "the two activations must differ for this test to tell them apart"
    assert_fp32_close(kernels.gated_linear_op(x, w_gate, w_up, act), want)


@pytest.mark.parametrize("rows", [1, 7, 70])
def test_linear_residual_norm_writes_what_the_next_norm_needs(rows, poison):
    """The output with the residual, the output times the next norm's weight, and partial sums of squares whose row
    sums are the rounded output's; from NaN-poisoned buffers, rows over several row tiles."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(DEVICE)
    weight = torch.randn(48, 96, generator=gen).to(DEVICE) / 8
    residual = torch.randn(rows, 48, generator=gen).to(DEVICE)
    norm_weight = torch.randn(48, generator=gen).to(DEVICE)
    out, scaled, sumsq = kernels.linear_residual_norm(x, weight, residual, norm_weight)
    want_out, want_scaled, want_sumsq = naive.linear_residual_norm(x, weight, residual, norm_weight)
    assert_fp32_close(out, want_out)
    assert_fp32_close(scaled, want_scaled)
    assert sumsq.dtype == torch.float32 and sumsq.shape[0] == rows
    assert_fp32_close(sumsq.sum(-1, keepdim=True), want_sumsq)
    with pytest.raises(ValueError, match="norm_weight"):
        kernels.linear_residual_norm(x, weight, residual, norm_weight[:16])
    with pytest.raises(ValueError, match="sumsq contiguous fp32"):  # a partial count the launch would not fill
        kernels.linear_residual_norm_into(x, weight, residual, norm_weight, out.clone(), scaled.clone(),
                                          torch.zeros(rows, sumsq.shape[1] + 1, device=DEVICE))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [3, 70])
def test_gated_linear_with_a_row_scale_is_the_mlp_of_the_norm(act, rows, poison):
    """Fed by `linear_residual_norm`, the gated projection computes the MLP of `rms_norm(h)` with no norm launch:
    against the naive ops both ways (the norm first, and the same row scale from the partial sums)."""
    gen = torch.Generator().manual_seed(rows)
    attn = torch.randn(rows, 64, generator=gen).to(DEVICE)
    w_o = torch.randn(96, 64, generator=gen).to(DEVICE) / 8
    residual = torch.randn(rows, 96, generator=gen).to(DEVICE)
    norm_weight = torch.rand(96, generator=gen).to(DEVICE) + 0.5
    w_gate, w_up = (torch.randn(48, 96, generator=gen).to(DEVICE) / 8 for _ in range(2))
    h, scaled, sumsq = kernels.linear_residual_norm(attn, w_o, residual, norm_weight)
    want = naive.gated_linear(naive.rms_norm(h, norm_weight, 1e-5), w_gate, w_up, act)
    assert_fp32_close(kernels.gated_linear_op(scaled, w_gate, w_up, act, sumsq, 1e-5), want)
    assert_fp32_close(naive.gated_linear(scaled, w_gate, w_up, act, sumsq, 1e-5), want)
    assert not torch.allclose(want, naive.gated_linear(scaled, w_gate, w_up, act)), "the row scale must count"
    with pytest.raises(ValueError, match="row_sumsq must be"):
        kernels.gated_linear(scaled, w_gate, w_up, act, sumsq[:1])


def test_linear_kernels_refuse_shapes_they_cannot_split():
    x = torch.randn(3, 32, device=DEVICE)
    with pytest.raises(ValueError, match="share a block of 16"):
        kernels.grouped_linear(x, [torch.randn(24, 32, device=DEVICE)])
    with pytest.raises(ValueError, match="act must be one of"):
        kernels.gated_linear(x, torch.randn(16, 32, device=DEVICE), torch.randn(16, 32, device=DEVICE), "relu")


@pytest.mark.parametrize("width", [576, 4096], ids=["small", "large"])
@pytest.mark.parametrize("element_bytes", [2, 4])
@pytest.mark.parametrize("kind", ["qkv", "gated", "linear"])
def test_launch_settings_fit_in_shared_memory(kind, element_bytes, width):
    """fp32 inputs, and the gated kernel's two tiles, take fewer pipeline stages rather than failing to launch on a
    GPU (the tuned bf16 setting would need more shared memory than a block has); weights of more than
    `LINEAR_LARGE_WEIGHT_BYTES` take their kind's "_large" setting."""
    from hf_vegas_kernels import _launch, linear_settings

    sizes = [3072, 3072] if kind == "gated" else [3072]
    setting = linear_settings.launch_setting(kind, 64, sizes, element_bytes, width)
    tile = (setting["block_m"] + setting["block_n"]) * setting["block_k"] * element_bytes
    used = setting["num_stages"] * tile * (2 if kind == "gated" else 1)
    assert used <= _launch.LINEAR_SHARED_BYTES and setting["num_stages"] >= 1
    large = sum(sizes) * width * element_bytes > _launch.LINEAR_LARGE_WEIGHT_BYTES
    assert large == (width == 4096), "the test's widths straddle the threshold"
    tuned = _launch.LINEAR_TUNING[f"{kind}_large" if large else kind]
    assert setting["block_n"] == tuned["block_n"] and setting["num_warps"] == tuned["num_warps"]
    if element_bytes == 2 and kind == "qkv" and not large:
        assert setting == {**{key: tuned[key] for key in setting}, "block_n": 16}, "bf16 q/k/v fit as tuned"
    if element_bytes == 4 and kind == "gated":
        assert setting["num_stages"] < tuned["num_stages"]
    wide = linear_settings.launch_setting(kind, 4096, sizes, element_bytes, width)
    keeps_sums = ("block_m", "block_k", "num_warps") + (("block_n",) if kind == "linear" else ())
    assert {key: wide[key] for key in keeps_sums} == {**{key: setting[key] for key in keeps_sums},
                                                      "block_m": tuned["block_m"]}, "any row count sums alike"
