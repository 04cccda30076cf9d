"""Compiled forwards hand their layers rotary tables written by one op (`hf_vegas.rotary_tables`): the same values,
one write per forward, nothing changed in eager forwards, and the model restored after the block."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model
from torch.profiler import ProfilerActivity, profile

from hf_vegas.rotary_tables import rotary_tables_once

ARCHS = ["llama", "qwen3", "gemma3"]


def _table_writes(run) -> tuple[torch.Tensor, int]:
    """`run()`'s output and how many times it called the tables op."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = run()
    return out, sum(e.name == "hf_vegas::rotary_tables" for e in prof.events())


@pytest.mark.parametrize("arch", ARCHS)
def test_a_compiled_forward_writes_the_tables_once_and_computes_the_same(arch):
    torch._dynamo.reset()
    model = tiny_model(arch)
    ids = torch.randint(3, 100, (2, 11), generator=torch.Generator().manual_seed(0))
    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in model.modules()
             if type(m).__name__.endswith("RotaryEmbedding")]
    with torch.no_grad():
        want = model(ids).logits
        for hook in hooks:
            hook.remove()
        with rotary_tables_once(model) as modules:
            assert modules >= 1
            eager, eager_writes = _table_writes(lambda: model(ids).logits)
            compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
            compiled(ids)  # compiles
            got, writes = _table_writes(lambda: compiled(ids).logits)
    assert eager_writes == 0 and torch.equal(eager, want)
    # one write per table pair the model computes (Gemma-3: one for its sliding layers, one for its global ones)
    assert writes == len(calls) >= 1, f"{writes} table writes for {len(calls)} rotary calls ({arch})"
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not any("forward" in vars(m) for m in model.modules())


def test_skip_leaves_the_modules_outputs_as_they_are():
    """While `skip()` holds (the draft steps of fused layers, which write their own tables), no op runs."""
    torch._dynamo.reset()
    model = tiny_model("llama")
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), rotary_tables_once(model, skip=lambda: True):
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
        compiled(ids)
        _, writes = _table_writes(lambda: compiled(ids))
    assert writes == 0


def test_the_model_is_restored_after_an_exception():
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match="inside"):
        with rotary_tables_once(model):
            assert any("forward" in vars(m) for m in model.modules())
            raise RuntimeError("inside")
    assert not any("forward" in vars(m) for m in model.modules())
