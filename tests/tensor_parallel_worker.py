"""One rank of `tests/test_tensor_parallel.py`, launched by `torchrun --nproc_per_node 2` with the gloo backend.

    python -m torch.distributed.run --nproc_per_node 2 tests/tensor_parallel_worker.py MODEL_DIR OUT_DIR

On a machine with GPUs each rank takes one (NCCL); else the CPU (gloo). Loads the tiny model in MODEL_DIR under
transformers' tensor parallelism (`tp_plan="auto"`: each rank holds its
share of the attention heads), runs vanilla greedy `generate`, Vegas greedy and Vegas sampling on a ragged batch
(and greedy with the row-parallel sums through symmetric memory, which the CPU refuses), and writes what the test
checks to OUT_DIR/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig

import hf_vegas  # registers the short name "vegas"
from hf_vegas import symmetric_all_reduce
from hf_vegas._compat.internals import CACHE_KEYWORD

VEGAS = dict(custom_generate="vegas", vegas_gamma=3, vegas_sparsity=0.2, vegas_min_tokens=8)


def main(model_dir: str, out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    cuda = torch.cuda.is_available()
    if cuda:  # one GPU per rank, NCCL: the Triton kernels and CUDA graphs, with the all-reduces inside the graphs
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    model = AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=DistributedConfig(tp_plan="auto"))
    ids = torch.randint(3, 128, (3, 60), generator=torch.Generator().manual_seed(1)).to(model.device)
    mask = torch.ones_like(ids)
    mask[1, :17] = 0  # left padding: rows of 60, 43 and 55 tokens
    mask[2, :5] = 0
    common = dict(attention_mask=mask, max_new_tokens=16, pad_token_id=0)
    vanilla = model.generate(ids, **common, do_sample=False)
    greedy = model.generate(ids, **common, do_sample=False, return_dict_in_generate=True, **VEGAS)
    # With CUDA graphs the cache stays pooled for the next call (outputs do not hold it).
    cache = getattr(greedy, CACHE_KEYWORD) or hf_vegas.graphs.pooled_cache(model)
    local_selection = _selection(cache)
    # The paper's all-head average: scores all-reduced over the ranks, the same slots on every rank.
    pooled = model.generate(ids, **common, do_sample=False, return_dict_in_generate=True, **VEGAS,
                            vegas_selection_heads="all")
    pooled_cache = getattr(pooled, CACHE_KEYWORD) or hf_vegas.graphs.pooled_cache(model)
    torch.manual_seed(5)  # every rank draws from the same generator state
    sampled = model.generate(ids, **common, do_sample=True, temperature=0.8, **VEGAS)
    result = dict(
        world=dist.get_world_size(), vanilla=vanilla.tolist(), greedy=greedy.sequences.tolist(),
        accepted=greedy.accepted.tolist(), sampled=sampled.tolist(), local_selection=local_selection,
        all_heads=dict(greedy=pooled.sequences.tolist(), accepted=pooled.accepted.tolist(),
                       selection=_selection(pooled_cache)),
        cache_kv_heads=int(cache.layers[0].keys.shape[2]),
        model_kv_heads=int(model.config.num_key_value_heads),
        sharded=type(model.model.layers[0].self_attn.q_proj.weight).__name__, device=str(model.device),
        backend=cache.backend, graphs=hf_vegas.graphs.pooled_graphs(model) is not None,
    )
    result["symmetric"] = _symmetric_memory_run(model, ids, common)
    if rank == 0:  # the same generation with the whole model on one device: whose selection "all" must reproduce
        whole = AutoModelForCausalLM.from_pretrained(model_dir).to(model.device)
        single = whole.generate(ids, **common, do_sample=False, return_dict_in_generate=True, **VEGAS)
        result["single_device"] = dict(greedy=single.sequences.tolist(), selection=_selection(
            getattr(single, CACHE_KEYWORD) or hf_vegas.graphs.pooled_cache(whole)))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    # Rank 0 ran one more generation: both ranks reach the teardown together (on 2 x H100 at 8e1468f the worker wrote
    # both results and then did not exit within 120 s, past the one rank's early destroy_process_group).
    dist.barrier()
    dist.destroy_process_group()


def _symmetric_memory_run(model, ids, common) -> dict:
    """Vegas greedy with `vegas_tp_all_reduce="symmetric_memory"` and how many all-reduces took that path (counted
    as the steps run eagerly and are captured; a replay runs no Python), or the error (on the CPU it is refused
    before any forward)."""
    calls = []
    original = symmetric_all_reduce.symmetric_all_reduce_
    symmetric_all_reduce.symmetric_all_reduce_ = lambda *args: calls.append(1) or original(*args)
    try:
        out = model.generate(ids, **common, do_sample=False, **VEGAS, vegas_tp_all_reduce="symmetric_memory")
        return dict(greedy=out.tolist(), symmetric_calls=len(calls))
    except ValueError as error:
        return dict(error=str(error), symmetric_calls=len(calls))
    finally:
        symmetric_all_reduce.symmetric_all_reduce_ = original


def _selection(cache) -> list:
    """The slots each sparse layer's next draft reads, per row (what the last verification chose)."""
    sel = cache.selection
    return [[sel.sel_idx[layer, row, : int(sel.sel_count[layer, row])].tolist() for row in range(sel.sel_idx.shape[1])]
            for layer in sel.sparse_layers]


if __name__ == "__main__":
    main(*sys.argv[1:3])
