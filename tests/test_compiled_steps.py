"""`torch.compile` traces a whole step's forward: the cache update, the attention, the selection, the rotary tables'
op and (Triton backend) the fused layers, with no graph break (`fullgraph=True`), and the compiled steps give
the eager steps' drafts, logits and selections.

On the CPU the compiled graph runs through `aot_eager` (AOTAutograd's tracing with the ops' fake implementations,
then the real ops: the Triton kernels in Triton's interpreter); the GPU runs inductor and CUDA graphs in
`tests/test_graphs.py` and the benchmarks (`vegas_compile=True`).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model
from torch._dynamo.utils import counters
from transformers import LogitsProcessorList

import hf_vegas.cache
from hf_vegas.attention import active_cache, vegas_attention
from hf_vegas.cache import VegasCache
from hf_vegas.config import VegasConfig
from hf_vegas.fused_layers import fused_steps
from hf_vegas.rotary_tables import rotary_tables_once
from hf_vegas.runner import StepRunner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GAMMA = 3


def _iterations(model, ids, backend: str, policy: str, compiled: bool, iterations: int = 2, after_each=None) -> list:
    """Prefill, then `iterations` of draft + verify + greedy acceptance; returns what each step produced.
    `after_each`: called after each iteration."""
    batch, prompt = ids.shape
    config = VegasConfig(gamma=GAMMA, sparsity=0.2, min_tokens=8, backend=backend, policy=policy)
    cache = VegasCache(model.config, batch, prompt + 4 * (GAMMA + 1), config, device=ids.device, backend=backend)
    runner = StepRunner(model, cache, LogitsProcessorList(), do_sample=False)
    if compiled:
        traced = torch.compile(runner._run_model, fullgraph=True, backend="aot_eager", dynamic=False)

        def call_model(inputs, logits_to_keep, left_pad=None):  # the prefill stays eager, as in `generate`
            run = runner._run_model if cache.plan.mode == "prefill" else traced
            return run(inputs, logits_to_keep, left_pad)

        runner.call_model = call_model
    seen = []
    with (vegas_attention(model), active_cache(cache),
          fused_steps(model, cache, enabled=backend == "triton") as fused,
          rotary_tables_once(model, skip=lambda: fused > 0 and cache.plan.mode == "draft")):
        pending = runner.prefill(ids)[:, -1].argmax(-1)
        for _ in range(iterations):
            committed = cache.plan.lengths.clone()
            drafts, _ = runner.draft(pending, None, [], keep_scores=False)
            logits = runner.verify(pending, drafts)
            target = logits.argmax(-1)
            accepted = (drafts == target[:, :-1]).int().cumprod(dim=1).sum(dim=1)
            cache.plan.rollback(committed + 1 + accepted)
            pending = target[cache.plan.row_index, accepted]
            selected = cache.selection.sel_idx.clone(), cache.selection.sel_count.clone()
            seen.append((drafts.clone(), logits.float().clone(), selected))
            if after_each is not None:
                after_each()
    return seen


# Every policy on a full-attention model; the hybrid sliding-window model (windows drafting sparsely) with Vegas'.
# StreamingLLM selects by position in plain PyTorch on either backend: its Triton case would add nothing.
CASES = [
    ("llama", "vegas", "torch"), ("llama", "vegas", "triton"), ("llama", "last_token", "torch"),
    ("llama", "last_token", "triton"), ("llama", "streaming", "torch"),
    ("gemma3", "vegas", "torch"), ("gemma3", "vegas", "triton"),
    ("qwen3", "vegas", "triton"),  # (its draft layers fuse with their q/k head norms)
]


@pytest.mark.parametrize("arch,policy,backend", CASES)
def test_compiled_steps_trace_whole_and_match_eager(arch, policy, backend, monkeypatch, short_windows_draft):
    # The shape-static reference ops (the CPU path's host reads are not traceable: it never compiles).
    monkeypatch.setattr(hf_vegas.cache, "uses_eager_ops", lambda backend, device: False)
    torch._dynamo.reset()
    model = tiny_model(arch).to(DEVICE).eval()
    ids = torch.randint(3, 128, (3, 40), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        eager = _iterations(model, ids, backend, policy, compiled=False, iterations=3)
        compiles = [counters["stats"]["unique_graphs"]]  # (a process-wide count: this test's start)
        compiled = _iterations(model, ids, backend, policy, compiled=True, iterations=3,
                               after_each=lambda: compiles.append(counters["stats"]["unique_graphs"]))
    # No compilation in the last iteration: host state that changes every forward would fail dynamo's guards and
    # recompile each step (and, inside a CUDA graph's capture, fail the capture). The second iteration may still
    # compile once: its verification finds the score rows its first one cached (`generate` warms each step eagerly
    # before compiling it, so it compiles each step once).
    assert compiles[1] > compiles[0] and compiles[3] == compiles[2], compiles
    for (drafts, logits, (sel_idx, sel_count)), (c_drafts, c_logits, (c_sel_idx, c_sel_count)) in zip(eager, compiled):
        torch.testing.assert_close(c_logits, logits, atol=1e-4, rtol=1e-4)
        assert torch.equal(c_drafts, drafts)
        assert torch.equal(c_sel_count, sel_count)
        used = torch.arange(sel_idx.shape[-1], device=sel_idx.device) < sel_count[..., None]
        assert torch.equal(c_sel_idx[used], sel_idx[used])


def test_each_bucket_compiles_its_own_copy_of_the_forward():
    """Dynamo's recompile limit (8) counts per code object: a forward shared by every bucket would stop compiling
    after a few buckets. Each `StepGraphs` (one bucket) compiles its own copy, once; off compilation, the forward."""
    from hf_vegas.graphs import StepGraphs

    class Runner:
        def forward(self, x):
            return x + 1

    runner, first, second = Runner(), StepGraphs(compile=True), StepGraphs(compile=True)
    assert first.compiled(runner.forward) == runner.forward, "not while compiling: the forward itself"
    first.compiling = second.compiling = True
    a, b = first.compiled(runner.forward), second.compiled(runner.forward)
    assert a.func is first.compiled(runner.forward).func and a.args == (runner,)
    codes = [c.func.__wrapped__.__code__ for c in (a, b)]
    assert codes[0] is not codes[1] and codes[0] is not Runner.forward.__code__
    assert codes[0].co_code == Runner.forward.__code__.co_code
