"""The programmatic-dependent-launch variants of the kernels (`_pdl.py`), compiled for a Hopper GPU on any machine.

The CPU interpreter never runs them: it takes no launch option, and inline PTX (the L2 prefetches) means nothing to
it. So here they are compiled ahead of time for compute capability 9.0 with Triton's own `ptxas`, and the PTX is read
for what the launch protocol promises: the projections' weight prefetches before the wait, no load from memory before
it, and the next kernel released right after the wait (early) or after the main loop (late); the kernels without
that option (the score finalisation, the top-k selection) load nothing before their wait and release right after it.
The GPU tests run the same variants against the naive ops (`tests/test_fused_layers.py`, and every kernel test on a
GPU, where they are the default).
"""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# Pointer arguments that hold indices, and those that hold fp32 states; other pointers hold bf16 tensors.
INDEX_POINTERS = {"QSlot", "KvLen", "SelIdx", "SelCount", "TailStart", "ScoreRows", "Tickets", "Slots", "CandStart",
                  "CandEnd", "Count", "Layers"}
FP32_POINTERS = {"MPart", "LPart", "OPart", "Lse", "Sinks", "SumSqIn", "SumSqOut", "SumSq", "Cos", "Sin", "Scores",
                 "QNorm", "KNorm"}
INTEGERS = {"M", "K", "T", "N0", "N1", "N2"}  # (but the attention's K is its keys)
FLOATS = {"eps", "scaling", "softcap", "head_eps"}


