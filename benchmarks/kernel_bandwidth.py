"""Kernel benchmark: time, bytes moved and achieved bandwidth of every hf_vegas kernel at real attention shapes.

    python benchmarks/kernel_bandwidth.py                       # all shapes, batch {1, 8, 64}, context {8K, 32K, 128K}
    python benchmarks/kernel_bandwidth.py --shapes qwen3-8b --batches 4 --contexts 32768
    python benchmarks/kernel_bandwidth.py --sweep --verify-only --shapes smollm2-135m --batches 64 --contexts 7500

For each (model shape, batch, context) that fits in memory it measures, with CUDA graphs (launch cost amortised)
over enough cache copies that the working set exceeds L2:
  draft      sparse draft decode attention, budget clamp(ceil(0.07 n), 256, n) + a 7-token tail (`--boost B`:
             the rows' budgets spread up to B times that, with the split hints the generation gives);
  dense      dense decode attention (1 query token, no scores): "our dense" path;
  verify     verification attention, gamma + 1 = 7 query tokens, without scores, and with scores emitted
             (`logits`: per KV-head sums; `weights`: per query head, for the log-sum-exp rebuild);
  select     score finalisation + top-k selection for one layer.
Bandwidth is compared with a measured device-to-device copy. One JSON record per measurement goes to --out, with
GPU, versions, commit and shapes; a short table is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import hf_vegas_kernels as kernels
import torch
import transformers
import triton
from tqdm.auto import tqdm

import hf_vegas
from gpu_timing import copy_bandwidth, graph_time, read_bandwidth  # benchmarks/ is the script's directory
from launch_tuning import apply_tuning
from provenance import commit, dirty, tree

# Attention shapes of the two reference models: (query heads, KV heads, head dim, full-attention layers).
SHAPES = {"smollm2-135m": (9, 3, 64, 30), "qwen3-8b": (32, 8, 128, 36)}
# Parameter bytes in bf16, read once per forward: the rest of a Vegas iteration's memory traffic.
WEIGHT_BYTES = {"smollm2-135m": 134.5e6 * 2, "qwen3-8b": 8.19e9 * 2}
GAMMA, SPARSITY, MIN_TOKENS = 6, 0.07, 256
L2_FLUSH_BYTES = 256 << 20  # rotate over cache copies until one round moves at least this much


def budget(n: int) -> int:
    return min(max(math.ceil(SPARSITY * n), MIN_TOKENS), n)


def bench_shape(name, batch, context, dtype, bandwidth, base, write, light=False):
    q_heads, kv_heads, head_dim, layers = SHAPES[name]
    elem = torch.finfo(dtype).bits // 8
    slots = context + 2 * GAMMA + 2
    kv_bytes_per_slot = kv_heads * head_dim * 2 * elem  # keys + values of one token, one layer
    cache_bytes = batch * slots * kv_bytes_per_slot
    copies = max(1, min(math.ceil(L2_FLUSH_BYTES / cache_bytes), 8))
    caches = [
        (torch.randn(batch, slots, kv_heads, head_dim, device="cuda", dtype=dtype),
         torch.randn(batch, slots, kv_heads, head_dim, device="cuda", dtype=dtype))
        for _ in range(copies)
    ]
    kv_len = torch.full((batch,), context, device="cuda")
    scaling = head_dim**-0.5

    def query(tokens):
        q = torch.randn(batch, q_heads, tokens, head_dim, device="cuda", dtype=dtype)
        q_slot = kv_len[:, None] - tokens + torch.arange(tokens, device="cuda")[None, :]
        return q, q_slot

    def record(op, seconds, read_bytes, moved_bytes, **extra):
        write({**base, "shape": name, "batch": batch, "context": context, "op": op, "us": seconds * 1e6,
               "kv_bytes_read": read_bytes, "bytes_moved": moved_bytes,
               "kv_bandwidth_GBps": read_bytes / seconds / 1e9, "bandwidth_GBps": moved_bytes / seconds / 1e9,
               "fraction_of_copy": read_bytes / seconds / bandwidth,
               "fraction_of_read": read_bytes / seconds / (base["read_bandwidth_GBps"] * 1e9), **extra})
        return seconds

    q1, slot1 = query(1)
    qv, slotv = query(GAMMA + 1)
    q_bytes = lambda q: q.numel() * elem * 2  # read q, write out
    if light == "draft":
        return {"draft": _draft_time(q1, caches, slot1, kv_len, context, batch, scaling)}
    if light == "verify":  # as the generation verifies: softmax-weight scores (its default) of two query rows
        rows = torch.tensor([0, GAMMA], device="cuda")
        return {"verify": graph_time(lambda i: kernels.dense_attention(qv, *caches[i], slotv, kv_len, scaling),
                                     copies),
                "verify_weights": graph_time(lambda i: kernels.verify_attention(qv, *caches[i], slotv, kv_len,
                                                                                scaling, rows, "weights"), copies)}

    # Dense decode and verification (full cache, per-row length).
    full_read = batch * context * kv_bytes_per_slot
    t_dense = graph_time(lambda i: kernels.dense_attention(q1, *caches[i], slot1, kv_len, scaling), copies)
    record("dense", t_dense, full_read, full_read + q_bytes(q1))
    t_verify = graph_time(lambda i: kernels.dense_attention(qv, *caches[i], slotv, kv_len, scaling), copies)
    record("verify", t_verify, full_read, full_read + q_bytes(qv))
    rows = torch.tensor([0, GAMMA], device="cuda")
    timed = {}
    for score, emitted_heads in (("logits", kv_heads),) if light else (("logits", kv_heads), ("weights", q_heads)):
        seconds = graph_time(
            lambda i, score=score: kernels.verify_attention(qv, *caches[i], slotv, kv_len, scaling, rows, score),
            copies,
        )
        emitted = batch * 2 * emitted_heads * context * 4
        timed[score] = record(f"verify+scores({score})", seconds, full_read, full_read + q_bytes(qv) + emitted,
                              overhead_vs_verify=seconds / t_verify - 1)

    t_draft = _draft_time(q1, caches, slot1, kv_len, context, batch, scaling)
    count = budget(context - GAMMA - 1)
    sel_end, sel_count = kv_len - GAMMA - 1, torch.full((batch,), count, device="cuda")
    draft_read = batch * (count + GAMMA + 1) * kv_bytes_per_slot
    record("draft", t_draft, draft_read, draft_read + batch * count * 8 + q_bytes(q1), selected=count)

    if light:
        return {"dense": t_dense, "verify": t_verify, "draft": t_draft, "verify_logits": timed["logits"]}
    # Selection: finalise the emitted scores (once per layer), then top-k for every layer in one launch.
    _, emitted, lse = kernels.verify_attention(qv, *caches[0], slotv, kv_len, scaling, rows, "weights")
    layer_scores = torch.empty(layers, batch, slots, device="cuda")
    out = torch.empty(layers, batch, count, dtype=torch.long, device="cuda")
    finalize = lambda i: kernels.finalize_scores(emitted, lse, rows, sel_end, q_heads, True, True,
                                                 out=layer_scores[i][:, None])
    t_final = graph_time(finalize, layers) * layers
    t_topk = graph_time(lambda i: kernels.select_topk(layer_scores, sel_count, sel_end, out), 1)
    # One Vegas iteration moves the weights gamma + 1 times, every layer's full KV once (verify) and the sparse KV
    # gamma times; at copy bandwidth that is a lower bound on its time, so the selection share below is an upper one.
    iteration_bytes = (GAMMA + 1) * WEIGHT_BYTES[name] + layers * (full_read + GAMMA * draft_read)
    iteration_bound = iteration_bytes / bandwidth
    record("select(all layers)", t_final + t_topk, 0, layers * (emitted.numel() + 2 * batch * slots) * 4,
           finalize_us=t_final * 1e6, topk_us=t_topk * 1e6, layers=layers, iteration_bound_ms=iteration_bound * 1e3,
           fraction_of_iteration=(t_final + t_topk) / iteration_bound)
    caches.clear()
    torch.cuda.empty_cache()
    return {"dense": t_dense, "verify": t_verify, "draft": t_draft, "select": t_final + t_topk}


BOOST = 1.0  # --boost: the budget boost of the generation's selection (VegasConfig.budget_boost)


def _draft_time(q1, caches, slot1, kv_len, context, batch, scaling) -> float:
    """Sparse draft: the budget's selected slots plus the tail (accepted tokens and drafts since the selection).
    With a `BOOST` above 1 the rows' budgets spread evenly from the budget to the boosted one, and the kernel gets
    the hints `SelectionState` gives it (a list bound of the boosted budget, splits no longer than the budget)."""
    sel_end = kv_len - GAMMA - 1
    candidates = context - GAMMA - 1
    count = budget(candidates)
    top = min(math.ceil(count * BOOST), candidates)
    counts = torch.linspace(count, top, batch).round().long().cuda()
    sel_idx = torch.zeros(batch, top, dtype=torch.long, device="cuda")
    for b in range(batch):
        sel_idx[b, :counts[b]] = torch.randperm(candidates, device="cuda")[:counts[b]].sort().values
    tail = 2 * GAMMA + 1
    split_len = count + tail if BOOST > 1 else None
    return graph_time(
        lambda i: kernels.sparse_draft_attention(q1, *caches[i], slot1, kv_len, sel_idx, counts, sel_end,
                                                 scaling, list_len=top + tail, split_len=split_len), len(caches))


def sweep(name, batch, context, dtype, bandwidth, base, write, draft_only=False, verify_only=False):
    """Time draft, dense and verify(+logits) (or the draft alone, or the verification alone, without and with the
    softmax-weight scores a generation emits) under every launch setting of a grid, set into
    `_launch.TUNING` (waves 0: one split per (row, KV head), which a sparse draft writes itself while dense and verify
    pass it through the combine launch; `fused_combine`: the last split, or the only one, merges in the kernel, no
    combine launch). Each grid point replaces a kind's whole setting, so every kind rounds its split count up there
    (no "nearest" or "fill"): the split counts of the defaults are not all on the grid
    (`benchmarks/attention_splits.py` forces any count)."""
    from itertools import product

    from hf_vegas_kernels import _launch

    default = {kind: dict(values) for kind, values in _launch.TUNING.items()}
    try:
        grid = (product([16, 32, 64, 128], [2, 4, 8], [1, 2, 3, 4], [0, 1, 2, 3], [False, True]) if draft_only
                else product([32, 64, 128], [4, 8], [2, 3], [1, 2, 4], [True]) if verify_only
                else product([32, 64, 128], [2, 4, 8], [2, 3], [0, 1, 2, 4, 8], [False, True]))
        kinds = (["sparse", "sparse_wide_head"] if draft_only else ["verify", "verify_wide_head"] if verify_only
                 else list(_launch.TUNING))
        for block_n, warps, stages, waves, fused in grid:
            setting = {"block_n": block_n, "num_warps": warps, "num_stages": stages, "waves": waves,
                       "fused_combine": fused}
            # sparse and dense lists alike
            for kind in kinds:  # (a kind's switches outside the grid, as `balance`, keep their defaults)
                _launch.TUNING[kind] = {**{k: v for k, v in default[kind].items() if k == "balance"}, **setting}
            times = bench_shape(name, batch, context, dtype, bandwidth, base, lambda record: None,
                                light="draft" if draft_only else "verify" if verify_only else True)
            write({**base, "sweep": setting, "shape": name, "batch": batch, "context": context,
                   "op": "sweep", **{f"{op}_us": t * 1e6 for op, t in times.items()}})
    finally:
        _launch.TUNING.update(default)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--contexts", nargs="+", type=int, default=[8192, 32768, 131072])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--max-gib", type=float, default=40.0, help="skip configurations whose cache exceeds this")
    parser.add_argument("--sweep", action="store_true", help="sweep the attention kernel's launch settings instead")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--draft-only", action="store_true", help="with --sweep: the sparse draft attention only")
    only.add_argument("--verify-only", action="store_true",
                      help="with --sweep: the verification only, without and with softmax-weight scores")
    parser.add_argument("--boost", type=float, default=1.0,
                        help="draft budgets spread over [budget, boost x budget] with the generation's split hints")
    parser.add_argument("--tuning", nargs="+", default=[], metavar="KIND:KEY=VALUE",
                        help="override a launch setting for this run, e.g. verify:fused_combine=1 sparse:waves=4 "
                             "select:num_warps=4 (recorded with the results)")
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kernels.jsonl"))
    args = parser.parse_args()
    if (args.draft_only or args.verify_only) and not args.sweep:
        parser.error("--draft-only and --verify-only narrow a --sweep; add --sweep")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernel_bandwidth.py needs a CUDA GPU.")
    dtype = getattr(torch, args.dtype)
    overrides = apply_tuning(args.tuning)
    global BOOST
    BOOST = args.boost
    bandwidth = copy_bandwidth()
    base = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "hf_vegas": hf_vegas.__version__,
            "commit": args.commit or commit(), "dirty": dirty(), "tree": tree(), "dtype": args.dtype, "gamma": GAMMA,
            "sparsity": SPARSITY, "min_tokens": MIN_TOKENS, "copy_bandwidth_GBps": bandwidth / 1e9,
            "read_bandwidth_GBps": read_bandwidth() / 1e9, "tuning_overrides": overrides, "budget_boost": args.boost}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    records = []

    def write(record):
        records.append(record)
        with args.out.open("a") as f:
            f.write(json.dumps(record) + "\n")

    jobs = [(s, b, c) for s in args.shapes for b in args.batches for c in args.contexts]
    summary = {}
    for name, batch, context in tqdm(jobs, desc="kernel shapes", dynamic_ncols=True):
        _, kv_heads, head_dim, _ = SHAPES[name]
        gib = batch * context * kv_heads * head_dim * 4 * (torch.finfo(dtype).bits // 8) / 2**30
        if gib > args.max_gib:
            tqdm.write(f"skip {name} b{batch} ctx{context}: {gib:.1f} GiB of cache > --max-gib {args.max_gib}")
            continue
        if args.sweep:
            summary[(name, batch, context)] = sweep(name, batch, context, dtype, bandwidth, base, write,
                                                    args.draft_only, args.verify_only)
        else:
            summary[(name, batch, context)] = bench_shape(name, batch, context, dtype, bandwidth, base, write)
    if args.sweep:
        for key in summary:
            rows = [r for r in records if (r["shape"], r["batch"], r["context"]) == key]
            ops = (("draft",) if args.draft_only else ("verify", "verify_weights") if args.verify_only
                   else ("draft", "dense", "verify", "verify_logits"))
            for op in ops:
                for rank, best in enumerate(sorted(rows, key=lambda r: r[f"{op}_us"])[:3], 1):
                    print(f"{key} {op} #{rank}: {best[f'{op}_us']:.1f} us with {best['sweep']}")
        return

    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s, read bandwidth {base['read_bandwidth_GBps']:.0f} GB/s "
          f"({base['gpu']}, {args.dtype}); %copy = KV bytes read / time / copy bandwidth")
    print(f"{'shape':<13}{'batch':>6}{'ctx':>8} | {'op':<24}{'us':>10}{'GB/s':>8}{'%copy':>7}{'extra':>12}")
    for r in records:
        extra = (f"{100 * r['overhead_vs_verify']:+.1f}%" if "overhead_vs_verify" in r
                 else f"{100 * r['fraction_of_iteration']:.1f}%iter" if "fraction_of_iteration" in r else "")
        print(f"{r['shape']:<13}{r['batch']:>6}{r['context']:>8} | {r['op']:<24}{r['us']:>10.1f}"
              f"{r['kv_bandwidth_GBps']:>8.0f}{100 * r['fraction_of_copy']:>6.0f}%{extra:>12}")


if __name__ == "__main__":
    main()
