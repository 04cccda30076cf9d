"""A verification's top-k beside its forward: right after each sparse layer's attention, its scores are finalised in
place, and its top-k runs on a side CUDA stream while the main stream goes on with the layers after it; the forward's
last sparse layer joins the side stream.

Why: nothing in the verification reads its selection, only the next draft does. On the main stream, one top-k over
every layer at the forward's end took 0.26 ms of a SmolLM2 verification at 64 x 7.5K (H100,
`benchmarks/profile_forward.py --random-weights --compile` at 8eaac62), all on an iteration's critical path. Beside
it, only the last layer's stays on that path.

Why only the top-k: a finalisation reads the layer's emitted logits (19 MB at that shape) right after the attention
wrote them, from L2 (10.5 us). Moved beside the forward as well (9c80caf), it read them from memory while the next
layers streamed the cache, took about 100 us each, and the verification went from 6.85 to 7.06 ms per iteration
(`throughput.py --workloads smollm2:64x7500 --compile`, H100, same call). A top-k reads the layer's row scores only
(2 MB, a scratch no other step writes before the join), so nothing it reads can be freed or rewritten under it.

CUDA graphs: the fork (the side stream waits for the main one) and the join (the main stream waits for the side one)
are recorded as edges of the captured graph. The stream is made at the first, eager, verification, never during a
capture. Elsewhere than on CUDA the top-k runs in place, and so it does with `SETTINGS["side_stream"]` 0 (a
benchmark's `--tuning selection:side_stream=0`).

Both steps are `torch.library` custom ops so that a compiled forward traces them as opaque calls; `join` declares
that it writes the selection so that a compiled graph keeps it after every launch.
"""

from __future__ import annotations

import importlib

import torch

Tensor = torch.Tensor

# `side_stream` 0: the top-k runs in place, on the forward's own stream. The benchmarks override it to compare
# (`--tuning selection:side_stream=0`); nothing else should.
SETTINGS = {"side_stream": 1}

_streams: dict[tuple[int, int], torch.cuda.Stream] = {}  # the side stream of each (device, main stream)


def _side_stream(main: torch.cuda.Stream) -> torch.cuda.Stream:
    key = (main.device.index, main.cuda_stream)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(main.device)
    return _streams[key]


def _beside(main: torch.cuda.Stream, work) -> None:
    """`work()`'s launches on `main`'s side stream, after everything launched on `main` so far."""
    side = _side_stream(main)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        work()


@torch.library.custom_op("hf_vegas::select_beside", mutates_args=("scores", "selected"))
def select_beside(
    ops_module: str, emitted: Tensor, lse: Tensor, score_rows: Tensor, cand_start: Tensor, cand_end: Tensor,
    q_slot: Tensor, count: Tensor, scores: Tensor, selected: Tensor, layer: int, layers: Tensor, num_slots: int,
    q_heads: int, weights: bool, window: int | None = None,
) -> None:
    """Layer `layer`'s selection from its verification's `emitted` logits and `lse`, with the ops of `ops_module` (a
    module name: custom ops take no modules): the head- and row-mean scores into `scores[layer]` (`(L, B, S)`
    scratch), then the top `count[layer, b]` of each row's first `num_slots` slots into `selected[layer]`
    (`(L, B, K)`); `layers` is `[layer]` on the device (the top-k's layer list: a view of a prebuilt index, so no
    launch builds it). `cand_start` `(L, B)`, `cand_end` `(B,)`, `window` and `q_slot` as `finalize_scores` takes
    them. On CUDA the top-k runs on the side stream and this returns at once; `join` waits for it."""
    ops = importlib.import_module(ops_module)
    ops.finalize_scores(emitted, lse, score_rows, cand_end, q_heads, weights, mean_rows=True,
                        out=scores[layer][:, None], cand_start=cand_start[layer], window=window, q_slot=q_slot)
    if emitted.device.type != "cuda" or not SETTINGS["side_stream"]:
        ops.select_topk(scores[..., :num_slots], count, cand_end, selected, layers=layers)
        return
    _beside(torch.cuda.current_stream(emitted.device),
            lambda: ops.select_topk(scores[..., :num_slots], count, cand_end, selected, layers=layers))


@select_beside.register_fake
def _(*args, **kwargs):
    return None


@torch.library.custom_op("hf_vegas::join_selection", mutates_args=("selected",))
def join(selected: Tensor) -> None:
    """The current stream waits for every top-k `select_beside` launched from it, which completes `selected`."""
    if selected.device.type == "cuda":
        _join(torch.cuda.current_stream(selected.device))


def _join(main: torch.cuda.Stream) -> None:
    side = _streams.get((main.device.index, main.cuda_stream))
    if side is not None:  # (none yet: nothing was launched beside `main`)
        main.wait_stream(side)


@join.register_fake
def _(selected):
    return None
