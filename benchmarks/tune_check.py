"""Does `hf_vegas.tune` choose well? Issue 11's check on the GPU, in one run.

The prompts of `--workload` (e.g. smollm2:128x7500) split into two halves of interleaved rows. `tune()` runs on
the first half (timed: the target is under 3 minutes), then on the held-out second half. Reported:

- own grid: the chosen configuration's throughput over the best of the grid it measured (target >= 95 %);
- held out: the first half's choice, measured on the second half, over the best of the second half's grid
  (target >= 90 %); a choice the second grid did not visit is measured there by a one-point tune.

    python benchmarks/tune_check.py --workload smollm2:128x7500 --out benchmarks/results/tune.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).parent))

import hf_vegas  # noqa: E402
from provenance import gpu_run  # noqa: E402
from results_io import append_records  # noqa: E402
from workloads import load_model, parse_workload, prompts  # noqa: E402


def _speedup_of(report, gamma: int, sparsity: float) -> float | None:
    matches = [r["speedup"] for r in report.grid if r["gamma"] == gamma and r["sparsity"] == sparsity]
    return max(matches) if matches else None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="smollm2:128x7500", help="MODEL:BATCHxPROMPT (both halves together)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--sample", action="store_true", help="sampling (temperature 0.6, top-p 0.95)")
    parser.add_argument("--compile", action="store_true",
                        help="VegasConfig(compile=True): the grid runs uncompiled, the choice and the dense path are "
                             "then measured compiled")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tune.jsonl"))
    parser.add_argument("--commit", default=None)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    workload = parse_workload(args.workload)
    if workload.batch < 2 or workload.batch % 2:
        raise SystemExit(f"--workload needs an even batch (two halves), got {workload.batch}.")
    model, tokenizer = load_model(workload.model, workload.prompt_tokens + args.max_new_tokens)
    from prompts import load_texts

    ids, mask = prompts(workload, tokenizer, load_texts() if tokenizer is not None else None)
    halves = [(ids[start::2], mask[start::2]) for start in (0, 1)]
    decoding = dict(do_sample=True, temperature=0.6, top_p=0.95) if args.sample else dict(do_sample=False)
    base = hf_vegas.VegasConfig(compile=args.compile)

    def run_tune(half, **grid):
        start = time.perf_counter()
        report = hf_vegas.tune(model, half[0], attention_mask=half[1], base_config=base,
                               max_new_tokens=args.max_new_tokens, progress=not args.no_progress, **grid, **decoding)
        return report, time.perf_counter() - start

    tuned, tune_seconds = run_tune(halves[0])
    held, _ = run_tune(halves[1])
    chosen = tuned.config
    own_best = max(r["speedup"] for r in tuned.grid)
    own = (tuned.chosen["speedup"] if chosen.gamma > 0 else 1.0) / max(own_best, 1.0)
    held_best = max(max(r["speedup"] for r in held.grid), 1.0)  # the dense path (1.0) is always on the menu
    if chosen.gamma == 0:
        held_choice = 1.0
    else:
        held_choice = _speedup_of(held, chosen.gamma, chosen.sparsity)
        if held_choice is None:
            one, _ = run_tune(halves[1], gammas=[chosen.gamma], sparsities=[chosen.sparsity])
            held_choice = one.grid[0]["speedup"]
    record = gpu_run(args.commit, benchmark="tune_check", workload=str(workload), half_batch=workload.batch // 2,
                     max_new_tokens=args.max_new_tokens, decoding="sample" if args.sample else "greedy",
                     compile=args.compile, tune_seconds=tune_seconds, chosen_gamma=chosen.gamma,
                     chosen_sparsity=chosen.sparsity, chosen_speedup=tuned.chosen["speedup"], own_best=own_best,
                     own_share=own, held_best=held_best, held_choice=held_choice, held_share=held_choice / held_best,
                     held_choice_gamma=held.config.gamma, held_choice_sparsity=held.config.sparsity,
                     dense_tokens_per_s=tuned.dense["tokens_per_s"], compiled_choice=tuned.compiled,
                     grid=tuned.grid, held_grid=held.grid)
    append_records(args.out, [record])
    print(f"{'workload':<22}{'tune s':>8}{'choice':>14}{'speedup':>9}{'own %':>8}{'held %':>8}")
    print(f"{str(workload):<22}{tune_seconds:>8.1f}{f'g{chosen.gamma} s{chosen.sparsity:g}':>14}"
          f"{tuned.chosen['speedup']:>9.2f}{100 * own:>8.1f}{100 * held_choice / held_best:>8.1f}")
    if tuned.compiled:
        print(f"compiled: the choice {tuned.compiled['tokens_per_s']:.0f} tok/s against the compiled dense path's "
              f"{tuned.compiled['dense_tokens_per_s']:.0f}: {tuned.compiled['speedup']:.2f}x")
        for name in ("eager_reason", "dense_eager_reason"):  # a compiled measurement that ran eagerly says so
            if tuned.compiled.get(name):
                print(f"  ({name}: {tuned.compiled[name]})")
    return record


if __name__ == "__main__":
    main()

