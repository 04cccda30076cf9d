"""Throughput benchmark: HF's best vanilla generate, our dense path and Vegas, in one run on one GPU.

    python benchmarks/throughput.py                           # every default workload (below), greedy and sampling
    python benchmarks/throughput.py --workloads smollm2:64x7500 --decodings greedy
    python benchmarks/throughput.py --workloads smollm2:64x7500 --decodings sample --seeds 0 1 2 3 4   # draws' spread
    python benchmarks/throughput.py --sweep --compile         # the regime map: SmolLM2, batch x prompt grid
    python benchmarks/throughput.py --workloads smollm2:64x7500 --methods vegas --compile --repeats 2 --tuning-sets
        "pdl:early_trigger=0" ""                              # (one command) an A/B of launch settings, one process
    python benchmarks/plot_throughput.py                      # README's PNG, from the JSONL
    python benchmarks/plot_regime.py                          # the regime map's PNG

Methods, on the same prompts in one process:
  hf         HF `generate` with a static cache (which makes it torch.compile the decode step; its fastest path)
  dense      hf_vegas with gamma = 0: one token per step over the Vegas cache, Triton dense attention, CUDA graphs
  vegas      hf_vegas, policy "vegas" (defaults: gamma 6, sparsity 0.07, min 256 tokens, weights scores)
  vegas-all  vegas with `selection_heads="all"` (under tensor parallelism: scores averaged over the ranks)
  streaming  hf_vegas, policy "streaming" (StreamingLLM selection) at the same gamma and budget
Under `torchrun --nproc_per_node N` the model is sharded with `tp_plan="auto"` (`tensor_parallel_runs.py`);
`--tp-all-reduce symmetric_memory` sums our methods' row-parallel outputs through symmetric memory (2 GPUs).
Each runs once to warm up (compile, capture), then once timed (sampling: once per `--seeds` seed, each its own record,
compared with the other methods' call of the same seed; the table ends with the mean over the seeds: the batch waits
for its slowest row, and the draws decide which row that is, so one seed's tokens/s is one draw of a spread).
Decode tokens/s = batch x (new tokens - 1) / the time from the first token (after the prefill) to the last. EOS is
ignored: every row generates exactly the tokens asked.
Bounds (`hf_vegas/traffic.py`): the bytes a step must read over the read bandwidth measured in this run. On
random-weight shapes Vegas' throughput is projected: measured iteration time x tokens per iteration of SmolLM2 (same
decoding and selection settings), its rows' draft budgets following SmolLM2's rows' (`projection.py`). Vegas'
bounds read its drafts' mean budget scale (`budget_boost`).
Every record (GPU, versions, commit, workload, config, times, bounds) is appended to --out; a table ends the run.
"""

from __future__ import annotations

import argparse
import uuid
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

import hf_vegas
import tensor_parallel_runs
import workloads
from gpu_timing import read_bandwidth
import launch_tuning
import projection
from provenance import gpu_run
from results_io import append_records, read_records
from generation_runs import COMMON_GENERATE, DECODINGS, agreement, fp32_greedy, run_hf, run_ours
from throughput_records import SPECULATIVE, add_ratios, add_throughput, as_run
from throughput_table import print_table

METHODS = ("hf", "dense", "vegas", "vegas-all", "streaming")


def vegas_config(method: str, args) -> hf_vegas.VegasConfig:
    if method == "dense":
        return hf_vegas.VegasConfig(gamma=0, compile=args.compile, tp_all_reduce=args.tp_all_reduce)
    return hf_vegas.VegasConfig(gamma=args.gamma, sparsity=args.sparsity, min_tokens=args.min_tokens,
                                budget_boost=args.budget_boost, score=args.score, policy=_policy(method),
                                selection_heads="all" if method == "vegas-all" else "local", compile=args.compile,
                                tp_all_reduce=args.tp_all_reduce)


def _policy(method: str) -> str:
    return "vegas" if method == "vegas-all" else method


