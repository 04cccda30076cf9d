"""How many GPU kernels one eager draft forward of SmolLM2 launches, and where their time goes (torch.profiler).

    python benchmarks/profile_forward.py --batch 64 --prompt-tokens 7500

Runs a short Vegas generation on random token ids (eager steps, `vegas_cuda_graphs=False`), profiles the first draft
forward of a second one, and prints the kernel count, their summed GPU time and the 25 costliest kernel names. This
is what bounds a draft step when its memory traffic is small: every kernel costs a few microseconds, graph or not.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import hf_vegas  # noqa: F401  (registers custom_generate="vegas")
from hf_vegas.candidate import VegasCandidateGenerator
from hf_vegas.real_models import load_smollm2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=7500)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/profile_forward.py needs a CUDA GPU.")
    model, _ = load_smollm2(torch.bfloat16, "cuda")
    ids = torch.randint(100, 40000, (args.batch, args.prompt_tokens), device="cuda")
    common = dict(max_new_tokens=16, do_sample=False, custom_generate="vegas", pad_token_id=0, vegas_cuda_graphs=False)
    model.generate(ids, **common)  # warm-up: Triton compiles

    original = VegasCandidateGenerator.forward
    profiles = []

    def profiled(drafter, input_ids, logits_to_keep, mode=None, left_pad=None):
        if mode != "draft" or profiles:
            return original(drafter, input_ids, logits_to_keep, mode, left_pad)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = original(drafter, input_ids, logits_to_keep, mode, left_pad)
            torch.cuda.synchronize()
        profiles.append(prof)
        return out

    VegasCandidateGenerator.forward = profiled
    try:
        model.generate(ids, **common)
    finally:
        VegasCandidateGenerator.forward = original
    kernels = [e for e in profiles[0].events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"one draft forward, batch {args.batch} x {args.prompt_tokens}: {len(kernels)} kernels, "
          f"{sum(e.device_time for e in kernels) / 1e3:.3f} ms of kernel time")
    families = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        families[e.name[:60]][0] += 1
        families[e.name[:60]][1] += e.device_time
    for name, (count, micros) in sorted(families.items(), key=lambda item: -item[1][1])[:25]:
        print(f"{count:5d} {micros / 1e3:8.3f} ms  {name}")


if __name__ == "__main__":
    main()