def _ptx(kernel, constexprs: dict) -> str:
    """`kernel` compiled for compute capability 9.0 with `constexprs`: its PTX (the cubin is built too, so `ptxas`
    checks it). Run where Triton compiles (not in its interpreter): `_compiled` runs it in a fresh process."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def kind(name):
        if name in INDEX_POINTERS:
            return "*i32"
        if name in FP32_POINTERS:
            return "*fp32"
        if (name in INTEGERS and (name, kernel.__name__) != ("K", "_attend_list")) or name[0].islower():
            return "fp32" if name in FLOATS else "i32"
        return "*fp16" if name == "Emit" else "*bf16"

    signature = {p.name: "constexpr" if p.is_constexpr else kind(p.name) for p in kernel.params}
    missing = {p.name for p in kernel.params if p.is_constexpr} - set(constexprs)
    assert not missing, f"constexprs missing from the test: {sorted(missing)}"
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]
    return compiled.asm["ptx"]


def _first(ptx: str, pattern: str) -> int:
    lines = ptx.splitlines()
    found = [i for i, line in enumerate(lines) if re.search(pattern, line)]
    assert found, f"no {pattern!r} in the PTX"
    return found[0]


def _linear_constexprs(**flags):
    return dict(HAS_BIAS=False, HAS_RESIDUAL=False, GATED=True, ACT=1, ROW_SCALE=True, NORM_OUT=False, BLOCK_P=2,
                BLOCK_M=64, BLOCK_N=16, BLOCK_K=128, PRECISION="tf32", USE_GDC=True, K_LINES=16, **flags)


def _residual_norm_constexprs(**flags):  # an output or down projection: one weight, the residual, the next norm
    return dict(_linear_constexprs(**flags), GATED=False, ROW_SCALE=False, HAS_RESIDUAL=True, NORM_OUT=True)


def _attention_constexprs(**flags):  # (nothing to prefetch: its keys and values come after the wait)
    return dict(KV_HEADS=3, GROUPS=3, HEAD_DIM=64, V_DIM=64, BLOCK_M=16, BLOCK_N=128, BLOCK_D=64, BLOCK_DV=64,
                SPARSE=True, HAS_SOFTCAP=False, HAS_WINDOW=False, EMIT=0, EMIT_HALF=False, NUM_SCORE_ROWS=0,
                BLOCK_E=16, PRECISION="tf32", SINGLE=True, HAS_SINKS=False, FUSED_COMBINE=False, USE_GDC=True,
                EARLY_TRIGGER=flags["EARLY_TRIGGER"], HAS_TAIL_START=True, BALANCE=True, OFFSETS_32=True)


def _verify_attention_constexprs(**flags):  # a verification: 7 tokens, per-head scores, from slot 0, merged splits
    return dict(_attention_constexprs(**flags), BLOCK_M=32, BLOCK_N=64, SPARSE=False, EMIT=2, EMIT_HALF=True,
                NUM_SCORE_ROWS=2, SINGLE=False, FUSED_COMBINE=True, HAS_TAIL_START=False, BALANCE=False)


def _qkv_rope_constexprs(**flags):
    return dict(Q_HEADS=9, KV_HEADS=3, HEAD_DIM=64, HALF=32, HAS_BIAS=False, ROW_SCALE=True, HEAD_NORM=True,
                BLOCK_P=2, BLOCK_M=16,
                BLOCK_HALF=32, BLOCK_K=128, PRECISION="tf32", USE_GDC=True, K_LINES=16, **flags)


CASES = {
    "gated_linear": ("linear", "_grouped_linear", _linear_constexprs),
    "linear_residual_norm": ("linear", "_grouped_linear", _residual_norm_constexprs),
    # q/k/v of large weights with the input norm folded in (`qkv_linear(..., row_sumsq)`): one weight's tile, scaled
    "qkv_linear_row_scale": ("linear", "_grouped_linear", lambda **flags: dict(_linear_constexprs(**flags),
                                                                                 GATED=False, HAS_BIAS=True)),
    "sparse_attention": ("attention", "_attend_list", _attention_constexprs),
    "verify_attention": ("attention", "_attend_list", _verify_attention_constexprs),
    "qkv_rope_write": ("qkv_rope", "_qkv_rope_write", _qkv_rope_constexprs),
}
VARIANTS = {"early, prefetching": dict(EARLY_TRIGGER=True, PREFETCH=True),
            "late, no prefetch": dict(EARLY_TRIGGER=False, PREFETCH=False)}
NOTHING_TO_PREFETCH = {"sparse_attention", "verify_attention"}
# Kernels that always release the next one right after their wait (no option): the verification's score
# finalisation and the top-k selection after it.
WAIT_FIRST = {
    "finalize_scores": ("scores", "_finalize_scores",
                        dict(EMIT_HEADS=9, Q_HEADS=9, NUM_ROWS=2, WEIGHTS=True, MEAN_ROWS=True, BLOCK_H=16,
                             BLOCK_S=512, HAS_WINDOW=False, USE_GDC=True)),
    "select_topk_row": ("select", "_select_topk_row", dict(BLOCK_S=8192, WRITE_BLOCK=1024, USE_GDC=True)),
    # (after a large weights' own projection, `qkv_linear`: the head norms, rotation and cache write)
    "rope_write_kv": ("qkv_rope", "_rope_write_kv", dict(Q_HEADS=9, KV_HEADS=3, HEAD_DIM=64, HALF=32, HEAD_NORM=True,
                                                         BLOCK_M=16, BLOCK_HALF=32, USE_GDC=True)),
}


def _compile_all() -> dict:
    import importlib

    ptx = {}
    for case, (module, name, constexprs) in CASES.items():
        kernel = getattr(importlib.import_module(f"hf_vegas_kernels.{module}"), name)
        ptx[case] = {variant: _ptx(kernel, constexprs(**flags)) for variant, flags in VARIANTS.items()}
    for case, (module, name, constexprs) in WAIT_FIRST.items():
        ptx[case] = _ptx(getattr(importlib.import_module(f"hf_vegas_kernels.{module}"), name), constexprs)
    return ptx


@pytest.fixture(scope="module")
def compiled():
    """Every case's PTX, compiled in a fresh process outside Triton's interpreter (which the CPU tests run under)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    run = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600)
    if run.returncode != 0 and "ptxas" in run.stderr and "No such file" in run.stderr:
        pytest.skip(f"this Triton install has no ptxas to compile for a GPU: {run.stderr.splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefetches_come_before_the_wait_and_the_early_release_right_after_it(compiled, case):
    ptx = compiled[case]["early, prefetching"]
    wait, release = _first(ptx, r"griddepcontrol\.wait"), _first(ptx, r"griddepcontrol\.launch_dependents")
    assert wait < release < _first(ptx, r"\bmma")
    if case not in NOTHING_TO_PREFETCH:
        assert _first(ptx, r"prefetch\.global\.L2") < wait
    loads = [line for line in ptx.splitlines()[:wait] if re.search(r"\bld\.global|\bcp\.async", line)]
    assert not loads, f"loads from memory before the wait: {loads}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_without_the_options_nothing_is_prefetched_and_the_release_follows_the_main_loop(compiled, case):
    ptx = compiled[case]["late, no prefetch"]
    assert "prefetch" not in ptx
    lines = ptx.splitlines()
    last_mma = max(i for i, line in enumerate(lines) if re.search(r"\bmma", line))
    assert _first(ptx, r"griddepcontrol\.wait") < last_mma < _first(ptx, r"griddepcontrol\.launch_dependents")


@pytest.mark.parametrize("case", sorted(WAIT_FIRST))
def test_kernels_that_release_at_once_load_nothing_before_their_wait(compiled, case):
    ptx = compiled[case]
    wait, release = _first(ptx, r"griddepcontrol\.wait"), _first(ptx, r"griddepcontrol\.launch_dependents")
    assert wait < release
    loads = [line for line in ptx.splitlines()[:wait] if re.search(r"\bld\.global|\bcp\.async", line)]
    assert not loads, f"loads from memory before the wait: {loads}"
    assert "prefetch" not in ptx


def test_weights_are_prefetched_only_where_they_fit_a_share_of_l2(monkeypatch):
    """Larger weights would evict each other's prefetched lines before use (Qwen3-8B's gate/up: 201 MB a launch)."""
    import torch
    from hf_vegas_kernels import _launch

    monkeypatch.setattr(_launch, "pdl", lambda device: True)  # as on a Hopper GPU
    monkeypatch.setattr(_launch, "_l2_bytes", lambda index: 50 << 20)
    gpu = torch.device("cuda", 0)
    share = int(_launch.PDL["prefetch_l2_fraction"] * (50 << 20))

    def weights(nbytes):  # (two weights of that many bytes together, shapes only)
        return [torch.empty(nbytes // 2, dtype=torch.uint8, device="meta"),
                torch.empty(nbytes - nbytes // 2, dtype=torch.uint8, device="meta")]

    assert _launch.prefetch_weights(gpu, weights(share)) and not _launch.prefetch_weights(gpu, weights(share + 1))
    monkeypatch.setitem(_launch.PDL, "prefetch_weights", 0)
    assert not _launch.prefetch_weights(gpu, weights(1))


if __name__ == "__main__":  # the `compiled` fixture's process
    print(json.dumps(_compile_all()))
