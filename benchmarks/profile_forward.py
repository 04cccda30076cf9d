"""Where a Vegas iteration's GPU time and memory go: kernels per step kind (torch.profiler) and peak memory.

    python benchmarks/profile_forward.py --batch 64 --prompt-tokens 7500 --compile          # graphs, as benchmarked
    python benchmarks/profile_forward.py --random-weights --compile --sequence 26           # + one layer's chain
    python benchmarks/profile_forward.py --eager                                            # every kernel launch
    python benchmarks/profile_forward.py --random-weights --sample                          # no GGUF needed
    python benchmarks/profile_forward.py --qwen3-8b-shape --batch 4 --prompt-tokens 32768 --compile
    torchrun --nproc_per_node 2 benchmarks/profile_forward.py --qwen3-8b-shape ...   # under TP; rank 0's kernels
    torchrun --nproc_per_node 2 benchmarks/profile_forward.py --qwen3-8b-shape --tp-all-reduce symmetric_memory ...
    ... --vegas-only                              # no dense generations, no memory comparison: a third of the time

Runs a warm-up generation (Triton compiles, graphs captured), then a second one in which the first draft (its gamma
forwards and token choices), the first verify forward and the second iteration are each profiled on their own (one
replay per graph when graphs are on: the profiler still sees every kernel of the graph), and a dense (gamma = 0)
generation whose fifth decode step is profiled, for comparison with a verification. Prints, per step kind, the
kernel count, the summed kernel time and the costliest kernel families; then the peak memory of each step kind and
of whole dense (gamma = 0) and Vegas generations on the same batch. Random weights have SmolLM2-135M's shape (or
Qwen3-8B's with `--qwen3-8b-shape`): timing and memory only, no acceptance. `--trace DIR` also writes each profile
as a Chrome trace.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import hf_vegas
from hf_vegas import loop
from hf_vegas.runner import StepRunner

GiB = 2**30


def load(random_weights: bool, qwen3_8b_shape: bool = False, max_positions: int = 0):
    if qwen3_8b_shape:  # the throughput benchmark's random-weight Qwen3-8B shape
        import workloads

        return workloads.load_model("qwen3-8b-shape", max_positions)[0]
    if not random_weights:
        from hf_vegas.real_models import load_smollm2

        return load_smollm2(torch.bfloat16, "cuda")[0]
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=16384,
                         rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def chain_increments(spans: list[tuple[float, float]]) -> list[float]:
    """For kernels `(start, duration)` in launch order: what each adds to the step's span, its end past the latest
    end before it (0 if it ends earlier). Under programmatic dependent launch a kernel starts, and its clock runs,
    while the one it waits for still runs, so durations overlap and over-count; these increments add up to the time
    the kernels keep the GPU busy (the span less its idle gaps) and say what each launch costs the chain."""
    latest, increments = float("-inf"), []
    for start, duration in spans:
        end = start + duration
        increments.append(max(0.0, end - max(latest, start)))
        latest = max(latest, end)
    return increments


def kernel_table(prof, top: int, sequence: int = 0) -> str:
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    lines = [f"{len(kernels)} kernels, {sum(e.device_time for e in kernels) / 1e3:.3f} ms of kernel time"]
    if sequence:  # a window of the launch order (from the middle, so it shows one whole layer of a forward)
        ordered = sorted(kernels, key=lambda e: e.time_range.start)
        adds = chain_increments([(e.time_range.start, e.device_time) for e in ordered])
        middle = len(ordered) // 2
        lines.append("     start    duration   adds to the chain")
        for e, add in zip(ordered[middle:middle + sequence], adds[middle:middle + sequence]):
            lines.append(f"  {e.time_range.start - ordered[middle].time_range.start:9.1f} us  "
                         f"{e.device_time:7.2f} us  {add:7.2f} us  {e.name[:80]}")
    families = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        families[e.name[:70]][0] += 1
        families[e.name[:70]][1] += e.device_time
    for name, (count, micros) in sorted(families.items(), key=lambda item: -item[1][1])[:top]:
        lines.append(f"  {count:5d} {micros / 1e3:8.3f} ms  {name}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=7500)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--random-weights", action="store_true", help="SmolLM2's shape, random bf16 weights")
    parser.add_argument("--qwen3-8b-shape", action="store_true",
                        help="Qwen3-8B's shape with random bf16 weights (the throughput benchmark's qwen3-8b-shape)")
    parser.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                        help="prefill_chunk_size=N (prompts whose one-shot prefill does not fit beside the cache)")
    parser.add_argument("--eager", action="store_true", help="vegas_cuda_graphs=False")
    parser.add_argument("--compile", action="store_true", help="vegas_compile=True")
    parser.add_argument("--sample", action="store_true", help="temperature 0.6, top-p 0.95 instead of greedy")
    parser.add_argument("--no-fuse", action="store_true", help="vegas_fuse_projections=False")
    parser.add_argument("--top", type=int, default=12, help="kernel families listed per step kind")
    parser.add_argument("--sequence", type=int, default=0, metavar="N",
                        help="also list N consecutive kernels from the middle of each step kind, in launch order")
    parser.add_argument("--trace", metavar="DIR", help="also write each profiled step as a Chrome trace into DIR")
    parser.add_argument("--tp-model-dir", type=Path, default=Path("/tmp/hf_vegas_tp_models"),
                        help="under torchrun: where the shape is saved once for every rank to load with TP")
    parser.add_argument("--vegas-only", action="store_true",
                        help="skip the dense generations and the memory comparison: one warm-up and the profiled "
                             "Vegas generation (a TP profile of the Qwen3-8B shape then fits a 5-minute budget)")
    parser.add_argument("--tp-all-reduce", choices=hf_vegas.config.TP_ALL_REDUCES, default="nccl",
                        help="vegas_tp_all_reduce under torchrun (2 GPUs)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/profile_forward.py needs a CUDA GPU.")
    positions = args.prompt_tokens + args.new_tokens + 64
    import tensor_parallel_runs

    if tensor_parallel_runs.world_size() > 1:  # every rank runs the same generations; rank 0 prints its kernels
        if not args.qwen3_8b_shape:
            raise SystemExit("Under torchrun, profile the random-weight --qwen3-8b-shape (SmolLM2's heads do not "
                             "split over the ranks).")
        leader = tensor_parallel_runs.start() == 0
        model = tensor_parallel_runs.load_sharded("qwen3-8b-shape", positions,
                                                  args.tp_model_dir / "qwen3-8b-shape")[0]
    else:
        leader, model = True, load(args.random_weights, args.qwen3_8b_shape, positions)
    # the same prompts on every rank (seeded on the host)
    ids = torch.randint(100, 40000, (args.batch, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to("cuda")
    sampling = dict(do_sample=True, temperature=0.6, top_p=0.95, top_k=0)
    decoding_args = sampling if args.sample else dict(do_sample=False)
    common = dict(max_new_tokens=args.new_tokens, custom_generate="vegas", pad_token_id=0, eos_token_id=None,
                  vegas_cuda_graphs=not args.eager, vegas_compile=args.compile,
                  vegas_fuse_projections=not args.no_fuse, vegas_tp_all_reduce=args.tp_all_reduce, **decoding_args)
    if args.prefill_chunk is not None:  # only when asked: generate checks the value (a clear error for a bad one)
        common["prefill_chunk_size"] = args.prefill_chunk

    peaks = {}
    for name, gamma in (("vegas", 6),) if args.vegas_only else (("dense", 0), ("vegas", 6)):
        torch.manual_seed(0)  # (under TP every rank draws the same tokens)
        model.generate(ids, **common, vegas_gamma=gamma)  # warm-up: compile, capture
        if args.vegas_only:  # no second generation for the peak memory
            continue
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.manual_seed(0)
        model.generate(ids, **common, vegas_gamma=gamma)
        torch.cuda.synchronize()
        peaks[name] = (base, torch.cuda.max_memory_allocated())
        if name == "dense":
            hf_vegas.release_graphs(model)

    # Profile one step of each kind in a later Vegas generation (the third; the second with --vegas-only), and the
    # peak memory of each step kind.
    original_verify, original_draft, original_iterate = StepRunner.verify, StepRunner.draft, loop.DecodeLoop._iterate
    original_prefill = StepRunner.prefill
    profiles, step_peaks, calls = {}, defaultdict(float), defaultdict(int)

    def profiled(kind, original):  # the first call of a step kind, outside the profiled iteration
        def step(runner, *step_args, **kwargs):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            calls[kind] += 1
            # prefill: peak memory only; a dense decode: its fifth call, past the graph's capture
            wanted = kind != "prefill" and (kind != "decode" or calls[kind] == 5)
            if wanted and kind not in profiles and not profiling_iteration:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    out = original(runner, *step_args, **kwargs)
                    torch.cuda.synchronize()
                profiles[kind] = prof
            else:
                out = original(runner, *step_args, **kwargs)
            torch.cuda.synchronize()
            step_peaks[kind] = max(step_peaks[kind], torch.cuda.max_memory_allocated() / GiB)
            return out
        return step

    profiling_iteration = False

    def iterate(loop, active):  # the second iteration, whose steps are not profiled on their own
        nonlocal profiling_iteration
        if "iteration" in profiles or "verify" not in profiles:
            return original_iterate(loop, active)
        torch.cuda.synchronize()
        profiling_iteration = True
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            n = original_iterate(loop, active)
            torch.cuda.synchronize()
        profiling_iteration = False
        profiles["iteration"] = prof
        return n

    StepRunner.draft, StepRunner.verify = profiled("draft", original_draft), profiled("verify", original_verify)
    StepRunner.prefill = profiled("prefill", original_prefill)
    original_decode, StepRunner.decode = StepRunner.decode, profiled("decode", StepRunner.decode)
    loop.DecodeLoop._iterate = iterate
    try:
        torch.manual_seed(0)
        model.generate(ids, **common, vegas_gamma=6)
        steps = hf_vegas.graphs.pooled_graphs(model)  # a failed capture runs eagerly: the header must say so
        ran_eagerly = "not pooled" if steps is None else steps.disabled_reason
        hf_vegas.release_graphs(model)
        if not args.vegas_only:
            torch.manual_seed(0)
            model.generate(ids, **common, vegas_gamma=0)  # a dense step, for comparison with the verification
    finally:
        StepRunner.draft, StepRunner.verify, StepRunner.prefill = original_draft, original_verify, original_prefill
        StepRunner.decode = original_decode
        loop.DecodeLoop._iterate = original_iterate
    try:
        if leader:  # before the ranks part: a TP profile that printed nothing by its timeout (stop 39) left no clue
            report(args, profiles, step_peaks, peaks, ran_eagerly)
    finally:
        if tensor_parallel_runs.world_size() > 1:
            tensor_parallel_runs.finish()


def report(args, profiles, step_peaks, peaks, ran_eagerly) -> None:
    print(f"batch {args.batch} x {args.prompt_tokens}, {'sampling' if args.sample else 'greedy'}, "
          f"{'eager' if args.eager else 'graphs'}{' + compile' if args.compile else ''}"
          f"{'' if args.no_fuse else ', fused projections'}")
    if not args.eager and ran_eagerly:
        print(f"BUT the Vegas steps ran eagerly: {ran_eagerly}")
    for kind in ("draft", "verify", "iteration") + (() if args.vegas_only else ("decode",)):
        print(f"\n== one {kind}{' (gamma = 6 forwards and token choices)' if kind == 'draft' else ''}"
              f"{' (a dense step, gamma = 0)' if kind == 'decode' else ''}:")
        print(kernel_table(profiles[kind], args.top, args.sequence))
        if args.trace:
            Path(args.trace).mkdir(parents=True, exist_ok=True)
            profiles[kind].export_chrome_trace(str(Path(args.trace) / f"{kind}.json"))
    print("\npeak memory per step kind (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in step_peaks.items()))
    if args.vegas_only:
        print("(--vegas-only: no whole-generation peaks, no dense step)")
    for name, (base, peak) in peaks.items():
        print(f"{name:>6} generation: {base / GiB:.2f} GiB allocated before, peak {peak / GiB:.2f} GiB")


if __name__ == "__main__":
    main()
