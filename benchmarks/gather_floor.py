"""How close the sparse draft attention runs to the floor of reading its gathered keys and values.

    python benchmarks/gather_floor.py                      # SmolLM2's draft at 64 x 7.5K: 593 selected slots
    python benchmarks/gather_floor.py --batch 16 --selected 525 1050

For each selection length, times as a replayed CUDA graph over `--copies` cache copies (`gpu_timing.graph_time`, so
that L2 holds none of it):
  attention  `sparse_draft_attention` (one query token, SmolLM2's 9 query / 3 KV heads of 64) over each row's
             sorted random selection, and over contiguous slots, with int64 and int32 slot numbers;
  gather     `gather_sums`, a kernel that reads the same keys and values, one program per (split, row, KV head),
             and does no attention math: the least a launch must spend on those bytes, best of a grid of
             block sizes, warps, pipeline stages and splits.
The attention's distance above the gather is what a better draft-attention kernel could still win at that shape (the
gather leaves out the 7-slot tail the attention also reads, about 1 % of the bytes);
both against the read bandwidth say what the launch itself (start, first loads, tail) costs at a few tens of MB.
One JSON record per timing goes to --out with GPU, versions and commit.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
import triton
import triton.language as tl

KV_HEADS, GROUPS, HEAD_DIM = 3, 3, 64  # SmolLM2-135M's attention
TAIL = 7  # the tail after the selection: the accepted tokens and drafts since it was made (gamma + 1)


@triton.jit
def _gather_sums(K, V, Idx, Count, Out, stride_kb, stride_ks, stride_kh, stride_ib,
                 KV_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    split, row_head = tl.program_id(0), tl.program_id(1)
    splits = tl.num_programs(0)
    b = (row_head // KV_HEADS).to(tl.int64)
    h = row_head % KV_HEADS
    n = tl.load(Count + b)
    chunk = tl.cdiv(tl.cdiv(n, BLOCK_N), splits) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, n)
    d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    for p0 in range(start, end, BLOCK_N):
        p = p0 + tl.arange(0, BLOCK_N)
        ok = p < end
        slot = tl.load(Idx + b * stride_ib + p, mask=ok, other=0)
        offset = b * stride_kb + slot[:, None] * stride_ks + h * stride_kh + d[None, :]
        k = tl.load(K + offset, mask=ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(V + offset, mask=ok[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(k * v, axis=0)
    tl.store(Out + (row_head * splits + split) * D + d, acc)


def gather_sums(k_cache, v_cache, sel_idx, count, splits: int, block_n: int, out=None, **launch) -> torch.Tensor:
    """For each (row, KV head) of `(B, S, Hkv, D)` caches and each of `splits` consecutive shares of the row's list
    `sel_idx[b, :count[b]]` (whole blocks of `block_n`, as the attention kernel splits its lists), the sum over the
    share's slots of `k * v` (in fp32): `(B * Hkv * splits, D)`, into `out` if given. Only a reason to read the
    bytes. `launch`: Triton's launch options (`num_warps`, `num_stages`)."""
    batch, _, kv_heads, head_dim = k_cache.shape
    if (v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or k_cache.stride(-1) != 1
            or sel_idx.stride(-1) != 1 or sel_idx.shape[0] != batch or count.shape != (batch,)):
        raise ValueError("gather_sums: caches of one shape and layout with a contiguous last dimension, a selection "
                         "of one row per sequence with one, and one count per sequence, please")
    if out is None:
        out = torch.empty(batch * kv_heads * splits, head_dim, device=k_cache.device)
    elif out.shape != (batch * kv_heads * splits, head_dim) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"gather_sums: out must be contiguous fp32 ({batch * kv_heads * splits}, {head_dim})")
    _gather_sums[(splits, batch * kv_heads)](
        k_cache, v_cache, sel_idx, count, out, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        sel_idx.stride(0), KV_HEADS=kv_heads, D=head_dim, BLOCK_N=block_n, **launch)
    return out


