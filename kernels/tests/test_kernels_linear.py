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
    from hf_vegas_kernels import _launch, linear

    monkeypatch.setattr(linear, "INTERPRETER_BLOCK_N", 0)  # the tuned setting, also in the interpreter
    monkeypatch.setattr(_launch, "LINEAR_LARGE_WEIGHT_BYTES", 0)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(19, 96, generator=gen).to(DEVICE)
    weights = [torch.randn(n, 96, generator=gen).to(DEVICE) for n in (64, 32, 32)]
    assert linear._setting(kind, 19, [64], 4, 96)["block_n"] == _launch.LINEAR_TUNING[f"{kind}_large"]["block_n"]
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
    from hf_vegas_kernels import _launch, linear

    sizes = [3072, 3072] if kind == "gated" else [3072]
    setting = linear._setting(kind, 64, sizes, element_bytes, width)
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
    wide = linear._setting(kind, 4096, sizes, element_bytes, width)
    keeps_sums = ("block_m", "block_k", "num_warps") + (("block_n",) if kind == "linear" else ())
    assert {key: wide[key] for key in keeps_sums} == {**{key: setting[key] for key in keeps_sums},
                                                      "block_m": tuned["block_m"]}, "any row count sums alike"


# A tall launch's own settings, as a test sets them: fewer stages (more programs per SM), wider column blocks.
TALL = {"gated": {"tall_num_stages": 2, "tall_block_n": 32}, "qkv": {"tall_num_stages": 1, "tall_block_n": 32},
        "linear": {"tall_num_stages": 2}, "qkv_rope": {"tall_num_stages": 2}}


def _set_tall(monkeypatch, tall: bool) -> None:
    from hf_vegas_kernels import _launch

    for kind, keys in TALL.items():
        values = {key: value if tall else 0 for key, value in keys.items()}
        monkeypatch.setitem(_launch.LINEAR_TUNING, kind, {**_launch.LINEAR_TUNING[kind], **values})


def test_only_tall_launches_take_the_tall_settings_and_never_other_sums(monkeypatch):
    """A launch of more than 64 rows takes its kind's `tall_*` settings; a draft or dense step of 64 sequences keeps
    the tuned ones; nothing that orders a sum differs (row and K blocks; "linear"'s column blocks, which are the next
    norm's partial sums, take no tall setting at all)."""
    from hf_vegas_kernels import _launch, linear, qkv_rope

    _set_tall(monkeypatch, True)
    for kind in ("linear", "linear_large"):
        assert "tall_block_n" not in _launch.LINEAR_TUNING[kind], "a linear's column blocks are its norm's partials"
    assert set(_launch.LINEAR_TALL_KEYS) == {"num_stages", "block_n"}
    for kind, sizes in (("gated", [1536, 1536]), ("qkv", [576, 192, 192]), ("linear", [576])):
        one, tall = (linear._setting(kind, rows, sizes, 2, 576) for rows in (64, 448))
        tuned = _launch.LINEAR_TUNING[kind]
        assert one == {key: tuned[key] for key in one} and not any(key.startswith("tall") for key in one)
        assert tall["num_stages"] == TALL[kind]["tall_num_stages"]
        assert tall["block_n"] == TALL[kind].get("tall_block_n", tuned["block_n"])
        assert {key: tall[key] for key in ("block_m", "block_k", "num_warps")} == {
            key: one[key] for key in ("block_m", "block_k", "num_warps")}
    monkeypatch.setattr(linear, "INTERPRETER_BLOCK_N", 0)  # the GPU's column blocks, also in the interpreter
    assert linear.norm_partials(448, 576, torch.empty(448, 576)) == linear.norm_partials(64, 576, torch.empty(64, 576))
    # A tall tile that needs more shared memory takes fewer stages, never a shorter K step; one that fits in none
    # (fp32 gate/up at 128 columns) keeps the short launches' setting.
    monkeypatch.setitem(_launch.LINEAR_TUNING, "gated", {**_launch.LINEAR_TUNING["gated"], "tall_block_n": 128,
                                                         "tall_num_stages": 4})
    one, tall = (linear._setting("gated", rows, [1536, 1536], 2, 576) for rows in (64, 448))
    assert (tall["block_k"], tall["block_n"], tall["num_stages"]) == (one["block_k"], 128, 1)
    one, tall = (linear._setting("gated", rows, [1536, 1536], 4, 576) for rows in (64, 448))
    assert tall == one
    assert (qkv_rope._stages(16), qkv_rope._stages(64), qkv_rope._stages(448)) == (4, 4, 2), "tall above 64 rows"


