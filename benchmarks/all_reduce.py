"""The all-reduces of a tensor-parallel step, NCCL against symmetric memory, as CUDA graphs replay them (issue 12):

    torchrun --nproc_per_node 2 benchmarks/all_reduce.py --rows 16 64 112 --hidden 4096 --count 73

A Qwen3-8B-shaped forward under TP = 2 all-reduces `(rows, 4096)` bf16 activations 72 times (two row-parallel
projections per layer x 36; `--count` 73 is what `tensor_parallel_runs` times per forward, one more for an embedding
all-reduce that transformers 5.17's and 5.24's Qwen3 plans do not make): 16 rows in a batch-16 draft step, 112 in its
verification. Small messages cost NCCL its latency, not bytes. A one-shot all-reduce through symmetric memory
(`torch.ops.symm_mem.one_shot_all_reduce_copy_out`: each rank copies its partial into a buffer every rank maps, a
device-side barrier, then each rank sums every rank's buffer) needs no NVLink multicast, and is captured in a CUDA
graph once its buffer was allocated and rendezvoused eagerly (torch issues #184527, #197857).

For each row count, on every rank: one eager all-reduce of each kind against NCCL's (the symmetric one writing over
its own input, as an in-place all-reduce must), then `--count` chained all-reduces captured in a graph per kind; the
two chains' results are compared on every rank (the buffer is reused by each all-reduce of the chain), and each graph
is replayed `--replays` times to time one all-reduce on the GPU's clock (twice per kind, in both orders; the faster
pass counts). `--compile` also traces the symmetric chain with `torch.compile` before capturing it. The symmetric
all-reduce is hf_vegas' own op (`hf_vegas.symmetric_all_reduce.symmetric_all_reduce_`, what a generation with
`vegas_tp_all_reduce="symmetric_memory"` runs): an op with a fake, as torch 2.11 has none for the symmetric op and
dynamo refused it. (The records up to 689c543 ran this script's own copy of that op: the same kernel call.)
Rank 0 prints a line and appends a record to `--out` per row count.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import provenance
import results_io
import tensor_parallel_runs
import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from hf_vegas.symmetric_all_reduce import symmetric_all_reduce_


# Chained all-reduces of two ranks double the values each time; bf16's range (as fp32's) holds 2**127.
MAX_COUNT = 100


def measure(rows: int, hidden: int, count: int, replays: int, compile_chain: bool, group_name: str) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(dist.get_rank())
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    buffer = symm_mem.empty(rows * hidden, device="cuda", dtype=torch.bfloat16)
    symm_mem.rendezvous(buffer, group=group_name)

    def nccl_chain(y):
        for _ in range(count):
            dist.all_reduce(y)

    def symmetric_chain(y):
        for _ in range(count):
            symmetric_all_reduce_(y, buffer, group_name)

    want, got = x.clone(), x.clone()
    dist.all_reduce(want)
    symmetric_all_reduce_(got, buffer, group_name)  # written over its own input
    eager_equal = not tensor_parallel_runs.any_rank_failed(not torch.equal(got, want))
    # (One compilation per row count: the chain closes over its buffer; hence at most 8 row counts with --compile.)
    chain = torch.compile(symmetric_chain, fullgraph=True) if compile_chain else symmetric_chain
    nccl_y, symm_y = x.clone(), x.clone()
    # One eager run before each capture (a compiled chain compiles there), as a step runs before its capture.
    nccl = tensor_parallel_runs.capture(lambda: nccl_chain(nccl_y), warmups=1)
    symm = tensor_parallel_runs.capture(lambda: chain(symm_y), warmups=1)
    nccl_y.copy_(x)
    symm_y.copy_(x)
    nccl.replay()
    symm.replay()
    torch.cuda.synchronize()
    # Each all-reduce doubles the sum: a stale read shows. (The timing replays go on doubling the values into
    # infinities, which timing does not read.)
    chain_equal = not tensor_parallel_runs.any_rank_failed(not torch.equal(nccl_y, symm_y))
    # Each kind timed twice, in both orders; the faster of its two passes counts.
    ms_nccl, ms_symm = (tensor_parallel_runs.replay_ms(g, replays) for g in (nccl, symm))
    ms_symm = min(ms_symm, tensor_parallel_runs.replay_ms(symm, replays))
    ms_nccl = min(ms_nccl, tensor_parallel_runs.replay_ms(nccl, replays))
    return dict(rows=rows, hidden=hidden, dtype="bfloat16", count=count, compiled=compile_chain,
                nccl_us=ms_nccl / count * 1e3, symmetric_us=ms_symm / count * 1e3, eager_equal=eager_equal,
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
    tensor_parallel_runs.finish()


if __name__ == "__main__":
    main()