def gather_sums_reference(k_cache, v_cache, sel_idx, count, splits: int, block_n: int) -> torch.Tensor:
    """`gather_sums` in plain PyTorch."""
    batch, _, kv_heads, head_dim = k_cache.shape
    out = torch.zeros(batch, kv_heads, splits, head_dim)
    for b in range(batch):
        blocks = -(-int(count[b]) // block_n)  # (ceiling divisions, as the kernel's `tl.cdiv`)
        chunk = -(-blocks // splits) * block_n
        n = int(count[b])
        for split in range(splits):
            slots = sel_idx[b, split * chunk:min(split * chunk + chunk, n)].long()
            out[b, :, split] = (k_cache[b, slots].float() * v_cache[b, slots].float()).sum(0)
    return out.reshape(batch * kv_heads * splits, head_dim)


GRID = {"block_n": (32, 64, 128), "num_stages": (1, 2, 3, 4), "num_warps": (4, 8), "splits": (1, 2, 4, 8, 16)}


def measure(batch: int, context: int, selected: int, copies: int, write) -> None:
    from gpu_timing import graph_time  # benchmarks/ is the script's directory

    import hf_vegas_kernels as kernels

    shape = (batch, context + TAIL + 1, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape, device="cuda", dtype=torch.bfloat16),
               torch.randn(shape, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
    kv_len = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    sel_end = kv_len - TAIL
    q = torch.randn(batch, KV_HEADS * GROUPS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q_slot = (kv_len - 1)[:, None]
    count = torch.full((batch,), selected, device="cuda", dtype=torch.int32)
    lists = {"random": torch.stack([torch.randperm(context - TAIL, device="cuda")[:selected].sort().values
                                    for _ in range(batch)]),
             "contiguous": torch.arange(selected, device="cuda").expand(batch, selected).contiguous()}
    read = batch * KV_HEADS * HEAD_DIM * 2 * 2  # keys and values, bf16, per slot of every row
    for order, idx in lists.items():
        for dtype in (torch.int64, torch.int32):
            sel = idx.to(dtype)
            seconds = graph_time(lambda i: kernels.sparse_draft_attention(
                q, *caches[i], q_slot, kv_len, sel, count, sel_end, HEAD_DIM**-0.5, list_len=selected + TAIL),
                copies)
            write({"op": "attention", "batch": batch, "context": context, "selected": selected, "order": order,
                   "index_dtype": str(dtype).removeprefix("torch."), "us": seconds * 1e6,
                   "GBps": read * (selected + TAIL) / seconds / 1e9})
        for block_n, stages, warps, splits in itertools.product(*GRID.values()):
            seconds = graph_time(lambda i: gather_sums(*caches[i], idx, count, splits, block_n,
                                                       num_stages=stages, num_warps=warps), copies)
            write({"op": "gather", "batch": batch, "context": context, "selected": selected, "order": order,
                   "index_dtype": "int64", "block_n": block_n, "num_stages": stages, "num_warps": warps,
                   "splits": splits, "us": seconds * 1e6, "GBps": read * selected / seconds / 1e9})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=7500)
    parser.add_argument("--selected", nargs="+", type=int, default=[593],
                        help="selection lengths (593: the 525-slot budget at the boost a real run drafts at, 1.13x)")
    parser.add_argument("--copies", type=int, default=8, help="cache copies the graph cycles through")
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gather_floor.jsonl"))
    args = parser.parse_args()
    if min(args.batch, args.copies, *args.selected) < 1 or max(args.selected) > args.context - TAIL:
        parser.error(f"--batch, --copies and --selected take counts of at least 1, and --selected at most "
                     f"--context - {TAIL} (the candidates before the tail)")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gather_floor.py needs a CUDA GPU.")
    import transformers
    from gpu_timing import read_bandwidth
    from provenance import gpu_run
    from results_io import append_records

    import hf_vegas

    base = gpu_run(args.commit, transformers=transformers.__version__, hf_vegas=hf_vegas.__version__,
                   dtype="bfloat16", shape="smollm2-135m", read_bandwidth_GBps=read_bandwidth() / 1e9)
    records = []

    def write(record):  # appended as it comes, so a run cut short keeps what it measured
        records.append({**base, **record})
        append_records(args.out, records[-1:])

    for selected in args.selected:
        measure(args.batch, args.context, selected, args.copies, write)
        torch.cuda.empty_cache()
    print(f"read bandwidth {base['read_bandwidth_GBps']:.0f} GB/s ({base['gpu']})")
    for key in sorted({(r["selected"], r["op"], r["order"]) for r in records}):
        best = min((r for r in records if (r["selected"], r["op"], r["order"]) == key), key=lambda r: r["us"])
        setting = {k: best[k] for k in (*GRID, "index_dtype") if k in best}
        print(f"{key[0]:5d} selected  {key[1]:9s} {key[2]:10s} {best['us']:7.1f} us {best['GBps']:6.0f} GB/s  "
              f"{setting}")


if __name__ == "__main__":
    main()