@pytest.mark.parametrize("tall", [False, True])
def test_tall_launch_settings_compute_the_same_products(monkeypatch, tall, poison):
    """Under the tall settings (the GPU's column blocks, also in the interpreter) every projection kind computes
    its reference's product over rows that span several row blocks, from NaN-poisoned outputs."""
    from hf_vegas_kernels import linear

    monkeypatch.setattr(linear, "INTERPRETER_BLOCK_N", 0)
    _set_tall(monkeypatch, tall)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(70, 96, generator=gen).to(DEVICE)
    weights = [torch.randn(n, 96, generator=gen).to(DEVICE) / 8 for n in (64, 64, 64)]
    assert_fp32_close(kernels.grouped_linear(x, weights), naive.grouped_linear(x, weights))
    residual, norm_weight = torch.randn(70, 64, generator=gen).to(DEVICE), torch.rand(64, generator=gen).to(DEVICE)
    got, want = (ops.linear_residual_norm(x, weights[0], residual, norm_weight) for ops in (kernels, naive))
    assert_fp32_close(got[0], want[0])
    assert_fp32_close(got[2].sum(-1, keepdim=True), want[2])
    w_gate, w_up = (torch.randn(128, 64, generator=gen).to(DEVICE) / 8 for _ in range(2))
    assert_fp32_close(kernels.gated_linear(got[1], w_gate, w_up, "silu", got[2], 1e-5),
                      naive.gated_linear(naive.rms_norm(want[0], norm_weight, 1e-5), w_gate, w_up, "silu"))


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU: bit equality of pipeline stages and column blocks "
                    "is the GPU's (test_tall_launch_settings_compute_the_same_products checks the products on CPU)")
@pytest.mark.parametrize("seed", [3, 4, 5])
def test_tall_launches_round_exactly_as_one_row_block_does(monkeypatch, seed):
    """bf16 at SmolLM2's widths: a tall launch over a verification's 64 x 7 rows gives the very bits that seven
    launches of 64 rows (a dense step's, on the tuned settings) give, for the output projection with the next
    norm's partials and the gated MLP scaled by them, under the table's own tall settings and the test's; and
    q/k/v + rotary + cache write with its input norm and head norms the same bits under either."""
    from hf_vegas_kernels import _launch

    gen = torch.Generator().manual_seed(seed)
    bf16 = dict(dtype=torch.bfloat16, device=DEVICE)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(**bf16)

    spread = 1 + seed % 3  # inputs of several magnitudes
    x, residual, attn = randn(448, 576, scale=spread), randn(448, 576, scale=spread), randn(64, 7, 576)
    w_o, w_gate, w_up = randn(576, 576, scale=0.04), randn(1536, 576, scale=0.04), randn(1536, 576, scale=0.04)
    wq, wk, wv = randn(576, 576, scale=0.04), randn(192, 576, scale=0.04), randn(192, 576, scale=0.04)
    norm_weight, q_norm, k_norm = randn(576).abs() + 0.5, randn(64).abs() + 0.5, randn(64).abs() + 0.5
    angles = torch.rand(64, 7, 32, generator=gen).to(DEVICE) * 6
    cos, sin = (torch.cat([f(angles), f(angles)], -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    slots = torch.arange(7, device=DEVICE).repeat(64, 1) + 5

    def mlp_half(rows: slice):
        h, scaled, sumsq = kernels.linear_residual_norm(x[rows], w_o, residual[rows], norm_weight)
        return h, scaled, sumsq, kernels.gated_linear(scaled, w_gate, w_up, "silu", sumsq, 1e-5)

    def attention_half():
        sumsq = kernels.linear_residual_norm(x, w_o, residual, norm_weight)[2]
        caches = [torch.zeros(64, 16, 3, 64, **bf16) for _ in range(2)]
        q = kernels.qkv_rope_write(attn, wq, wk, wv, None, None, None, cos, sin, *caches, slots, 9, 3, 64, sumsq,
                                   1e-5, q_norm, k_norm, 1e-6)
        return q, *caches

    blocks = [mlp_half(slice(i, i + 64)) for i in range(0, 448, 64)]  # 64 rows each: not tall
    dense = [torch.cat(parts) for parts in zip(*blocks)]
    shipped = mlp_half(slice(None)), attention_half()  # the table's own tall settings
    for kind, setting in _launch.LINEAR_TUNING.items():
        monkeypatch.setitem(_launch.LINEAR_TUNING, kind, {key: 0 if key.startswith("tall_") else value
                                                          for key, value in setting.items()})
    tuned_attention = attention_half()
    _set_tall(monkeypatch, True)
    for which, (mlp, attention) in (("shipped", shipped), ("test's", (mlp_half(slice(None)), attention_half()))):
        for name, got, want in zip(("h", "scaled", "sumsq", "mlp"), mlp, dense):
            assert torch.equal(got, want), f"{name} of 448 rows rounds unlike 7 x 64 under the {which} settings"
        for name, got, want in zip(("q", "k", "v"), attention, tuned_attention):
            assert torch.equal(got, want), f"{name} rounds otherwise under the {which} tall settings"
