"""Compiled forwards hand their layers rotary tables written by one op (`hf_vegas.rotary_tables`): the same values,
one write per forward, nothing changed in eager forwards, and the model restored after the block."""

from __future__ import annotations

import shutil

import pytest
import torch
from accelerate.hooks import ModelHook, add_hook_to_module
from tiny_models import tiny_model
from torch.profiler import ProfilerActivity, profile

import hf_vegas
from hf_vegas.graphs import INDUCTOR_OPTIONS
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


class _Counting(ModelHook):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        if not torch.compiler.is_compiling():  # (a count changed while tracing would recompile every call)
            self.calls += 1
        return args, kwargs


def test_a_module_s_own_forward_is_called_and_put_back():
    """An instance-level `forward` a rotary module already has (accelerate's hooks live there: `device_map` places
    the rotary module like a layer) keeps running inside the block and is the module's forward again after it."""
    torch._dynamo.reset()
    model = tiny_model("llama")
    rotary = model.model.rotary_emb
    hook = _Counting()
    add_hook_to_module(rotary, hook)
    hooked = vars(rotary)["forward"]
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
        assert hook.calls == 1
        with rotary_tables_once(model):
            model(ids)
            assert hook.calls == 2  # the module's own forward runs inside the block
            compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
            compiled(ids)
            got, writes = _table_writes(lambda: compiled(ids).logits)
            assert writes == 1
        model(ids)
    assert vars(rotary)["forward"] is hooked and hook.calls == 3
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_generate_leaves_a_hooked_rotary_module_as_it_was():
    model = tiny_model("llama")
    hook = _Counting()
    add_hook_to_module(model.model.rotary_emb, hook)
    hooked = vars(model.model.rotary_emb)["forward"]
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(3))
    want = model.generate(ids, max_new_tokens=6, do_sample=False)
    calls = hook.calls
    got = model.generate(ids, custom_generate=hf_vegas.generate, max_new_tokens=6, do_sample=False, vegas_gamma=2,
                         vegas_compile=True, vegas_sparsity=0.5, vegas_min_tokens=2)
    assert torch.equal(got, want) and hook.calls > calls
    assert vars(model.model.rotary_emb)["forward"] is hooked
    assert not any("forward" in vars(m) for m in model.modules() if m is not model.model.rotary_emb)


def _has_cpp_compiler() -> bool:
    return any(shutil.which(name) for name in ("g++", "c++", "clang++"))


def test_inductor_rotations_round_as_before():
    """Compiled as the steps compile (`INDUCTOR_OPTIONS`), bf16, at positions where the angles are large: the logits
    with the tables from the op equal those inductor computes with the tables inlined, bit for bit."""
    if not _has_cpp_compiler():
        pytest.skip("inductor on the CPU needs a C++ compiler (g++, c++ or clang++), and this machine has none")
    torch._dynamo.reset()
    model = tiny_model("llama").to(torch.bfloat16)
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(900, 907)[None].expand(2, -1)

    def compiled_forward():
        torch._dynamo.reset()
        compiled = torch.compile(model, dynamic=False, options=INDUCTOR_OPTIONS)
        compiled(ids, position_ids=positions)  # compiles
        return lambda: compiled(ids, position_ids=positions).logits

    with torch.no_grad():
        inlined = compiled_forward()()
        with rotary_tables_once(model):
            tabled, writes = _table_writes(compiled_forward())
    assert writes == 1
    torch.testing.assert_close(tabled, inlined, rtol=0, atol=0)
