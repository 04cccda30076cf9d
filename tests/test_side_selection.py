"""A verification's top-k beside its forward (`hf_vegas.side_selection`): the same slots as the finalisation and
top-k run in place, on CUDA with the top-k on a side stream (also inside a captured graph). The GPU tests skip on the
CPU; there the op runs in place (the same comparison), and the fork and join are driven with stand-in streams."""

from __future__ import annotations

import contextlib

import pytest
import torch
from kernel_cases import DEVICE, import_kernels, make_case

from hf_vegas import side_selection
from hf_vegas.ops import eager
from hf_vegas_kernels import naive

kernels = import_kernels()
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="side streams need CUDA (on the CPU the op runs in place, tested below)")
LAYERS, Q_HEADS, KV_HEADS, TOKENS = 5, 4, 2, 3


def _verification(seed: int, window=None):
    """Each layer's emitted logits and log-sum-exps from the Triton verification kernel, the forward's state, and
    the expected selection per layer (the in-place finalisation and top-k of the reference ops)."""
    case = make_case([70, 131, 9], [TOKENS - 1] * 3, TOKENS, 32, Q_HEADS, KV_HEADS, seed=seed)
    rows = torch.tensor([0, TOKENS - 1], device=DEVICE)
    slots = case.k.shape[1]
    cand_start = torch.zeros(LAYERS, 3, dtype=torch.long, device=DEVICE)
    if window:
        cand_start[:] = (case.sel_end - window + 1).clamp_min(0)
    count = torch.tensor([[5, 40, 9], [1, 7, 3], [30, 60, 2], [0, 2, 1], [70, 131, 9]], device=DEVICE)
    count = torch.minimum(count, case.sel_end - cand_start)
    emitted, lse, want = [], [], torch.full((LAYERS, 3, 140), -7, dtype=torch.long, device=DEVICE)
    for layer in range(LAYERS):
        q = case.q * (1 + layer)  # other logits per layer
        _, e, s = kernels.verify_attention(q, case.k, case.v, case.q_slot, case.kv_len, case.scaling, rows,
                                           "weights", window=window)
        emitted.append(e)
        lse.append(s)
        scores = naive.finalize_scores(e, s, rows, case.sel_end, Q_HEADS, True, True, cand_start=cand_start[layer],
                                       window=window, q_slot=case.q_slot)
        naive.select_topk(scores[:, 0, :slots - 1], count[layer], case.sel_end, want[layer])
    state = dict(rows=rows, cand_start=cand_start, cand_end=case.sel_end, q_slot=case.q_slot, count=count,
                 num_slots=slots - 1, window=window, layers=torch.arange(LAYERS, device=DEVICE))
    return emitted, lse, state, want


def _select_all(ops, emitted, lse, state, scores, selected):
    for layer in range(LAYERS):
        side_selection.select_beside(ops.__name__, emitted[layer], lse[layer], state["rows"], state["cand_start"],
                                     state["cand_end"], state["q_slot"], state["count"], scores, selected, layer,
                                     state["layers"][layer:layer + 1], state["num_slots"], Q_HEADS, True,
                                     state["window"])
    side_selection.join(selected)


@pytest.mark.parametrize("side_stream", [1, 0])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("ops", [naive, eager, kernels], ids=lambda ops: ops.__name__)
def test_the_selection_beside_equals_the_one_in_place(ops, window, side_stream, monkeypatch):
    """(On the CPU both `side_stream` settings run in place.)"""
    monkeypatch.setitem(side_selection.SETTINGS, "side_stream", side_stream)
    emitted, lse, state, want = _verification(seed=1, window=window)
    scores = torch.full((LAYERS, 3, emitted[0].shape[-1]), float("nan"), device=DEVICE)
    selected = torch.full_like(want, -7)
    _select_all(ops, emitted, lse, state, scores, selected)
    assert torch.equal(selected, want)  # and past each row's budget left alone (-7), as select_topk promises


@needs_gpu
def test_the_selection_beside_is_captured_with_its_fork_and_join():
    """Captured into a graph (after one eager run, as a step is), then replayed on the next verification's inputs:
    the graph's fork and join edges order the side stream's kernels between the writes of its inputs and the reads
    of the selection."""
    emitted, lse, state, _ = _verification(seed=2)
    scores = torch.full((LAYERS, 3, emitted[0].shape[-1]), float("nan"), device=DEVICE)
    selected = torch.full((LAYERS, 3, 140), -7, dtype=torch.long, device=DEVICE)
    static = [t.clone() for t in emitted], [t.clone() for t in lse]
    _select_all(kernels, *static, state, scores, selected)  # the eager run makes the stream and its events
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _select_all(kernels, *static, state, scores, selected)
    for seed in (3, 4):
        emitted, lse, _, want = _verification(seed=seed)
        for buffers, new in zip(static, (emitted, lse)):
            for buffer, tensor in zip(buffers, new):
                buffer.copy_(tensor)
        selected.fill_(-7)
        graph.replay()
        assert torch.equal(selected, want)


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log
        self.device, self.cuda_stream = torch.device("cpu"), id(self)

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")


def test_the_top_k_runs_on_the_side_stream_after_the_main_streams_work(monkeypatch):
    """CPU counterpart of the stream logic, with stand-in streams: the side stream waits for everything launched on
    the main one before the top-k launches on it, one side stream serves every launch from a main stream, and the
    join makes the main stream wait for the side one."""
    log, current = [], []
    monkeypatch.setattr(side_selection, "_streams", {})
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: _Stream("side", log))

    @contextlib.contextmanager
    def stream(s):
        current.append(s.name)
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "stream", stream)
    main = _Stream("main", log)
    side_selection._join(main)  # nothing launched beside it yet: no side stream to wait for
    for layer in range(3):
        side_selection._beside(main, lambda layer=layer: log.append(f"top-k {layer} on {current[-1]}"))
    assert log == [entry for layer in range(3) for entry in ("side waits for main", f"top-k {layer} on side")]
    assert len(side_selection._streams) == 1 and not current
    log.clear()
    side_selection._join(main)
    assert log == ["main waits for side"]
