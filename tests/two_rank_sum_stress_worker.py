"""One rank of the two-GPU stress run of the fused two-rank sum (`test_two_rank_sum_stress.py`), under torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/two_rank_sum_stress_worker.py OUT ROUNDS

Both ranks take the largest exchange a signal pad allows (`exchange_for`, as a generation would) and run ROUNDS
rounds of 16 sums back to back on their streams, with no host synchronisation inside a round: row counts from one
row to the exchange's capacity (more programs than the GPU holds at once), the sum alone or with the norm, and
before each sum a sleep kernel of a random length that differs between the ranks, so that either rank runs ahead
of the other by up to ~0.1 ms and consecutive sums overlap in the buffers' two halves as a generation's never
would more. After each round every sum is checked bit for bit against the fp32 sum of the two ranks' partial
rows, which each rank rebuilds from the same seeds, and each norm against `hf_vegas_kernels.rms_norm` of that sum
(within a bf16 rounding, as the kernel tests compare them).
A hang (a signal lost or a half overwritten before it was read) stops the run at the test's timeout.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import hf_vegas_kernels
from hf_vegas.symmetric_all_reduce import exchange_for

HIDDEN = 4096
SUMS_PER_ROUND = 16
MAX_SLEEP_CYCLES = 200_000  # ~0.1 ms at the GPU's clock


def partial_rows(round_: int, index: int, rank: int, rows: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(1_000_003 * round_ + 1009 * index + rank)
    return torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within a bf16 rounding: the fused norm may reduce in another order than `norm.py`'s."""
    return torch.allclose(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6)


def main() -> None:
    out, rounds = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    import torch.distributed._symmetric_memory as symm_mem

    capacity = getattr(symm_mem, "get_signal_pad_size", lambda: 0)() // 4  # one int32 flag per row
    assert capacity > 0, f"torch {torch.__version__} does not say its signal pads' size: no exchange is made"
    capacity = 1 << (capacity.bit_length() - 1)  # the exchange rounds its rows up to a power of two
    exchange = exchange_for(dist.group.WORLD, capacity, HIDDEN, torch.device("cuda", rank), torch.bfloat16)
    assert exchange is not None, "a signal pad of this torch holds no flags: the exchange cannot be made"
    weight = (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=torch.Generator("cuda").manual_seed(7)))
    weight = weight.to(torch.bfloat16)
    choices = torch.Generator().manual_seed(11)  # the same schedule of rows on both ranks
    sleeps = torch.Generator().manual_seed(100 + rank)  # a different skew on each rank
    row_counts = [1, 3, 16, 64, 257, 1024, capacity]
    mismatches, sums, parity = [], 0, 0
    for round_ in range(rounds):
        plan = []
        for index in range(SUMS_PER_ROUND):
            rows = row_counts[int(torch.randint(len(row_counts), (1,), generator=choices))]
            with_norm = bool(torch.randint(2, (1,), generator=choices))
            plan.append((rows, with_norm, partial_rows(round_, index, rank, rows)))
        outputs = []
        for rows, with_norm, partial in plan:
            torch.cuda._sleep(int(torch.randint(MAX_SLEEP_CYCLES, (1,), generator=sleeps)))
            outputs.append(hf_vegas_kernels.exchange_sum_norm(partial, weight if with_norm else None, 1e-6,
                                                              exchange.name, parity))
            parity ^= 1
        torch.cuda.synchronize()
        for index, ((rows, with_norm, partial), (total, normed)) in enumerate(zip(plan, outputs)):
            peer = partial_rows(round_, index, 1 - rank, rows)
            want = (partial.float() + peer.float()).to(torch.bfloat16)
            if not torch.equal(total, want):
                mismatches.append({"round": round_, "index": index, "rows": rows, "what": "sum"})
            elif with_norm and not close(normed, hf_vegas_kernels.rms_norm(want, weight, 1e-6)):
                mismatches.append({"round": round_, "index": index, "rows": rows, "what": "norm"})
            sums += 1
    flags_left = int(exchange.pad.count_nonzero())
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"sums": sums, "capacity": capacity, "mismatches": mismatches[:20],
                   "mismatch_count": len(mismatches), "flags_left": flags_left}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
