"""Tall projection launches (more than `_launch.LINEAR_TALL_ROWS` rows: a verification's 64 x 7): the `tall_*` launch
settings they may take change no order of any sum, so a verification rounds as the dense step of its rows. On CPU
the settings and the products; on a GPU the bits."""

import pytest
import torch
from hf_vegas_kernels import naive
from kernel_cases import DEVICE, assert_fp32_close, import_kernels

kernels = import_kernels()

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
    from hf_vegas_kernels import _launch, linear, linear_settings, qkv_rope

    _set_tall(monkeypatch, True)
    for kind in ("linear", "linear_large"):
        assert "tall_block_n" not in _launch.LINEAR_TUNING[kind], "a linear's column blocks are its norm's partials"
    assert set(_launch.LINEAR_TALL_KEYS) == {"num_stages", "block_n"}
    for kind, sizes in (("gated", [1536, 1536]), ("qkv", [576, 192, 192]), ("linear", [576])):
        one, tall = (linear_settings.launch_setting(kind, rows, sizes, 2, 576) for rows in (64, 448))
        tuned = _launch.LINEAR_TUNING[kind]
        assert one == {key: tuned[key] for key in one} and not any(key.startswith("tall") for key in one)
        assert tall["num_stages"] == TALL[kind]["tall_num_stages"]
        assert tall["block_n"] == TALL[kind].get("tall_block_n", tuned["block_n"])
        assert {key: tall[key] for key in ("block_m", "block_k", "num_warps")} == {
            key: one[key] for key in ("block_m", "block_k", "num_warps")}
    monkeypatch.setattr(linear, "INTERPRETER_BLOCK_N", 0)  # the GPU's column blocks, also in the interpreter
    assert linear.norm_partials(448, 576, torch.empty(448, 576)) == linear.norm_partials(64, 576, torch.empty(64, 576))
    # A tall tile that needs more shared memory takes fewer stages, never a shorter K step; one that fits in fewer
    # than two (bf16 gate/up at 128 columns, fp32 at 32) keeps the short launches' setting.
    monkeypatch.setitem(_launch.LINEAR_TUNING, "gated", {**_launch.LINEAR_TUNING["gated"], "tall_block_n": 64,
                                                         "tall_num_stages": 4})
    one, tall = (linear_settings.launch_setting("gated", rows, [1536, 1536], 2, 576) for rows in (64, 448))
    assert (tall["block_k"], tall["block_n"], tall["num_stages"]) == (one["block_k"], 64, 2)
    for element_bytes, block_n in ((2, 128), (4, 32)):
        monkeypatch.setitem(_launch.LINEAR_TUNING, "gated", {**_launch.LINEAR_TUNING["gated"],
                                                             "tall_block_n": block_n})
        one, tall = (linear_settings.launch_setting("gated", rows, [1536, 1536], element_bytes, 576)
                     for rows in (64, 448))
        assert tall == one
    monkeypatch.setitem(_launch.LINEAR_TUNING, "gated", {**_launch.LINEAR_TUNING["gated"], "tall_block_n": 8})
    with pytest.raises(ValueError, match="tall_block_n'] = 8: a column block is 16 or more"):
        linear_settings.launch_setting("gated", 448, [1536, 1536], 2, 576)
    monkeypatch.setitem(_launch.LINEAR_TUNING, "linear", {**_launch.LINEAR_TUNING["linear"], "tall_block_n": 32})
    with pytest.raises(ValueError, match="'linear'\\] takes no tall_block_n"):
        linear_settings.launch_setting("linear", 64, [576], 2, 576)  # at any row count: refused at once
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
@pytest.mark.parametrize(("seed", "act", "dtype", "width"), [
    (3, "silu", torch.bfloat16, 576), (4, "silu", torch.bfloat16, 576), (5, "silu", torch.bfloat16, 576),
    (6, "gelu_tanh", torch.bfloat16, 1024), (7, "silu", torch.float16, 576)])
def test_tall_launches_round_exactly_as_one_row_block_does(monkeypatch, seed, act, dtype, width):
    """A tall launch over a verification's 64 x 7 rows gives the very bits that seven launches of 64 rows (a dense
    step's, on the tuned settings) give, for the output projection with the next norm's partials and the gated MLP
    scaled by them, under the table's own tall settings and the test's; and q/k/v + rotary + cache write with its
    input norm and head norms the same bits under either. SmolLM2's widths (576 -> 1536) in bf16 over three seeds
    and input scales, a wider layer with the other activation, and fp16."""
    from hf_vegas_kernels import _launch

    gen = torch.Generator().manual_seed(seed)
    half = dict(dtype=dtype, device=DEVICE)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(**half)

    spread, inner = 1 + seed % 3, width * 8 // 3 // 64 * 64  # inputs of several magnitudes; the MLP's width
    x, residual, attn = randn(448, width, scale=spread), randn(448, width, scale=spread), randn(64, 7, width)
    w_o, w_gate, w_up = (randn(n, width, scale=width ** -0.5) for n in (width, inner, inner))
    wq, wk, wv = (randn(n, width, scale=width ** -0.5) for n in (576, 192, 192))
    norm_weight, q_norm, k_norm = randn(width).abs() + 0.5, randn(64).abs() + 0.5, randn(64).abs() + 0.5
    angles = torch.rand(64, 7, 32, generator=gen).to(DEVICE) * 6
    cos, sin = (torch.cat([f(angles), f(angles)], -1).to(dtype) for f in (torch.cos, torch.sin))
    slots = torch.arange(7, device=DEVICE).repeat(64, 1) + 5

    def mlp_half(rows: slice):
        h, scaled, sumsq = kernels.linear_residual_norm(x[rows], w_o, residual[rows], norm_weight)
        return h, scaled, sumsq, kernels.gated_linear(scaled, w_gate, w_up, act, sumsq, 1e-5)

    def attention_half():
        sumsq = kernels.linear_residual_norm(x, w_o, residual, norm_weight)[2]
        caches = [torch.zeros(64, 16, 3, 64, **half) for _ in range(2)]
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
