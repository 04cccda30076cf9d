"""Where a decode step's time goes: timestamps for HF's loop and CUDA-event splits of hf_vegas' iterations.

The library has no timing code; this module wraps the loop's private steps for the benchmark only:

    iteration  = [host gap] draft (gamma graph replays + logits processing + token choice)
                 -> verify (one graph replay: full attention, score emission, selection)
                 -> accept (acceptance, cache rollback, commit, and the one host synchronisation)

When the loop queues the next iteration's draft before its synchronisation returns (`DecodeLoop._draft_ahead`), that
draft is timed as the next iteration's, and this iteration's accept interval ends where it starts. Its GPU time then
falls mostly within the previous iteration's wall time, so `host` (clamped at 0) is no longer all the rest of it.

`draft`, `verify` and `accept` are GPU-timeline intervals between CUDA events: any time the GPU waits for Python to
launch the next kernel inside an interval counts in that interval. `host` is the rest of the iteration's wall time:
the Python work before the iteration's first launch and after its synchronisation returns.
"""

from __future__ import annotations

import contextlib
import time

import torch
from transformers import StoppingCriteria

from hf_vegas import loop
from hf_vegas.runner import StepRunner


class FirstTokenClock(StoppingCriteria):
    """Never stops; remembers when HF's loop produced its first token (after the prefill), for decode-only timing."""

    def __init__(self):
        self.first: float | None = None

    def __call__(self, input_ids, scores, **kwargs):
        if self.first is None:
            if input_ids.is_cuda:  # the GPU may still be running the prefill
                torch.cuda.synchronize()
            self.first = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class IterationTimes:
    """Per-iteration wall times and GPU splits of every hf_vegas generation inside `record()`."""

    def __init__(self):
        self.iterations: list[dict] = []

    @contextlib.contextmanager
    def record(self):
        events: list[dict] = []
        original_iterate = loop.DecodeLoop._iterate
        original_draft, original_verify, original_decode = StepRunner.draft, StepRunner.verify, StepRunner.decode

        def mark(name: str) -> None:
            if events:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                events[-1][name] = event

        def iterate(loop, active):
            # (a draft queued at the end of another generation was wasted: it is nobody's)
            same = bool(events) and events[-1]["loop"] is loop
            ahead = events[-1] if same and "ahead_drafted" in events[-1] else None
            events.append({"wall_start": time.perf_counter(), "loop": loop})
            if ahead is None:
                mark("start")
            else:  # this iteration's draft was queued during the previous one (`DecodeLoop._draft_ahead`)
                events[-1]["start"], events[-1]["drafted"] = ahead["ahead_start"], ahead["ahead_drafted"]
            n = original_iterate(loop, active)  # ends with the iteration's host synchronisation
            events[-1]["wall_end"] = time.perf_counter()
            mark("end")
            return n

        def draft(runner, *args, **kwargs):
            ahead = bool(events) and "verified" in events[-1]  # the next iteration's draft, queued early
            if ahead:
                mark("ahead_start")
            out = original_draft(runner, *args, **kwargs)
            mark("ahead_drafted" if ahead else "drafted")
            return out

        def verified(original):
            def forward(runner, *args, **kwargs):
                out = original(runner, *args, **kwargs)
                mark("verified")
                return out
            return forward

        loop.DecodeLoop._iterate = iterate
        StepRunner.draft, StepRunner.verify = draft, verified(original_verify)
        StepRunner.decode = verified(original_decode)
        try:
            yield self
        finally:
            loop.DecodeLoop._iterate = original_iterate
            StepRunner.draft, StepRunner.verify, StepRunner.decode = original_draft, original_verify, original_decode
            torch.cuda.synchronize()
            self.iterations = [_split(e) for e in events]

    def decode_seconds(self) -> float:
        """From the first iteration's start (the prefill and first token done and synced) to the last one's end."""
        return self.iterations[-1]["wall_end"] - self.iterations[0]["wall_start"]

    def median_ms(self) -> dict[str, float]:
        keys = ("wall", "draft", "verify", "accept", "host")
        return {k: sorted(i[k] for i in self.iterations)[len(self.iterations) // 2] for k in keys}


def _split(e: dict) -> dict:
    """Milliseconds of each part of one iteration (CUDA events are read after the final synchronisation)."""
    drafted = e.get("drafted", e["start"])  # gamma = 0 has no draft
    split = dict(
        wall_start=e["wall_start"], wall_end=e["wall_end"], wall=(e["wall_end"] - e["wall_start"]) * 1e3,
        draft=e["start"].elapsed_time(drafted), verify=drafted.elapsed_time(e["verified"]),
        accept=e["verified"].elapsed_time(e.get("ahead_start", e["end"])),
    )
    split["host"] = max(split["wall"] - split["draft"] - split["verify"] - split["accept"], 0.0)
    return split
