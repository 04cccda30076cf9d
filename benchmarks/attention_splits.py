"""Attention time against the number of splits per (row, KV head): where `_launch.TUNING`'s split rules come from.

    python benchmarks/attention_splits.py                                   # Qwen3-8B shape, 4 and 16 rows x 32K
    python benchmarks/attention_splits.py --batches 16 --splits 1 2 3 4 8 9 --draft-lists 2294 4588

Each split count is forced (the kind's `waves` set so that the launch takes exactly that many splits) for:
  verify   the verification, 7 query tokens, emitting the softmax-weight scores of two rows (as a generation does),
           with the splits merged by the combine launch and, up to `FUSED_COMBINE_MAX_SPLITS`, also in the kernel;
  dense    one-token decode over the whole cache;
  draft    a sparse draft over a sorted random selection of each `--draft-lists` length (plus a 7-slot tail).
Each is timed as a replayed CUDA graph over two cache copies (`gpu_timing.graph_time`), `--reps` times, interleaved,
and also under the current defaults. One JSON record per timing goes to --out with GPU, versions and commit.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import hf_vegas_kernels as kernels
import torch
import transformers
import triton
from hf_vegas_kernels import _launch
from hf_vegas_kernels.attention_splits import _num_splits

import hf_vegas
from gpu_timing import graph_time, read_bandwidth  # benchmarks/ is the script's directory
from launch_tuning import restore, snapshot
from provenance import commit, dirty, tree
from results_io import append_records

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-8B's attention
GAMMA = 6


def force_splits(kind: str, splits: int, pairs: int, **setting) -> None:
    """Set `kind`'s waves so that `attention_splits._num_splits` gives exactly `splits` (rounding up)."""
    sms = _launch.device_sm_count(torch.device("cuda"))
    _launch.TUNING[kind] = {**_launch.TUNING[kind], **setting, "waves": (splits - 0.5) * pairs / sms,
                            "nearest": False, "fill": 0.0}


def splits_taken(kind: str, list_len: int, pairs: int) -> int:
    """The splits a launch of `kind` over `list_len` entries really makes: a count that does not divide the list's
    blocks evenly can come out lower (513 blocks in 32 splits make chunks of 17 blocks, so 31 of them)."""
    setting = _launch.TUNING[kind]
    return _num_splits(list_len, pairs, setting["block_n"], setting["waves"], torch.device("cuda"),
                       setting.get("nearest", False), None, setting.get("fill", 0.0))[0]


