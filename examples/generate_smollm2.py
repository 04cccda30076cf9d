"""Vegas generation on a real model with no Hub access: SmolLM2-135M-Instruct shipped as a PyPI package.

    python examples/generate_smollm2.py                      # ~3K-token prompt, greedy, checked against vanilla
    python examples/generate_smollm2.py --sample --max-new-tokens 200
"""

from __future__ import annotations

import argparse
import time

import torch

import hf_vegas  # noqa: F401  (registers custom_generate="vegas")
from hf_vegas.real_models import load_smollm2, long_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=3072)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--gamma", type=int, default=6)
    parser.add_argument("--sample", action="store_true", help="temperature 0.6 / top-p 0.95 instead of greedy")
    parser.add_argument("--no-check", action="store_true", help="skip the comparison with vanilla greedy")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_smollm2(torch.bfloat16 if device == "cuda" else torch.float32, device)
    ids = long_prompt(tokenizer, args.prompt_tokens).to(device)
    sampling = dict(do_sample=True, temperature=0.6, top_p=0.95) if args.sample else dict(do_sample=False)
    print(f"prompt: {ids.shape[1]} tokens of Python documentation + a question; device {device}")

    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=args.max_new_tokens, custom_generate="vegas", vegas_gamma=args.gamma,
                         return_dict_in_generate=True, **sampling)
    seconds = time.perf_counter() - start
    new = out.sequences[0, ids.shape[1]:]
    print("\n" + tokenizer.decode(new, skip_special_tokens=True) + "\n")
    print(f"Vegas: {new.numel()} tokens in {seconds:.1f} s, {out.accepted.shape[1]} draft/verify iterations, "
          f"{out.tokens_per_iteration:.2f} tokens per iteration (at most {args.gamma + 1})")
    if not args.sample and not args.no_check:
        vanilla = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        same = torch.equal(vanilla, out.sequences)
        print(f"identical to vanilla greedy generate: {same}")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
