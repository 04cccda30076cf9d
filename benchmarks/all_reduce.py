"""The all-reduces of a tensor-parallel step, NCCL against symmetric memory, as CUDA graphs replay them (issue 12):

    torchrun --nproc_per_node 2 benchmarks/all_reduce.py --rows 16 64 112 --hidden 4096 --count 73

A Qwen3-8B-shaped forward under TP = 2 all-reduces `(rows, 4096)` bf16 activations 72 times (two row-parallel
projections per layer x 36; `--count` 73 is what `tensor_parallel_runs` times per forward, one more for an embedding
all-reduce that transformers 5.17's and 5.24's Qwen3 plans do not make): 16 rows in a batch-16 draft step, 112 in its
verification. Small
messages cost NCCL its latency, not bytes. A one-shot all-reduce through symmetric memory
(`torch.ops.symm_mem.one_shot_all_reduce_copy_out`: each rank copies its partial into a buffer every rank maps, a
device-side barrier, then each rank sums every rank's buffer) needs no NVLink multicast, and is captured in a CUDA
graph once its buffer was allocated and rendezvoused eagerly (torch issues #184527, #197857).

For each row count, on every rank: one eager all-reduce of each kind against NCCL's (the symmetric one writing over
its own input, as an in-place all-reduce must), then `--count` chained all-reduces captured in a graph per kind; the
two chains' results are compared on every rank (the buffer is reused by each all-reduce of the chain), and each graph
is replayed `--replays` times to time one all-reduce on the GPU's clock (twice per kind, in both orders; the faster
pass counts). `--compile` also traces the symmetric chain with `torch.compile` before
capturing it (through an op of our own with a fake: torch 2.11 has none for the symmetric op, so dynamo refused it).
Rank 0 prints a line and appends a record to `--out` per row count.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import provenance
import results_io
import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem


# Chained all-reduces of two ranks double the values each time; bf16's range (as fp32's) holds 2**127.
MAX_COUNT = 100


@torch.library.custom_op("hf_vegas_benchmarks::one_shot_all_reduce_", mutates_args=("x", "buffer"))
def one_shot_all_reduce_(x: torch.Tensor, buffer: torch.Tensor, group_name: str) -> None:
    """`x` summed over the group in place through the symmetric `buffer` (which it overwrites with `x` first). An op
    of our own because torch (2.11) has no fake for `one_shot_all_reduce_copy_out`, so `torch.compile` cannot trace
    that one (`--compile`)."""
    torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer, x, "sum", group_name, x)


@one_shot_all_reduce_.register_fake
def _(x, buffer, group_name):
    return None


def _replay_time(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Seconds per replay on the GPU's clock (CUDA events), every rank replaying in step (a one-shot all-reduce
    waits for its peers). The replays go on doubling the chain's values into infinities: timing does not read
    them."""
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


def _capture(chain, *args) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    chain(*args)  # warm (a compiled chain compiles here), eagerly, as a step runs before its capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        chain(*args)
    return graph


def _on_every_rank(flag: bool) -> bool:
    """Whether `flag` holds on every rank (a wrong read shows on one rank's result only)."""
    agreed = torch.tensor([int(flag)], device="cuda")
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed.item())


def measure(rows: int, hidden: int, count: int, replays: int, compile_chain: bool, group_name: str) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(dist.get_rank())
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    buffer = symm_mem.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
    symm_mem.rendezvous(buffer, group=group_name)

    def nccl_chain(y):
        for _ in range(count):
            dist.all_reduce(y)

    def symmetric_chain(y):
        for _ in range(count):
            one_shot_all_reduce_(y, buffer, group_name)

    want, got = x.clone(), x.clone()
    dist.all_reduce(want)
    one_shot_all_reduce_(got, buffer, group_name)  # written over its own input
    eager_equal = _on_every_rank(torch.equal(got, want))
    # (One compilation per row count: the chain closes over its buffer; hence at most 8 row counts with --compile.)
    chain = torch.compile(symmetric_chain, fullgraph=True) if compile_chain else symmetric_chain
    nccl_y, symm_y = x.clone(), x.clone()
    nccl, symm = _capture(nccl_chain, nccl_y), _capture(chain, symm_y)
    nccl_y.copy_(x)
    symm_y.copy_(x)
    nccl.replay()
    symm.replay()
    torch.cuda.synchronize()
    chain_equal = _on_every_rank(torch.equal(nccl_y, symm_y))  # each all-reduce doubles the sum: a stale read shows
    # Each kind timed twice, in both orders; the faster of its two passes counts.
    t_nccl, t_symm = _replay_time(nccl, replays), _replay_time(symm, replays)
    t_symm, t_nccl = min(t_symm, _replay_time(symm, replays)), min(t_nccl, _replay_time(nccl, replays))
    return dict(rows=rows, hidden=hidden, dtype="bfloat16", count=count, compiled=compile_chain,
                nccl_us=t_nccl / count * 1e6, symmetric_us=t_symm / count * 1e6, eager_equal=eager_equal,
                chain_equal=chain_equal)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[16, 64, 112])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--count", type=int, default=73, help="all-reduces per captured graph")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--compile", action="store_true", help="torch.compile the symmetric chain before capture")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/all_reduce.jsonl"))
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise SystemExit("run under torchrun on 2 or more GPUs: torchrun --nproc_per_node 2 benchmarks/all_reduce.py")
    if any(r < 1 for r in args.rows) or args.hidden < 1 or args.count < 1 or args.replays < 1:
        raise SystemExit("--rows, --hidden, --count and --replays must be positive integers")
    if args.count > MAX_COUNT:
        raise SystemExit(f"--count must be at most {MAX_COUNT}: each all-reduce of the compared chains doubles "
                         "their values, which must stay finite")
    if args.compile and len(args.rows) > 8:
        raise SystemExit("--compile takes at most 8 row counts (dynamo recompiles a function at most 8 times)")
    if any(rows * args.hidden % 2 for rows in args.rows):
        raise SystemExit("--rows x --hidden must be even for every row count: the one-shot kernel moves bf16 values "
                         "in 4-byte words")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    group_name = dist.group.WORLD.group_name
    if dist.get_rank() == 0:
        print(f"{'rows':>5} {'NCCL us':>8} {'one-shot us':>12} {'eager equal':>12} {'chain equal':>12}", flush=True)
    for rows in args.rows:  # each row count's record is written as soon as it is measured
        record = measure(rows, args.hidden, args.count, args.replays, args.compile, group_name)
        if dist.get_rank() == 0:
            results_io.append_records(args.out, [dict(provenance.gpu_run(args.commit),
                                                      world_size=dist.get_world_size(), **record)])
            print(f"{rows:5d} {record['nccl_us']:8.2f} {record['symmetric_us']:12.2f} "
                  f"{str(record['eager_equal']):>12} {str(record['chain_equal']):>12}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
