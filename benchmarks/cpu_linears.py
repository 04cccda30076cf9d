"""What a forward of M token rows costs in SmolLM2's linear layers on this CPU: why verifying gamma + 1 tokens is
not the price of one decode step here.

    python benchmarks/cpu_linears.py --threads 2

Every `nn.Linear` of SmolLM2-135M-Instruct (fp32, 538 MB of weights, lm_head included) applied to M rows, for each M
of --rows; median of --repeats passes. A decode or draft step is M = batch, a verification M = batch x (gamma + 1).
Where the products are bound by reading the weights, M rows cost what one does; on a small CPU they are not.
Each pass is timed two ways: `F.linear(x, W)` as the model runs it ("linear"), and as hf_vegas' CPU path runs it
(`hf_vegas.cpu_linears`: `(W @ x^T)^T`, one row as two; "weights_left": other BLAS shapes for the same numbers, up
to rounding), for the layers together and for the lm_head alone (49152 x 576, the largest).
Records go to --out (JSONL), a table ends the run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path

import torch

from cpu_throughput import cpu_name
from hf_vegas.cpu_linears import weights_left_linears
from provenance import commit
from results_io import append_records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 7, 8, 16, 28, 32])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_linears.jsonl"))
    args = parser.parse_args()
    if min(args.rows) < 1 or args.repeats < 1:
        raise SystemExit("--rows and --repeats must be positive.")
    torch.set_num_threads(args.threads)
    from hf_vegas.real_models import load_smollm2

    model, _ = load_smollm2(torch.float32, "cpu")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    base = dict(device="cpu", cpu=cpu_name(), cores=os.cpu_count(), threads=args.threads, torch=torch.__version__,
                commit=commit(), model="smollm2", dtype="float32", linears=len(linears), weight_bytes=weight_bytes)
    records = []
    # "weights_left" is what `hf_vegas.cpu_linears` runs (SmolLM2's linears have no bias)
    products = {"linear": lambda x, m: torch.nn.functional.linear(x, m.weight, m.bias),
                "weights_left": lambda x, m: m(x)}
    head = model.lm_head
    with torch.no_grad():
        for rows in args.rows:
            inputs = {m.in_features: torch.randn(rows, m.in_features) for m in linears}
            record = dict(base, rows=rows)
            for name, product in products.items():
                for part, modules in (("all", linears), ("lm_head", [head])):
                    context = weights_left_linears(model) if name == "weights_left" else contextlib.nullcontext()
                    passes = []
                    with context:
                        for _ in range(args.repeats + 1):  # the first pass warms up
                            start = time.perf_counter()
                            for m in modules:
                                product(inputs[m.in_features], m)
                            passes.append(time.perf_counter() - start)
                    record[f"{name}_{part}_ms"] = statistics.median(passes[1:]) * 1e3
            record.update(ms=record["linear_all_ms"], weight_GBps=weight_bytes / record["linear_all_ms"] / 1e6)
            records.append(record)
    append_records(args.out, records)
    one = records[0]["ms"] if records[0]["rows"] == 1 else None
    print(f"\n{'rows':>5} {'linear ms':>9} {'GB/s':>6} {'x 1 row':>8} {'weights-left ms':>15} "
          f"{'lm_head linear':>14} {'lm_head w-left':>14}")
    for r in records:
        ratio = f"{r['ms'] / one:8.2f}" if one else "       -"
        print(f"{r['rows']:>5} {r['ms']:>9.1f} {r['weight_GBps']:>6.1f} {ratio} {r['weights_left_all_ms']:>15.1f} "
              f"{r['linear_lm_head_ms']:>14.1f} {r['weights_left_lm_head_ms']:>14.1f}")

if __name__ == "__main__":
    main()
