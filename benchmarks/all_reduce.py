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

`--norm` times instead what a fused draft layer under TP = 2 runs after each row-parallel projection: the sum and the
RMSNorm after it, as the one-shot all-reduce then a norm launch (`hf_vegas_kernels.rms_norm`), against the push
all-reduce with the norm in the same launch (`hf_vegas_kernels.exchange_sum_norm` through the generation's kind of
`Exchange`, one barrier per sum, alternating halves of a receive buffer; the records up to e531ed6 called the same
kernel as `all_reduce_norm` on the exchange's tensors). Each link of the chains normalises the sum of the one before
it (the values stay bounded); the sums are compared bit for bit with the one-shot ones in an eager link, the chains'
last norms are compared within a bf16 rounding.
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

from hf_vegas.symmetric_all_reduce import Exchange, symmetric_all_reduce_


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


def measure_norm(rows: int, hidden: int, count: int, replays: int, group_name: str) -> dict:
    import hf_vegas_kernels as kernels

    gen = torch.Generator(device="cuda").manual_seed(dist.get_rank())
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)))
    weight = weight.to(torch.bfloat16)
    buffer = symm_mem.empty(rows * hidden, device="cuda", dtype=torch.bfloat16)
    symm_mem.rendezvous(buffer, group=group_name)
    exchange = Exchange.allocate(rows, hidden, torch.bfloat16, torch.device("cuda"), group_name)

    def separate(y):
        symmetric_all_reduce_(y, buffer, group_name)
        return y, kernels.rms_norm(y, weight, 1e-6)

    def fused(y, parity):
        return kernels.exchange_sum_norm(y, weight, 1e-6, exchange.name, parity)  # what a generation runs

    want_sum, want_norm = separate(x.clone())
    got_sum, got_norm = fused(x.clone(), 0)
    eager_equal = not tensor_parallel_runs.any_rank_failed(not torch.equal(got_sum, want_sum))
    ys = {"separate": x.clone(), "fused": x.clone()}

    def separate_chain():
        y = ys["separate"]
        for _ in range(count):
            y = separate(y.clone())[1]
        ys["separate_out"] = y

    def fused_chain():
        y = ys["fused"]
        for i in range(count):
            y = fused(y, i % 2)[1]
        ys["fused_out"] = y

    graphs = {name: tensor_parallel_runs.capture(run, warmups=1)
              for name, run in (("separate", separate_chain), ("fused", fused_chain))}
    for graph in graphs.values():
        graph.replay()
    torch.cuda.synchronize()
    diff = (ys["separate_out"].float() - ys["fused_out"].float()).abs().max().item()
    chain_close = not tensor_parallel_runs.any_rank_failed(not diff <= 0.05)
    times = {name: min(tensor_parallel_runs.replay_ms(g, replays) for _ in range(2)) for name, g in graphs.items()}
    return dict(rows=rows, hidden=hidden, dtype="bfloat16", count=count, kind="sum+norm",
                one_shot_then_norm_us=times["separate"] / count * 1e3, fused_push_us=times["fused"] / count * 1e3,
                eager_sums_equal=eager_equal, chain_norm_max_diff=diff, chain_close=chain_close)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[16, 64, 112])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--count", type=int, default=73, help="all-reduces per captured graph")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--compile", action="store_true", help="torch.compile the symmetric chain before capture")
    parser.add_argument("--norm", action="store_true",
                        help="time the sum + RMSNorm of a fused TP layer: one-shot + norm launch against the fused op")
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
    if args.compile and args.norm:
        raise SystemExit("--compile compiles the one-shot chain, which --norm does not time: pick one")
    if args.compile and len(args.rows) > 8:
        raise SystemExit("--compile takes at most 8 row counts (dynamo recompiles a function at most 8 times)")
    if any(rows * args.hidden % 2 for rows in args.rows):
        raise SystemExit("--rows x --hidden must be even for every row count: the one-shot kernel moves bf16 values "
                         "in 4-byte words")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    group_name = dist.group.WORLD.group_name
    if args.norm and dist.get_world_size() != 2:
        raise SystemExit("--norm sums over exactly 2 ranks (the fused op's peer): torchrun --nproc_per_node 2")
    if args.norm:
        header = f"{'rows':>5} {'one-shot + norm us':>19} {'fused us':>9} {'sums equal':>11} {'norm diff':>10}"

        def run(rows):
            r = measure_norm(rows, args.hidden, args.count, args.replays, group_name)
            return r, (f"{rows:5d} {r['one_shot_then_norm_us']:19.2f} {r['fused_push_us']:9.2f} "
                       f"{str(r['eager_sums_equal']):>11} {r['chain_norm_max_diff']:10.4f}")
    else:
        header = f"{'rows':>5} {'NCCL us':>8} {'one-shot us':>12} {'eager equal':>12} {'chain equal':>12}"

        def run(rows):
            r = measure(rows, args.hidden, args.count, args.replays, args.compile, group_name)
            return r, (f"{rows:5d} {r['nccl_us']:8.2f} {r['symmetric_us']:12.2f} "
                       f"{str(r['eager_equal']):>12} {str(r['chain_equal']):>12}")
    if dist.get_rank() == 0:
        print(header, flush=True)
    for rows in args.rows:  # each row count's record is written as soon as it is measured
        record, line = run(rows)
        if dist.get_rank() == 0:
            results_io.append_records(args.out, [dict(provenance.gpu_run(args.commit),
                                                      world_size=dist.get_world_size(), **record)])
            print(line, flush=True)
    tensor_parallel_runs.finish()

if __name__ == "__main__":
    main()
