"""One-launch decode projections: the kernels against the reference ops, and the model swap they need undone."""

import pytest
import torch

from hf_vegas.fused_projections import MAX_ROWS, fused_projections
from hf_vegas.ops import reference
from kernel_cases import DEVICE, import_kernels
from tiny_models import BUILDERS, tiny_model

kernels = import_kernels()


def _assert_fp32_close(got, want):
    # fp32 products summed in another order: a few ulps of the largest magnitude involved
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("rows", [1, 7, 40, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_linear_matches_reference(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(DEVICE)
    weights = [torch.randn(n, 96, generator=gen).to(DEVICE) for n in (80, 48, 16)]
    biases = [torch.randn(n, generator=gen).to(DEVICE) for n in (80, 48, 16)] if with_bias else None
    _assert_fp32_close(kernels.grouped_linear(x, weights, biases), reference.grouped_linear(x, weights, biases))
    _assert_fp32_close(kernels.qkv_linear(x, *weights, *(biases or [None] * 3)),
                       reference.grouped_linear(x, weights, biases))
    _assert_fp32_close(kernels.grouped_linear(x, weights[:1], biases and biases[:1]),
                       reference.grouped_linear(x, weights[:1], biases and biases[:1]))


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
    _assert_fp32_close(kernels.grouped_linear(x, weights), reference.grouped_linear(x, weights))
    gate, up = (torch.randn(128, 96, generator=gen).to(DEVICE) for _ in range(2))
    _assert_fp32_close(kernels.gated_linear(x, gate, up, "silu"), reference.gated_linear(x, gate, up, "silu"))
    _assert_fp32_close(kernels.grouped_linear(x, [gate]), reference.grouped_linear(x, [gate]))


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
    want = reference.linear_residual(x, weight, residual)
    assert not torch.allclose(want, reference.grouped_linear(x, [weight])), "the residual must count"
    _assert_fp32_close(kernels.linear_residual(x, weight, residual), want)
    _assert_fp32_close(kernels.linear_residual_op(x, weight, residual), want)
    assert torch.equal(residual, before)
    with pytest.raises(ValueError, match="residual must be"):
        kernels.linear_residual(x, weight, residual[:, :8])


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_linear_matches_reference(act):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 96, generator=gen).to(DEVICE)
    w_gate, w_up = (torch.randn(48, 96, generator=gen).to(DEVICE) / 8 for _ in range(2))
    want = reference.gated_linear(x, w_gate, w_up, act)
    other = reference.gated_linear(x, w_gate, w_up, "silu" if act == "gelu_tanh" else "gelu_tanh")
    assert not torch.allclose(want, other), "the two activations must differ for this test to tell them apart"
    _assert_fp32_close(kernels.gated_linear_op(x, w_gate, w_up, act), want)


def test_linear_kernels_refuse_shapes_they_cannot_split():
    x = torch.randn(3, 32, device=DEVICE)
    with pytest.raises(ValueError, match="share a block of 16"):
        kernels.grouped_linear(x, [torch.randn(24, 32, device=DEVICE)])
    with pytest.raises(ValueError, match="act must be one of"):
        kernels.gated_linear(x, torch.randn(16, 32, device=DEVICE), torch.randn(16, 32, device=DEVICE), "relu")


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_fused_forward_matches_and_the_model_is_restored(arch):
    model = tiny_model(arch).to(DEVICE)
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    ids = torch.randint(1, 128, (3, 9), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        expected = model(ids).logits
        with fused_projections(model) as counts:
            got = model(ids).logits
    # Phi-3 already projects with one `qkv_proj` and one `gate_up_proj`; latent attention (DeepSeek-V3) has no q/k/v
    # projections.
    fusable = {"phi3": {"attention": 0, "mlp": 0}, "deepseek_v3": {"attention": 0, "mlp": layers}}
    assert counts == fusable.get(arch, {"attention": layers, "mlp": layers})
    _assert_fp32_close(got, expected)
    assert not any("forward" in vars(m) for m in model.modules()), "every instance forward must be removed"


def test_prefill_sized_forwards_keep_the_plain_projections(monkeypatch):
    model = tiny_model("llama").to(DEVICE)
    calls = []
    monkeypatch.setattr(kernels, "qkv_linear", lambda *args: calls.append("qkv") or reference.grouped_linear(
        args[0], args[1:4], None))
    ids = torch.randint(1, 128, (1, MAX_ROWS + 1)).to(DEVICE)
    with torch.no_grad(), fused_projections(model):
        model(ids[:, :4])
        assert calls == ["qkv"] * model.config.num_hidden_layers
        model(ids)
    assert calls == ["qkv"] * model.config.num_hidden_layers, "a prefill of more than MAX_ROWS rows uses cuBLAS"


def test_the_model_is_restored_after_an_exception():
    model = tiny_model("qwen3")
    with pytest.raises(RuntimeError, match="inside"):
        with fused_projections(model):
            raise RuntimeError("inside")
    assert not any("forward" in vars(m) for m in model.modules())


def test_hooked_and_unknown_modules_are_left_alone():
    model = tiny_model("llama")
    model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda *args: None)
    model.model.layers[1].mlp.act_fn = torch.nn.ReLU()
    with fused_projections(model) as counts:
        assert counts == {"attention": 2, "mlp": 2}
        assert "forward" not in vars(model.model.layers[0].self_attn.q_proj)
        assert "forward" not in vars(model.model.layers[1].mlp)


def test_layers_with_large_weights_use_the_kernels_only_for_the_fewest_rows(monkeypatch):
    """Weights above `MAX_WEIGHT_BYTES` (cuBLAS reaches the bandwidth from a few rows on) take the one-launch kernels
    in forwards of at most `LARGE_WEIGHT_MAX_ROWS` rows, small weights in any draft-sized forward."""
    from hf_vegas import fused_projections as module

    model = tiny_model("llama").to(DEVICE)
    calls = []
    monkeypatch.setattr(kernels, "qkv_linear", lambda *args: calls.append("qkv") or reference.grouped_linear(
        args[0], args[1:4], None))
    monkeypatch.setattr(kernels, "gated_linear_op", lambda x, gate, up, act: calls.append("mlp") or (
        torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())))
    few, more = module.LARGE_WEIGHT_MAX_ROWS, module.LARGE_WEIGHT_MAX_ROWS + 1
    ids = torch.randint(1, 128, (1, more)).to(DEVICE)
    layers = model.config.num_hidden_layers
    for limit, expected in ((0, ["qkv", "mlp"] * layers), (1 << 40, ["qkv", "mlp"] * 2 * layers)):
        monkeypatch.setattr(module, "MAX_WEIGHT_BYTES", limit)
        calls.clear()
        with torch.no_grad(), fused_projections(model) as counts:
            assert counts == {"attention": layers, "mlp": layers}
            want = model(ids).logits  # `more` rows: only small weights take the kernels
            model(ids[:, :few])
        assert calls == expected, f"MAX_WEIGHT_BYTES={limit}"
        _assert_fp32_close(want, model(ids).logits)


def test_only_draft_steps_use_the_fused_kernels(monkeypatch):
    """Verification and dense steps pick the tokens: they keep the model's own projections (the kernels round
    differently), so the output does not depend on the fusion."""
    from hf_vegas.attention import _ACTIVE
    from tiny_models import ragged_batch

    modes = []
    original = kernels.qkv_linear
    monkeypatch.setattr(kernels, "qkv_linear", lambda *args: modes.append(_ACTIVE.cache.plan.mode) or original(*args))
    model, (ids, mask) = tiny_model("qwen3").to(DEVICE), (t.to(DEVICE) for t in ragged_batch([30, 21]))
    common = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, custom_generate="vegas",
                  vegas_backend="triton", vegas_cuda_graphs=False)
    fused = model.generate(ids, **common, vegas_gamma=3)
    assert modes and set(modes) == {"draft"}
    assert torch.equal(fused, model.generate(ids, **common, vegas_gamma=3, vegas_fuse_projections=False))
    modes.clear()
    model.generate(ids, **common, vegas_gamma=0)
    assert modes == [], "the dense path never drafts"


