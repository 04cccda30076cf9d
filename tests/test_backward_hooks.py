"""Backward hooks set aside while a compiled generation runs (`hf_vegas.backward_hooks`): dynamo traces a forward
whose modules have them (transformers 5.17's tensor parallelism puts one on Qwen3's `q_norm` and `k_norm`) whole
inside the block and breaks its graph outside it; the block puts the same hook dicts back, also on an exception, and
does nothing with gradients on or when not enabled; `generate` sets them aside only with `vegas_compile=True`."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from hf_vegas.backward_hooks import backward_hooks_set_aside


def _hooked(arch: str = "qwen3"):
    """A tiny model whose attention layers' q/k norms carry full backward hooks, as transformers 5.17's TP installs."""
    model = tiny_model(arch).eval()
    fired = []
    norms = [layer.self_attn.q_norm for layer in model.model.layers] + [
        layer.self_attn.k_norm for layer in model.model.layers]
    for norm in norms:
        norm.register_full_backward_hook(lambda module, grad_in, grad_out: fired.append(module))
        norm.register_full_backward_pre_hook(lambda module, grad_out: None)
    return model, norms, fired


def _hook_dicts(modules):
    return [(id(m._backward_hooks), len(m._backward_hooks), id(m._backward_pre_hooks), len(m._backward_pre_hooks))
            for m in modules]


def test_a_compiled_forward_traces_whole_only_inside_the_block():
    model, norms, _ = _hooked()
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))

    def forward(ids):
        return model(ids, use_cache=False).logits

    with torch.no_grad():
        expected = forward(ids)
        torch._dynamo.reset()
        outside = torch._dynamo.explain(forward)(ids)
        assert outside.graph_break_count > 0, "the hooks must break the graph, else this test shows nothing"
        assert "backwards hooks" in str(outside.break_reasons[0].reason)
        torch._dynamo.reset()
        with backward_hooks_set_aside(model) as modules:
            assert modules == len(norms)
            assert all(not n._backward_hooks and not n._backward_pre_hooks for n in norms)
            compiled = torch.compile(forward, fullgraph=True, backend="aot_eager", dynamic=False)
            torch.testing.assert_close(compiled(ids), expected)
    torch._dynamo.reset()


def test_the_same_hooks_come_back_also_on_an_exception():
    model, norms, fired = _hooked()
    before = _hook_dicts(norms)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="inside"):
            with backward_hooks_set_aside(model):
                raise RuntimeError("inside")
    assert _hook_dicts(norms) == before
    # and they still fire in a backward pass
    model(torch.tensor([[5, 6, 7]])).logits.sum().backward()
    assert len(fired) == len(norms)


def test_nothing_is_set_aside_with_gradients_on_or_when_not_enabled():
    model, norms, _ = _hooked()
    before = _hook_dicts(norms)
    with backward_hooks_set_aside(model) as modules:  # gradients on: a hook could fire
        assert modules == 0 and _hook_dicts(norms) == before
    with torch.no_grad(), backward_hooks_set_aside(model, enabled=False) as modules:
        assert modules == 0 and _hook_dicts(norms) == before


@pytest.mark.parametrize("compile", [True, False])
def test_generate_sets_them_aside_only_when_compiling(compile):
    model, norms, _ = _hooked()
    before = _hook_dicts(norms)
    seen = []
    handle = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args: seen.append(bool(module.q_norm._backward_hooks)))
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    try:
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, custom_generate="vegas",
                             vegas_gamma=2, vegas_sparsity=0.3, vegas_min_tokens=4, vegas_compile=compile)
    finally:
        handle.remove()
    assert seen and all(hooked is not compile for hooked in seen), seen
    assert _hook_dicts(norms) == before
    vanilla = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, vanilla)
