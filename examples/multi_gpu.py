"""Vegas on several GPUs, the two ways transformers spreads a model (README, "Multi-GPU").

    torchrun --nproc_per_node 2 examples/multi_gpu.py --tensor-parallel MODEL   # attention heads split over GPUs
    python examples/multi_gpu.py --device-map MODEL                              # layers split over GPUs

MODEL is a model folder or Hub name; for tensor parallelism its query and KV heads must divide by the number of
ranks. Each run generates greedily with Vegas and with vanilla `generate` under the same placement, checks that
the tokens are identical, and prints both times. Without GPUs both run on the CPU (gloo ranks; the whole model on
the CPU), as the tests run them.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig

import hf_vegas  # noqa: F401  (registers custom_generate="vegas")


def load(args):
    """The model under the asked placement, and whether this process prints (rank 0, or the only process)."""
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.tensor_parallel:
        if "RANK" not in os.environ:
            raise SystemExit("--tensor-parallel runs one process per GPU: launch it with "
                             "`torchrun --nproc_per_node N examples/multi_gpu.py --tensor-parallel MODEL`.")
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo")
        model = AutoModelForCausalLM.from_pretrained(
            args.model, distributed_config=DistributedConfig(tp_plan="auto"), dtype=dtype)
        return model.eval(), dist.get_rank() == 0
    model = AutoModelForCausalLM.from_pretrained(args.model, device_map="auto" if cuda else "cpu", dtype=dtype)
    return model.eval(), True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--tensor-parallel", action="store_true", help="tp_plan='auto', one process per GPU")
    how.add_argument("--device-map", action="store_true", help="device_map='auto' in one process")
    parser.add_argument("model", help="a model folder or Hub name")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="random token ids per row (seeded)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=6)
    args = parser.parse_args()

    model, leader = load(args)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(3, vocab, (args.batch, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)
    common = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False,
                  pad_token_id=0, eos_token_id=None)
    if leader:
        placed = sorted({str(p.device) for p in model.parameters()})
        print(f"{'tensor parallel' if args.tensor_parallel else 'device_map'}: weights on {', '.join(placed)}"
              + (f" (rank 0 of {dist.get_world_size()})" if args.tensor_parallel else ""))
    timed = {}
    for name, extra in (("vanilla", {}), ("vegas", dict(custom_generate="vegas", vegas_gamma=args.gamma))):
        model.generate(ids, **{**common, "max_new_tokens": 2}, **extra)  # warm-up: kernels, graphs
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, **common, **extra)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        timed[name] = (out, time.perf_counter() - start)
    same = torch.equal(timed["vanilla"][0], timed["vegas"][0])
    if leader:
        for name, (out, seconds) in timed.items():
            print(f"{name:>8}: {args.batch} x {out.shape[1] - ids.shape[1]} new tokens in {seconds:.2f} s")
        print(f"Vegas greedy identical to vanilla greedy: {same}")
    if args.tensor_parallel:
        dist.barrier()
        dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