def _gamma(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--gamma takes an integer >= 1 or auto, got {text!r}")
    return int(text)


def _inductor_options(pairs: list[str]) -> dict:
    """`["combo_kernels=True"]` -> `{"combo_kernels": True}`, each option checked against torch's inductor config."""
    import ast

    import torch._inductor.config as inductor_config

    options = {}
    for pair in pairs:
        option, sep, value = pair.partition("=")
        if not sep or not hasattr(inductor_config, option):
            raise SystemExit(f"--inductor takes OPTION=VALUE with an option of torch._inductor.config, got {pair!r}")
        try:
            options[option] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[option] = value  # a plain string value
    return options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=None,
                        help=f"MODEL:BATCHxPROMPT_TOKENS, MODEL in {list(workloads.MODELS)} (default: "
                        f"{' '.join(workloads.DEFAULT_WORKLOADS)}; with --sweep: the regime grid)")
    parser.add_argument("--sweep", action="store_true", help="the regime map: SmolLM2 at every --sweep-batches x "
                        "--sweep-prompts, records marked for plot_regime.py (greedy unless --decodings says)")
    parser.add_argument("--sweep-batches", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--sweep-prompts", nargs="+", type=int, default=[2000, 8000, 16000])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--decodings", nargs="+", choices=list(DECODINGS), default=None,
                        help="default: greedy and sample (with --sweep: greedy)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="real models")
    parser.add_argument("--shape-new-tokens", type=int, default=32, help="random-weight shapes (timing only)")
    parser.add_argument("--gamma", type=_gamma, default=6, help="an integer >= 1, or auto (vegas_gamma='auto')")
    parser.add_argument("--sparsity", type=float, default=0.07)
    parser.add_argument("--min-tokens", type=int, default=256)
    parser.add_argument("--budget-boost", type=float, default=hf_vegas.VegasConfig.budget_boost,
                        help="VegasConfig.budget_boost: up to this multiple of the budget for rows whose drafts are "
                             "rejected")
    parser.add_argument("--score", default="weights")
    parser.add_argument("--compile", action="store_true", help="vegas_compile=True for our methods")
    parser.add_argument("--tp-all-reduce", choices=hf_vegas.config.TP_ALL_REDUCES, default="nccl",
                        help="vegas_tp_all_reduce for our methods under torchrun (2 GPUs)")
    parser.add_argument("--data-files", help="local file of prompt texts for `datasets` (default: Python's docs)")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--project-from", type=Path, help="JSONL with real-model records whose tokens/iteration "
                        "project the random-weight shapes' throughput (default: this run's records)")
    parser.add_argument("--projected-budget", choices=projection.BUDGETS, default="rows",
                        help="random-weight shapes: their selections note the real model's rows' rejections, "
                             "iteration by iteration (rows), or their own (config): rows of random weights reject "
                             "every draft, so they reach the full budget_boost")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/throughput.jsonl"))
    parser.add_argument("--fp32-reference", action="store_true",
                        help="also measure each greedy method's first divergence from vanilla fp32 greedy tokens")
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    parser.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                        help="prefill_chunk_size=N for every method: prompts prefilled N positions at a time")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--tp-model-dir", type=Path, default=Path("/tmp/hf_vegas_tp_models"),
                        help="under torchrun: where rank 0 saves a random-weight shape for every rank to load with "
                             "tp_plan='auto'")
    parser.add_argument("--tuning", nargs="+", default=[], metavar="KIND:KEY=VALUE",
                        help="override a kernel launch setting for this run, e.g. sparse:fused_combine=1 (recorded)")
    parser.add_argument("--tuning-sets", nargs="+", default=None, metavar="'KIND:KEY=VALUE ...'",
                        help="an A/B in one process: each of our methods runs once under each set of overrides "
                             "(quoted and space-separated; '' for the defaults), its graphs captured again (recorded "
                             "as tuning_set)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], metavar="SEED",
                        help="sampling: one timed call per torch seed, each its own record (a sampled batch waits for "
                             "its slowest row, and the draws decide which row that is: the spread over seeds is part "
                             "of the result); greedy runs once")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the whole list of jobs this many times, one pass after the other (run-to-run noise)")
    parser.add_argument("--inductor", nargs="+", default=[], metavar="OPTION=VALUE",
                        help="torch._inductor.config options for the compiled steps, e.g. combo_kernels=True "
                             "(recorded with the results; to measure which compiler levers pay)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/throughput.py needs a CUDA GPU.")
    if args.workloads is None:
        args.workloads = ([f"smollm2:{b}x{p}" for p in args.sweep_prompts for b in args.sweep_batches] if args.sweep
                          else list(workloads.DEFAULT_WORKLOADS))
    if args.decodings is None:
        args.decodings = ["greedy"] if args.sweep else list(DECODINGS)
    plan = [workloads.parse_workload(w) for w in args.workloads]  # bad input fails before any GPU work
    inductor = _inductor_options(args.inductor)
    tuning = launch_tuning.apply_tuning(args.tuning)
    tuning_sets = launch_tuning.parse_sets(args.tuning_sets) if args.tuning_sets else [None]
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be a positive integer, got {args.repeats}")
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        raise SystemExit(f"--seeds must be distinct non-negative integers, got {args.seeds}")
    if args.seeds != [0] and ("sample" not in args.decodings or not any(w.real_weights for w in plan)):
        raise SystemExit(f"--seeds {' '.join(map(str, args.seeds))} would change nothing: seeds apply to sampling, "
                         "which runs on real-model workloads with --decodings sample")
    defaults = launch_tuning.snapshot()  # with --tuning applied: each set starts from it
    if args.prefill_chunk is not None:
        if args.prefill_chunk < 1:
            raise SystemExit(f"--prefill-chunk must be a positive integer, got {args.prefill_chunk}")
        COMMON_GENERATE["prefill_chunk_size"] = args.prefill_chunk
    plan.sort(key=lambda w: not w.real_weights)  # real models first: the projections need their tokens/iteration
    world = tensor_parallel_runs.world_size()
    if world > 1 and any(w.real_weights for w in plan):
        raise SystemExit("Under torchrun the benchmark runs the random-weight shapes (qwen3-8b-shape): SmolLM2's 9 "
                         "query and 3 KV heads do not split over the ranks.")
    leader = world == 1 or tensor_parallel_runs.start() == 0  # the rank that writes records and prints

    bandwidth = read_bandwidth()
    # `run` marks this process's records (the plot finds a measurement's seeds by it, `plot_throughput.py`)
    base = gpu_run(args.commit, run=uuid.uuid4().hex, transformers=transformers.__version__,
                   hf_vegas=hf_vegas.__version__, dtype="bfloat16", read_bandwidth_GBps=bandwidth / 1e9,
                   world_size=world,
                   **({"inductor": inductor} if inductor else {}), **({"tuning_overrides": tuning} if tuning else {}),
                   **COMMON_GENERATE)
    for option, value in inductor.items():
        setattr(torch._inductor.config, option, value)
    texts = None
    if any(w.real_weights for w in plan):
        from prompts import load_texts

        texts = load_texts(args.data_files, args.text_column)
    records, loaded = [], (None, None, None)
    dense_tokens = {}  # greedy tokens of our dense path per workload, for the agreement of the speculative methods
    fp32_tokens = {}  # vanilla fp32 greedy tokens per workload (`--fp32-reference`)
    earlier = []  # earlier real-model records, for the projections only (not re-written or re-printed)
    if args.project_from:
        earlier = [r for r in read_records(args.project_from) if r["real_weights"] and "error" not in r]
    jobs = job_list(plan, args.decodings, args.methods, tuning_sets, args.repeats, args.seeds)
    bar = tqdm(jobs, desc="throughput", dynamic_ncols=True, disable=args.no_progress or not leader)
    current_set = None
    for repeat, workload, decoding, method, tuning_set, seed in bar:  # (seed None: greedy)
        bar.set_postfix_str(f"{workload} {decoding} {method}" + (f" [{tuning_set}]" if tuning_set is not None else "")
                            + (f" seed {seed}" if seed is not None else ""))
        if tuning_set != current_set and loaded[1] is not None:
            hf_vegas.release_graphs(loaded[1])  # graphs captured under other launch settings must not replay
        launch_tuning.restore(defaults)
        set_overrides = launch_tuning.apply_tuning(tuning_set.split()) if tuning_set is not None else None
        current_set = tuning_set
        if loaded[0] != workload.model:
            loaded = (None, None, None)
            hf_vegas.release_graphs()
            torch._dynamo.reset()
            positions = max(w.prompt_tokens for w in plan) + 1024
            model, tokenizer = (tensor_parallel_runs.load_sharded(workload.model, positions, args.tp_model_dir
                                                                  / workload.model) if world > 1
                                else workloads.load_model(workload.model, positions))
            loaded = (workload.model, model, tokenizer)
        _, model, tokenizer = loaded
        ids, mask = workloads.prompts(workload, tokenizer, texts)
        new_tokens = args.max_new_tokens if workload.real_weights else args.shape_new_tokens
        config = vegas_config(method, args) if method != "hf" else None
        real, history, projected = None, None, {}
        if method in SPECULATIVE and not workload.real_weights:  # the real model's acceptance and draft budget
            real = projection.source(earlier + records, config, decoding)
            history, projected = projection.history(config, real, args.projected_budget)
        if args.fp32_reference and decoding == "greedy" and workload.real_weights and str(workload) not in fp32_tokens:
            fp32_tokens[str(workload)] = fp32_greedy(workload, ids, mask, new_tokens)
        record = dict(base, sweep=args.sweep, model=workload.model, real_weights=workload.real_weights,
                      batch=workload.batch,
                      prompt_tokens=int(mask.sum(dim=1).max()), new_tokens=new_tokens, decoding=decoding,
                      method=method, config=config.to_dict() if config else {"cache_implementation": "static"},
                      **projected,
                      **({"tuning_set": set_overrides} if tuning_set is not None else {}),
                      **({"repeat": repeat} if args.repeats > 1 else {}),
                      **({"seed": seed} if seed is not None else {}))
        try:
            if method == "hf":
                hf_vegas.release_graphs()  # give HF the memory our cache held
                measured, sequences = run_hf(model, ids, mask, new_tokens, decoding, seed or 0)
            else:
                measured, sequences = run_ours(model, ids, mask, new_tokens, decoding, config, history, seed or 0)
            record.update(measured)
            if decoding == "greedy" and method == "dense":
                dense_tokens[str(workload)] = sequences
            elif decoding == "greedy" and method != "hf" and str(workload) in dense_tokens:
                record["agreement_with_dense"] = agreement(sequences, dense_tokens[str(workload)], ids.shape[1])
            if decoding == "greedy" and str(workload) in fp32_tokens:
                record["agreement_with_fp32"] = agreement(sequences, fp32_tokens[str(workload)], ids.shape[1])
            del sequences
        except torch.OutOfMemoryError as error:
            record.update(error=f"OutOfMemoryError: {str(error).splitlines()[0]}")
            torch.cuda.empty_cache()
        except Exception as error:  # noqa: BLE001  (HF's generate under TP may not support a static cache)
            if world == 1 or method != "hf":
                raise
            record.update(error=f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        if world > 1:  # (every rank: collectives)
            if tensor_parallel_runs.any_rank_failed("error" in record) and "error" not in record:
                record["error"] = "another rank's measurement failed"
            record.update(tensor_parallel_runs.per_rank_peaks(record))
            if "error" not in record:
                if config is None:  # HF's generate: transformers' NCCL sums
                    timed = hf_vegas.VegasConfig(gamma=0)
                else:  # (a gamma="auto" run that mostly ran its dense path: dense steps' collectives)
                    dense = hf_vegas.VegasConfig(gamma=0, tp_all_reduce=config.tp_all_reduce)
                    timed = as_run(config, record) or dense
                reach = workload.prompt_tokens + new_tokens + 2 * timed.gamma + 1 if timed.gamma else 0
                record.update(tensor_parallel_runs.nccl_per_iteration(model, workload.batch, timed, reach))
                record["nccl_fraction"] = record["nccl_ms_per_iteration"] / record["step_ms"]
        if "error" not in record:
            # the ranks read their shares of the weights and KV at once: the bound is over their bandwidth together
            add_throughput(record, model, workload, method, new_tokens, config, real, bandwidth * world)
            add_ratios(record, records)
        records.append(record)
        if leader:
            append_records(args.out, [record])
    if leader:
        print_table(records)
    if world > 1:
        tensor_parallel_runs.finish()


def job_list(plan, decodings, methods, tuning_sets, repeats: int, seeds) -> list[tuple]:
    """`(pass, workload, decoding, method, launch-setting set, seed)` in the order they run: random-weight shapes
    greedy only (their acceptance means nothing), sampling once per seed (greedy: seed None), HF outside the launch
    settings' A/B. Every pass runs every job; the sets take turns in opposite orders in alternate passes, so that
    neither is always the one that runs first (after a model load or another method)."""
    return [(rep, w, d, m, s, seed) for rep in range(repeats) for w in plan
            for d in (decodings if w.real_weights else ["greedy"]) for m in methods
            for s in ((tuning_sets if rep % 2 == 0 else tuning_sets[::-1]) if m != "hf" else [None])
            for seed in (seeds if d == "sample" else [None])]


if __name__ == "__main__":
    main()
