"""Top-p filtering on the GPU: transformers' sort-based `TopPLogitsWarper` against the threshold-search kernel.

    python benchmarks/top_p.py                        # rows {64, 448} x vocab {49152, 151936}
    python benchmarks/top_p.py --sweep                # also the kernel's launch settings (chunk, block, warps)
    python benchmarks/top_p.py --logits peaked        # one kind of rows (default: flat and peaked)

64 rows is a draft step's batch, 448 the verification's (64 rows x 7 positions). Times are medians of CUDA-graph
replays; the kernel's kept set is checked against the warper's on the same (bf16-rounded, so tied) scores. Rows are
`flat` (normal scores of std 3, then temperature 0.6: hundreds of tokens kept, most of the row near the cut) or
`peaked` (std 2.5 plus 32 tokens raised by 8-18, as a trained model's logits: a few kept, few near the cut; the
kernel's threshold passes read only the scores that can hold the cut). Records go to --out (JSONL, with GPU,
versions, commit); a table is printed last.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
from transformers.generation.logits_process import TopPLogitsWarper

from gpu_timing import graph_time
from hf_vegas_kernels import top_p as top_p_kernel
from provenance import gpu_run
from results_io import append_records

SWEEP = {"chunk": [1024, 2048, 4096], "block": [256, 512], "num_warps": [4, 8]}


def make_scores(kind: str, rows: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(rows + vocab)
    logits = torch.randn(rows, vocab, device="cuda", generator=gen) * (3.0 if kind == "flat" else 2.5)
    if kind == "peaked":
        raised = torch.randint(0, vocab, (rows, 32), device="cuda", generator=gen)
        logits.scatter_add_(1, raised, torch.rand(rows, 32, device="cuda", generator=gen) * 10 + 8)
    return logits.to(torch.bfloat16).float() / 0.6


def measure(kind: str, rows: int, vocab: int, top_p: float, tuning: dict) -> dict:
    scores = make_scores(kind, rows, vocab)
    warper = TopPLogitsWarper(top_p)
    saved = dict(top_p_kernel.TUNING)
    top_p_kernel.TUNING.update(tuning)
    try:
        got = top_p_kernel.top_p_filter(scores, top_p)
        kernel_us = graph_time(lambda i: top_p_kernel.top_p_filter(scores, top_p), 1) * 1e6
    finally:
        top_p_kernel.TUNING.clear()
        top_p_kernel.TUNING.update(saved)
    want = warper(None, scores.clone())
    warper_us = graph_time(lambda i: warper(None, scores), 1) * 1e6
    differing = int((got.isinf() != want.isinf()).any(dim=1).sum())
    return dict(logits=kind, rows=rows, vocab=vocab, top_p=top_p, tuning=tuning, kernel_us=kernel_us,
                warper_us=warper_us, rows_with_other_kept_set=differing,
                kept_per_row=float((~want.isinf()).sum(dim=1).float().mean()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 448])
    parser.add_argument("--vocab", nargs="+", type=int, default=[49152, 151936])
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--logits", nargs="+", choices=["flat", "peaked"], default=["flat", "peaked"])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/top_p.jsonl"))
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/top_p.py needs a CUDA GPU.")
    base = gpu_run(args.commit)
    settings = [dict(top_p_kernel.TUNING)]
    if args.sweep:
        settings += [dict(zip(SWEEP, values)) for values in itertools.product(*SWEEP.values())]
    records = [dict(base, **measure(kind, rows, vocab, args.top_p, tuning))
               for kind in args.logits for rows in args.rows for vocab in args.vocab for tuning in settings]
    append_records(args.out, records)
    print(f"{'logits':>7} {'rows':>5} {'vocab':>7} {'warper us':>10} {'kernel us':>10}  tuning  "
          "(rows whose kept set differs)")
    for r in records:
        print(f"{r['logits']:>7} {r['rows']:>5} {r['vocab']:>7} {r['warper_us']:>10.1f} {r['kernel_us']:>10.1f}  "
              f"{r['tuning']}  "
              f"({r['rows_with_other_kept_set']}, {r['kept_per_row']:.0f} kept per row)")


if __name__ == "__main__":
    main()
