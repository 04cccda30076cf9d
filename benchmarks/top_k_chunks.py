"""The top-k selection of long rows: one program per row against the chunked radix passes, setting by setting.

    python benchmarks/top_k_chunks.py                                  # 36 x 16 x 33,024 and 36 x 1 x 131,328 slots
    python benchmarks/top_k_chunks.py --shapes 36x16x33024 --chunks 2048 4096 --bits 8 --warps 4 8

A shape is LAYERSxROWSxSLOTS: one verification's selection at the Qwen3-8B shape (36 full-attention layers) is
36 x 16 x 33,024 at batch 16 x 32K. Scores are softmax-like (per row the softmax of normal logits of std 3), each
row's candidates all but its last 300 slots, its budget 7 % of them. For each shape, one program per row
(`_launch.SELECT_TUNING["chunk"]` 0) and then every chunk x bits x warps setting of `select_chunked.py`: one
`select_topk` over every layer captured in a CUDA graph and timed by `gpu_timing.graph_time` (median of 20 replays),
and each setting's lists compared with one program per row's. Each setting compiles its kernels first (seconds
each, a progress bar counts them); its record goes to --out (JSONL, with GPU, versions, commit) as soon as it is
timed, so a run stopped early keeps what it measured; a table is printed last. The defaults in
`_launch.SELECT_TUNING` came from such a sweep.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
from tqdm.auto import tqdm

from gpu_timing import graph_time
from provenance import gpu_run
from results_io import append_records

SHAPES = ["36x16x33024", "36x1x131328"]
WARPS = (1, 2, 4, 8, 16, 32)


def parse_shape(text: str) -> tuple[int, int, int]:
    """`LAYERSxROWSxSLOTS` -> three positive ints, slots above 300 (the candidates leave out the last 300)."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts) or int(parts[2]) <= 300:
        raise SystemExit(f"--shapes {text!r}: expected LAYERSxROWSxSLOTS, positive, more than 300 slots "
                         "(e.g. 36x16x33024)")
    layers, rows, slots = map(int, parts)
    return layers, rows, slots


def check_settings(chunks: list[int], bits: list[int], warps: list[int]) -> None:
    """Refuse a setting the chunked passes would refuse (their own check) or could not launch, before any GPU
    work."""
    from hf_vegas_kernels import select_chunked

    for flag, values, check in (("--chunks", chunks, lambda c: select_chunked.check_settings(c, 8)),
                                ("--bits", bits, lambda b: select_chunked.check_settings(16, b))):
        for value in values:
            try:
                check(value)
            except ValueError as error:
                raise SystemExit(f"{flag} {value}: {error}") from None
    for w in warps:
        if w not in WARPS:
            raise SystemExit(f"--warps {w}: one of {WARPS}")


def measure(layers: int, rows: int, slots: int, settings: list[dict]):
    """One record per setting (one program per row first), yielded as soon as it is timed."""
    from hf_vegas_kernels import _launch, select

    gen = torch.Generator(device="cuda").manual_seed(layers * rows + slots)
    scores = torch.softmax(torch.randn(layers, rows, slots, device="cuda", generator=gen) * 3, dim=-1)
    cand_end = torch.full((rows,), slots - 300, device="cuda", dtype=torch.long)
    budget = int(0.07 * (slots - 300))
    count = torch.full((rows,), budget, device="cuda", dtype=torch.long)
    out = torch.empty(layers, rows, budget, dtype=torch.long, device="cuda")
    saved = dict(_launch.SELECT_TUNING)
    reference = None
    try:
        for setting in tqdm([{"chunk": 0}] + settings, desc=f"{layers}x{rows}x{slots}", dynamic_ncols=True):
            _launch.SELECT_TUNING.update(saved, **setting)
            out.fill_(-1)
            us = graph_time(lambda i: select.select_topk(scores, count, cand_end, out), 1) * 1e6
            if reference is None:
                reference = out.clone()
            yield dict(layers=layers, rows=rows, slots=slots, budget=budget, setting=setting, us=us,
                       same_as_one_program_per_row=bool(torch.equal(out, reference)))
    finally:
        _launch.SELECT_TUNING.clear()
        _launch.SELECT_TUNING.update(saved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="LAYERSxROWSxSLOTS")
    parser.add_argument("--chunks", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    parser.add_argument("--bits", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/top_k_chunks.jsonl"))
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse)")
    args = parser.parse_args()
    shapes = [parse_shape(s) for s in args.shapes]
    check_settings(args.chunks, args.bits, args.warps)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/top_k_chunks.py needs a CUDA GPU.")
    base = gpu_run(args.commit)
    settings = [dict(chunk=c, bits=b, chunk_warps=w) for c, b, w in itertools.product(args.chunks, args.bits,
                                                                                         args.warps)]
    records = []
    for shape in shapes:
        for record in measure(*shape, settings):
            records.append(dict(base, **record))
            append_records(args.out, records[-1:])
    print(f"{'layers x rows x slots':>22} {'us':>9}  setting (lists equal to one program per row's)")
    for r in records:
        shape = f"{r['layers']}x{r['rows']}x{r['slots']}"
        print(f"{shape:>22} {r['us']:>9.1f}  {r['setting']} ({r['same_as_one_program_per_row']})")


if __name__ == "__main__":
    main()