def caches(batch: int, context: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (batch, context + 2 * GAMMA + 4, KV_HEADS, HEAD_DIM)
    return [(torch.randn(shape, device="cuda", dtype=torch.bfloat16),
             torch.randn(shape, device="cuda", dtype=torch.bfloat16)) for _ in range(2)]


def time_lists(batch, context, split_counts, reps, write, defaults):
    """Verification (with weights) and dense decode at each split count, and under the `defaults` (a `snapshot`)."""
    cache = caches(batch, context)
    kv_len = torch.full((batch,), context, device="cuda")
    q = torch.randn(batch, Q_HEADS, GAMMA + 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q_slot = kv_len[:, None] - GAMMA - 1 + torch.arange(GAMMA + 1, device="cuda")[None, :]
    q1, slot1 = q[:, :, :1].contiguous(), kv_len[:, None] - 1
    rows, scaling = torch.tensor([0, GAMMA], device="cuda"), HEAD_DIM**-0.5
    wide = batch * KV_HEADS >= 32
    verify_kind, dense_kind = ("verify_wide_head", "dense_wide_head") if wide else ("verify", "dense")
    verify = lambda i: kernels.verify_attention(q, *cache[i], q_slot, kv_len, scaling, rows, "weights")
    dense = lambda i: kernels.dense_attention(q1, *cache[i], slot1, kv_len, scaling)
    slots = cache[0][0].shape[1]
    for rep in range(reps):
        for splits in [*split_counts, None]:
            # (past FUSED_COMBINE_MAX_SPLITS the kernel never merges: no second timing of the combine launch)
            merging = (False, True) if splits and splits <= _launch.FUSED_COMBINE_MAX_SPLITS else (False,)
            for fused in (merging if splits else (None,)):
                if splits:
                    force_splits(verify_kind, splits, batch * KV_HEADS, fused_combine=fused)
                    force_splits(dense_kind, splits, batch * KV_HEADS, fused_combine=fused)
                else:
                    restore(defaults)
                write({"op": "lists", "batch": batch, "context": context, "splits": splits or "default",
                       "splits_taken": {kind: splits_taken(kind, slots, batch * KV_HEADS)
                                        for kind in (verify_kind, dense_kind)},
                       "fused_combine": fused, "rep": rep, "verify_weights_us": graph_time(verify, 2) * 1e6,
                       "dense_us": graph_time(dense, 2) * 1e6})


def time_drafts(batch, context, lengths, split_counts, write):
    """Sparse drafts over `lengths` selected slots at each split count, under the wide-head kind's setting."""
    cache = caches(batch, context)
    kv_len = torch.full((batch,), context, device="cuda")
    q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q_slot, sel_end = kv_len[:, None] - 1, kv_len - GAMMA - 1
    for n in lengths:
        sel_idx = torch.stack([torch.randperm(context - GAMMA - 1, device="cuda")[:n].sort().values
                               for _ in range(batch)])
        count = torch.full((batch,), n, device="cuda")
        for splits in split_counts:
            force_splits("sparse_wide_head", splits, batch * KV_HEADS)
            seconds = graph_time(lambda i: kernels.sparse_draft_attention(
                q, *cache[i], q_slot, kv_len, sel_idx, count, sel_end, HEAD_DIM**-0.5, list_len=n + GAMMA + 1), 2)
            write({"op": "draft", "batch": batch, "context": context, "selected": n, "splits": splits,
                   "splits_taken": splits_taken("sparse_wide_head", n + GAMMA + 1, batch * KV_HEADS),
                   "us": seconds * 1e6})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", nargs="+", type=int, default=[4, 16])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--splits", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 24, 32, 33])
    parser.add_argument("--draft-lists", nargs="*", type=int, default=[2294, 4588],
                        help="selection lengths of the draft timings (none: no drafts)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/attention_splits.jsonl"))
    args = parser.parse_args()
    if min(args.splits) < 1 or args.reps < 1:
        parser.error("--splits and --reps take counts of at least 1")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention_splits.py needs a CUDA GPU.")
    base = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "hf_vegas": hf_vegas.__version__,
            "commit": args.commit or commit(), "dirty": dirty(), "tree": tree(), "dtype": "bfloat16",
            "shape": "qwen3-8b", "read_bandwidth_GBps": read_bandwidth() / 1e9}
    records = []

    def write(record):  # appended as it comes, so a run cut short keeps what it measured
        records.append({**base, **record})
        append_records(args.out, records[-1:])
        print({k: round(v, 1) if isinstance(v, float) else v for k, v in record.items()}, flush=True)

    defaults = snapshot()
    try:
        for batch in args.batches:
            time_lists(batch, args.context, args.splits, args.reps, write, defaults)
            if args.draft_lists:
                time_drafts(batch, args.context, args.draft_lists, [s for s in args.splits if s <= 8], write)
            torch.cuda.empty_cache()
    finally:
        restore(defaults)
    print(f"\n{base['gpu']}: verification with weights / dense decode, us (the middle rep; of an even number, the "
          "slower of the middle two), by splits")
    for batch in args.batches:
        for splits in [*args.splits, "default"]:
            for fused in (False, True, None):
                got = [r for r in records if r["op"] == "lists" and r["batch"] == batch and r["splits"] == splits
                       and r["fused_combine"] == fused]
                if got:
                    v = sorted(r["verify_weights_us"] for r in got)[len(got) // 2]
                    d = sorted(r["dense_us"] for r in got)[len(got) // 2]
                    print(f"batch {batch:>3} splits {splits!s:>7} fused {fused!s:>5}: {v:8.1f} {d:8.1f}")


if __name__ == "__main__":
    main()
