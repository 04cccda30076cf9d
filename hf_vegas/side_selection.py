"""A verification's selection beside its forward: each sparse layer's score finalisation and top-k run on a side CUDA
stream while the main stream goes on with the layers after it; the forward's last sparse layer joins them.

Why: nothing in the verification reads its selection, only the next draft does. On the main stream, a SmolLM2
verification at 64 x 7.5K spent about 0.3 ms in 30 score finalisations (10.5 us each) and 0.26 ms in one top-k over
every layer at its end, all on an iteration's critical path (H100, `benchmarks/profile_forward.py --random-weights
--compile` at 8eaac62). Beside it, only the last layer's pair stays on that path.

Lifetimes. The emitted logits and log-sum-exps a layer's pair reads are the attention op's outputs, allocated on
the main stream: once freed there, the caching allocator may hand their memory to a later layer while the side
stream still reads it. So each launch keeps its inputs alive, and two launches later the main stream waits for it
(an event) before they are let go: at most three layers' emissions live at once, and the main stream never waits on
a pair that is still running unless the side stream falls two layers behind.

CUDA graphs: the fork (the side stream waits for the main one), the per-layer events and the join (the main stream
waits for the side one) are recorded as edges of the captured graph. The stream and its events are made at the
first, eager, verification, never during a capture. Elsewhere than on CUDA the pair runs in place, and so it does
with `SETTINGS["side_stream"]` 0 (a benchmark's `--tuning selection:side_stream=0`).

Both steps are `torch.library` custom ops so that a compiled forward traces them as opaque calls; `join` declares
that it writes the selection so that a compiled graph keeps it after every launch.
"""

from __future__ import annotations

import collections
import importlib

import torch

Tensor = torch.Tensor

# `side_stream` 0: the pairs run in place, on the forward's own stream. The benchmarks override it to compare
# (`--tuning selection:side_stream=0`); nothing else should.
SETTINGS = {"side_stream": 1}

# Launches whose inputs stay alive before the main stream waits for the oldest one (see the module docstring).
IN_FLIGHT = 2


class _Side:
    """The side stream of one main stream, its event ring, and the launches whose inputs it keeps alive."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        # A ring one longer than IN_FLIGHT: an event is recorded again only after the main stream waited for it.
        self.events = [torch.cuda.Event() for _ in range(IN_FLIGHT + 1)]
        for event in self.events:  # created now (CUDA makes an event at its first record), outside any capture
            event.record(self.stream)
        self.next_event = 0
        self.in_flight: collections.deque = collections.deque()  # (event, the launch's inputs), oldest first

    def launch(self, main: torch.cuda.Stream, keep: tuple, work) -> None:
        while len(self.in_flight) >= IN_FLIGHT:
            event, _ = self.in_flight.popleft()
            main.wait_event(event)  # the main stream reuses those inputs' memory only after their reader ran
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            work()
        event = self.events[self.next_event]
        self.next_event = (self.next_event + 1) % len(self.events)
        event.record(self.stream)
        self.in_flight.append((event, keep))

    def join(self, main: torch.cuda.Stream) -> None:
        main.wait_stream(self.stream)
        self.in_flight.clear()


_sides: dict[tuple[int, int], _Side] = {}  # per (device, main stream): threads on one stream share its side stream


def _side(main: torch.cuda.Stream) -> _Side:
    key = (main.device.index, main.cuda_stream)
    if key not in _sides:
        _sides[key] = _Side(main.device)
    return _sides[key]


@torch.library.custom_op("hf_vegas::select_beside", mutates_args=("scores", "selected"))
def select_beside(
    ops_module: str, emitted: Tensor, lse: Tensor, score_rows: Tensor, cand_start: Tensor, cand_end: Tensor,
    q_slot: Tensor, count: Tensor, scores: Tensor, selected: Tensor, layer: int, num_slots: int, q_heads: int,
    weights: bool, window: int | None = None,
) -> None:
    """Layer `layer`'s selection from its verification's `emitted` logits and `lse`, with the ops of `ops_module` (a
    module name: custom ops take no modules): the head- and row-mean scores into `scores[layer]` (`(L, B, S)`
    scratch), then the top `count[layer, b]` of each row's first `num_slots` slots into `selected[layer]`
    (`(L, B, K)`). `cand_start` `(L, B)`, `cand_end` `(B,)`, `window` and `q_slot` as `finalize_scores` takes them.
    On CUDA it runs on the side stream and returns at once; `join` waits for it."""
    ops = importlib.import_module(ops_module)

    def work():
        ops.finalize_scores(emitted, lse, score_rows, cand_end, q_heads, weights, mean_rows=True,
                            out=scores[layer][:, None], cand_start=cand_start[layer], window=window, q_slot=q_slot)
        ops.select_topk(scores[layer, :, :num_slots], count[layer], cand_end, selected[layer])

    if emitted.device.type != "cuda" or not SETTINGS["side_stream"]:
        work()
        return
    main = torch.cuda.current_stream(emitted.device)
    _side(main).launch(main, (emitted, lse), work)


@select_beside.register_fake
def _(*args, **kwargs):
    return None


@torch.library.custom_op("hf_vegas::join_selection", mutates_args=("selected",))
def join(selected: Tensor) -> None:
    """The current stream waits for every `select_beside` launched from it, which completes `selected`."""
    if selected.device.type != "cuda":
        return
    main = torch.cuda.current_stream(selected.device)
    side = _sides.get((main.device.index, main.cuda_stream))
    if side is not None:
        side.join(main)


@join.register_fake
def _(selected):
    return None
