"""One-launch decode projections in the model: the swap they need, undone, and which forwards use them. The kernels'
own tests: `kernels/tests/test_kernels_linear.py`."""

import pytest
import torch

from hf_vegas.fused_projections import MAX_ROWS, fused_projections
from hf_vegas_kernels import naive
from kernel_cases import DEVICE, assert_fp32_close, import_kernels
from tiny_models import BUILDERS, tiny_model

kernels = import_kernels()


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
    assert counts == {**fusable.get(arch, {"attention": layers, "mlp": layers}), "output": 0}, "tiny weights: cuBLAS"
    assert_fp32_close(got, expected)
    assert not any("forward" in vars(m) for m in model.modules()), "every instance forward must be removed"


def test_prefill_sized_forwards_keep_the_plain_projections(monkeypatch):
    model = tiny_model("llama").to(DEVICE)
    calls = []
    monkeypatch.setattr(kernels, "qkv_linear", lambda *args: calls.append("qkv") or naive.grouped_linear(
        args[0], args[1:4], None))
    ids = torch.randint(1, 128, (1, MAX_ROWS + 1)).to(DEVICE)
    with torch.no_grad(), fused_projections(model):
        model(ids[:, :4])
        assert calls == ["qkv"] * model.config.num_hidden_layers
        model(ids)
    assert calls == ["qkv"] * model.config.num_hidden_layers, "a prefill of more than MAX_ROWS rows uses cuBLAS"


def test_the_model_is_restored_after_an_exception(monkeypatch):
    from hf_vegas import fused_projections as module

    monkeypatch.setattr(module, "MAX_WEIGHT_BYTES", 0)  # "large" weights: the output projections are patched too
    model = tiny_model("qwen3")
    with pytest.raises(RuntimeError, match="inside"):
        with fused_projections(model) as counts:
            assert counts["output"] == 2 * model.config.num_hidden_layers
            raise RuntimeError("inside")
    assert not any("forward" in vars(m) for m in model.modules())


def test_hooked_and_unknown_modules_are_left_alone():
    model = tiny_model("llama")
    model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda *args: None)
    model.model.layers[1].mlp.act_fn = torch.nn.ReLU()
    with fused_projections(model) as counts:
        assert counts == {"attention": 2, "mlp": 2, "output": 0}
        assert "forward" not in vars(model.model.layers[0].self_attn.q_proj)
        assert "forward" not in vars(model.model.layers[1].mlp)


def test_layers_with_large_weights_use_the_kernels_only_for_the_fewest_rows(monkeypatch):
    """Weights above `MAX_WEIGHT_BYTES` (cuBLAS reaches the bandwidth from a few rows on) take the one-launch kernels
    in forwards of at most `LARGE_WEIGHT_MAX_ROWS` rows, and so do their output and down projections (the tuned
    kernel reads them faster there); small weights take the fused kernels in any draft-sized forward and keep cuBLAS
    for the single projections."""
    from hf_vegas import fused_projections as module

    model = tiny_model("llama").to(DEVICE)
    calls = []
    monkeypatch.setattr(kernels, "qkv_linear", lambda *args: calls.append("qkv") or naive.grouped_linear(
        args[0], args[1:4], None))
    monkeypatch.setattr(kernels, "gated_linear_op", lambda x, gate, up, act: calls.append("mlp") or (
        torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())))
    original = kernels.linear_op
    monkeypatch.setattr(kernels, "linear_op", lambda *args: calls.append("one") or original(*args))
    few, more = module.LARGE_WEIGHT_MAX_ROWS, module.LARGE_WEIGHT_MAX_ROWS + 1
    ids = torch.randint(1, 128, (1, more)).to(DEVICE)
    layers = model.config.num_hidden_layers
    for limit, expected, singles in ((0, ["qkv", "one", "mlp", "one"] * layers, 2 * layers),
                                     (1 << 40, ["qkv", "mlp"] * 2 * layers, 0)):
        monkeypatch.setattr(module, "MAX_WEIGHT_BYTES", limit)
        calls.clear()
        with torch.no_grad(), fused_projections(model) as counts:
            assert counts == {"attention": layers, "mlp": layers, "output": singles}
            want = model(ids).logits  # `more` rows: only small weights take the kernels
            got = model(ids[:, :few]).logits
        assert calls == expected, f"MAX_WEIGHT_BYTES={limit}"
        assert_fp32_close(want, model(ids).logits)
        assert_fp32_close(got, model(ids[:, :few]).logits)
    assert not any("forward" in vars(m) for m in model.modules()), "the output projections are restored too"


@pytest.mark.parametrize("large", [False, True], ids=["small-weights", "large-weights"])
def test_only_draft_steps_use_the_fused_kernels(monkeypatch, large):
    """Verification and dense steps pick the tokens: layers outside the fused layers (`hf_vegas.fused_layers`, which
    this test's model keeps out) keep their own projections there, so the output does not depend on this fusion."""
    from hf_vegas import fused_projections as module
    from hf_vegas.attention import _ACTIVE
    from tiny_models import ragged_batch

    if large:  # the output and down projections take the kernel too (in steps of at most 16 rows)
        monkeypatch.setattr(module, "MAX_WEIGHT_BYTES", 0)
    modes = {"qkv_linear": [], "linear_op": []}
    for name in modes:
        original = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *args, name=name, original=original: modes[name].append(
            _ACTIVE.cache.plan.mode) or original(*args))
    # (Mistral: its attention's code is not Llama's or Qwen3's, so its draft layers keep their forward and the
    # projections take the fused kernels; Llama's and Qwen3's draft layers run `fused_layers`' launches instead.)
    model, (ids, mask) = tiny_model("mistral").to(DEVICE), (t.to(DEVICE) for t in ragged_batch([30, 21]))
    common = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, custom_generate="vegas",
                  vegas_backend="triton", vegas_cuda_graphs=False)
    fused = model.generate(ids, **common, vegas_gamma=3)
    assert modes["qkv_linear"] and set(modes["qkv_linear"]) == {"draft"}
    assert set(modes["linear_op"]) == ({"draft"} if large else set()), modes["linear_op"]
    assert torch.equal(fused, model.generate(ids, **common, vegas_gamma=3, vegas_fuse_projections=False))
    for seen in modes.values():
        seen.clear()
    model.generate(ids, **common, vegas_gamma=0)
    assert modes == {"qkv_linear": [], "linear_op": []}, "the dense path never drafts"


def test_inputs_the_kernels_cannot_take_run_the_plain_projections(monkeypatch):
    model = tiny_model("llama").to(DEVICE)
    calls = []
    monkeypatch.setattr(kernels, "qkv_linear", lambda *args: calls.append(1) or naive.grouped_linear(
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
