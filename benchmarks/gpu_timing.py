"""GPU timing shared by the benchmarks: replayed-CUDA-graph timing and the bandwidths bounds are measured against."""

from __future__ import annotations

import torch


def graph_time(fn, calls: int) -> float:
    """Seconds per call of `fn(i)` for i in range(calls), replayed as one CUDA graph (median of 20 replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):  # warm-up: compiles the kernels outside the capture
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), 1 GiB buffers."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = graph_time(lambda i: dst.copy_(src), 1)
    return 2 * src.numel() / seconds


def read_bandwidth() -> float:
    """Read-only bandwidth in bytes/s: a full reduction over a 1 GiB buffer (what an attention kernel does)."""
    src = torch.ones(1 << 29, dtype=torch.bfloat16, device="cuda")
    out = torch.empty((), dtype=torch.float32, device="cuda")
    return 2 * src.numel() / graph_time(lambda i: torch.sum(src, dim=0, dtype=torch.float32, out=out), 1)