def test_inputs_the_kernels_cannot_take_run_the_plain_projections(monkeypatch):
    model = tiny_model("llama").to(DEVICE)
    calls = []
    monkeypatch.setattr(kernels, "qkv_linear", lambda *args: calls.append(1) or reference.grouped_linear(
        args[0], args[1:4], None))
    ids = torch.randint(1, 128, (1, 4)).to(DEVICE)
    with torch.no_grad():
        with fused_projections(model, active=lambda: False):
            model(ids)
        assert calls == [], "inactive: the model's own projections"
        with fused_projections(model):
            attention = model.model.layers[0].self_attn
            x = torch.randn(1, 4, 64, dtype=torch.float64, device=DEVICE)
            with pytest.raises(RuntimeError):  # as nn.Linear does: float64 input, float32 weight
                attention.q_proj(x)
            assert calls == []
    transposed = tiny_model("llama").to(DEVICE)
    layer = transposed.model.layers[0].self_attn
    layer.q_proj.weight = torch.nn.Parameter(layer.q_proj.weight.detach().t().contiguous().t())
    with fused_projections(transposed) as counts:
        assert counts["attention"] == transposed.config.num_hidden_layers - 1, "strided weights are left alone"


@pytest.mark.parametrize("element_bytes", [2, 4])
@pytest.mark.parametrize("kind", ["qkv", "gated"])
def test_launch_settings_fit_in_shared_memory(kind, element_bytes):
    """fp32 inputs, and the gated kernel's two tiles, take fewer pipeline stages rather than failing to launch on a
    GPU (the tuned bf16 setting would need more shared memory than a block has)."""
    from hf_vegas_kernels import _launch, linear

    setting = linear._setting(kind, 64, [1536], element_bytes)
    tile = (setting["block_m"] + setting["block_n"]) * setting["block_k"] * element_bytes
    used = setting["num_stages"] * tile * (2 if kind == "gated" else 1)
    assert used <= _launch.LINEAR_SHARED_BYTES and setting["num_stages"] >= 1
    tuned = _launch.LINEAR_TUNING[kind]
    if element_bytes == 2 and kind == "qkv":
        assert setting == {**tuned, "block_n": 16}, "bf16 q/k/v fit as tuned"
    if element_bytes == 4 and kind == "gated":
        assert setting["num_stages"] < tuned["num_stages"]
