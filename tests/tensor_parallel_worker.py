"""One rank of `tests/test_tensor_parallel.py`, launched by `torchrun --nproc_per_node 2` with the gloo backend.

    python -m torch.distributed.run --nproc_per_node 2 tests/tensor_parallel_worker.py MODEL_DIR OUT_DIR

On a machine with GPUs each rank takes one (NCCL); else the CPU (gloo). Loads the tiny model in MODEL_DIR under
transformers' tensor parallelism (`tp_plan="auto"`: each rank holds its
share of the attention heads), runs vanilla greedy `generate`, Vegas greedy and Vegas sampling on a ragged batch
(and greedy with the row-parallel sums through symmetric memory, which the CPU refuses; and greedy on the Triton
backend, whose drafts fuse the column-parallel projections of each rank's shards), and writes what the test
checks to OUT_DIR/rank<r>.json.
"""

from __future__ import annotations

import contextlib
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
from hf_vegas.backward_hooks import backward_hooks_set_aside

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
        model_kv_heads=int(model.config.num_key_value_heads), model_layers=len(model.model.layers),
        sharded=type(model.model.layers[0].self_attn.q_proj.weight).__name__, device=str(model.device),
        backend=cache.backend, graphs=hf_vegas.graphs.pooled_graphs(model) is not None,
    )
    result["symmetric"] = _symmetric_memory_run(model, ids, common)
    result["fused"] = _fused_projections_run(model, ids, common)
    result["fused_layers"] = _fused_layers_run(model, ids, common)
    result["traced"] = _compiled_trace(model, ids)
    result["fused_draft_trace"] = _fused_draft_trace(model, ids)
    if rank == 0:  # the same generation with the whole model on one device: whose selection "all" must reproduce
        whole = AutoModelForCausalLM.from_pretrained(model_dir).to(model.device)
        single = whole.generate(ids, **common, do_sample=False, return_dict_in_generate=True, **VEGAS)
        result["single_device"] = dict(greedy=single.sequences.tolist(), selection=_selection(
            getattr(single, CACHE_KEYWORD) or hf_vegas.graphs.pooled_cache(whole)))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    # Rank 0 ran one more generation: both ranks reach the teardown together (on 2 x H100 at 8e1468f the worker wrote
    # both results and then did not exit within 120 s, past the one rank's early destroy_process_group).
    hf_vegas.release_graphs()  # (and the symmetric buffers) on both ranks while the group is alive
    dist.barrier()
    dist.destroy_process_group()


def _compiled_trace(model, ids) -> dict:
    """How dynamo traces a forward of the sharded model while a compiled generation has its backward hooks set aside
    (transformers 5.17's tensor parallelism hooks the replicated norms; each hook would break the graph)."""
    from hf_vegas import fused_projections as fused_module

    def explain(tokens=8):
        torch._dynamo.reset()
        return torch._dynamo.explain(lambda x: model(x, use_cache=False).logits)(ids[:, :tokens])

    with torch.no_grad():
        hooked = explain()
        with backward_hooks_set_aside(model) as aside:
            explained = explain()
            # a draft-sized forward with the projections' kernels in (every weight counted as large: the row-parallel
            # output and down projections' kernel product, then transformers' sum, traced too)
            limit, fused_module.MAX_WEIGHT_BYTES = fused_module.MAX_WEIGHT_BYTES, 0
            try:
                with fused_module.fused_projections(model):
                    fused = explain(tokens=1)
            finally:
                fused_module.MAX_WEIGHT_BYTES = limit
    torch._dynamo.reset()
    return dict(hooks_set_aside=aside, graph_breaks=explained.graph_break_count,
                graph_breaks_with_hooks=hooked.graph_break_count, graph_breaks_fused=fused.graph_break_count,
                reasons=[str(reason.reason)[:300] for reason in (explained.break_reasons + fused.break_reasons)[:3]])


def _fused_draft_trace(model, ids) -> dict:
    """One draft step with the fused layers over this rank's shards (the row-parallel sums inside), eager and compiled
    whole (`fullgraph`, through AOTAutograd's `aot_eager` as `tests/test_compiled_steps.py` does on one device): how
    many layers fused, the compile error if dynamo could not trace it in one graph, and the largest logit difference
    between the two (the same kernels and sums: none expected)."""
    from transformers import LogitsProcessorList

    from hf_vegas.attention import active_cache, vegas_attention
    from hf_vegas.cache import VegasCache
    from hf_vegas.config import VegasConfig
    from hf_vegas.fused_layers import fused_steps
    from hf_vegas.rotary_tables import rotary_tables_once
    from hf_vegas.runner import StepRunner

    batch, prompt = ids.shape
    config = VegasConfig(gamma=3, sparsity=0.2, min_tokens=8, backend="triton")
    cache = VegasCache(model.config, batch, prompt + 8, config, device=ids.device, backend="triton")
    runner = StepRunner(model, cache, LogitsProcessorList(), do_sample=False)
    token = ids[:, -1:]
    result = dict(fused=0, error=None, difference=None)
    with (torch.no_grad(), backward_hooks_set_aside(model), vegas_attention(model), active_cache(cache),
          fused_steps(model, cache, enabled=True) as fused,
          rotary_tables_once(model, skip=lambda: fused > 0 and cache.plan.mode == "draft")):
        result["fused"] = fused
        runner.prefill(ids)
        committed = cache.plan.lengths.clone()
        cache.begin("draft")
        eager = runner._run_model(token, 1, None)
        cache.plan.rollback(committed)
        torch._dynamo.reset()
        traced = torch.compile(runner._run_model, fullgraph=True, backend="aot_eager", dynamic=False)
        cache.begin("draft")
        try:
            compiled = traced(token, 1, None)
        except Exception as error:  # (reported to the test, which prints it)
            result["error"] = f"{type(error).__name__}: {str(error)[:500]}"
        else:
            result["difference"] = (eager.float() - compiled.float()).abs().max().item()
    torch._dynamo.reset()
    return result


def _fused_projections_run(model, ids, common) -> dict:
    """Vegas greedy on the Triton backend (on the CPU in Triton's interpreter), whose draft steps run each attention's
    column-parallel q/k/v and each MLP's gate/up as one kernel over this rank's shards, and, with every weight counted
    as large, each row-parallel output and down projection's partial product through the single-projection kernel
    (transformers' own method then sums the ranks'): how many times each kernel ran (counted as the steps run eagerly
    and are captured), and whether every projection has its tensor-parallel forward back afterwards."""
    from hf_vegas import fused_projections as fused_module
    from hf_vegas.fused_projections import fused_projections

    owns = {name: vars(module).get("forward") for name, module in model.named_modules()}
    limit, fused_module.MAX_WEIGHT_BYTES = fused_module.MAX_WEIGHT_BYTES, 0  # (drafts of 3 rows: at most 16)
    try:
        with _counted_kernels("qkv_linear", "gated_linear_op", "linear_op") as calls:
            out = model.generate(ids, **common, do_sample=False, **VEGAS, vegas_backend="triton")
            restored = all(vars(module).get("forward") is owns[name] for name, module in model.named_modules())
            # The kernels' products are the ones transformers' forwards compute from the same shards, the
            # row-parallel ones summed over the ranks (a wrong slice, a dropped bias or a missing sum would only lower
            # the acceptance above, never change a token).
            layer = model.model.layers[0]
            modules = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp,
                       layer.self_attn.o_proj, layer.mlp.down_proj)
            generator = torch.Generator().manual_seed(2)
            inputs = [torch.randn(3, 1, width, generator=generator).to(model.device, model.dtype)
                      for width in [model.config.hidden_size] * 4 + [layer.self_attn.o_proj.weight.to_local().shape[1],
                                                                     layer.mlp.down_proj.weight.to_local().shape[1]]]
            with torch.no_grad():
                expected = [module(x) for module, x in zip(modules, inputs)]
                with fused_projections(model) as large_counts:
                    fused = [module(x) for module, x in zip(modules, inputs)]
    finally:
        fused_module.MAX_WEIGHT_BYTES = limit
    errors = [(a.float() - b.float()).abs().max().item() for a, b in zip(fused, expected)]
    return dict(greedy=out.tolist(), calls=calls, restored=restored, projection_error=max(errors[:4]),
                row_parallel_error=max(errors[4:]), large_counts=large_counts,
                tensor_parallel_forwards=sum(own is not None for own in owns.values()))


def _fused_layers_run(model, ids, common) -> dict:
    """Vegas greedy and sampling on the Triton backend (on the CPU in Triton's interpreter, without graphs), whose
    draft steps run each standard layer as the fused kernels over this rank's shards (Llama's and Qwen3's layers;
    Gemma-3's keep their forward), and the same generations with `vegas_fuse_projections=False`, whose drafts run the
    model's own layers: the tokens and the accepted counts of each pair (in fp32 the drafts differ by rounding only; a
    residual summed twice or not at all would draft other tokens), how many times each fused kernel ran on this
    rank, how many layers fuse, and whether every module has the forward it had (transformers' TP ones included)
    afterwards."""
    from hf_vegas.fused_layer_parts import layer_parts

    owns = {name: vars(module).get("forward") for name, module in model.named_modules()}
    names = ("rms_norm", "qkv_rope_write", "sparse_draft_attention", "linear_residual_op", "linear_op")
    calls = dict.fromkeys(names, 0)
    fusable = sum(layer_parts(layer) is not None for layer in model.model.layers)
    if not fusable:  # (Gemma-3's layers: no fused draft to compare, the generations would repeat the ones above)
        return dict(calls=calls, fusable=0)
    runs = {}
    for fuse in (True, False):
        options = dict(**common, **VEGAS, vegas_backend="triton", vegas_cuda_graphs=False, vegas_fuse_projections=fuse,
                       return_dict_in_generate=True)
        with _counted_kernels(*names) as counted:
            greedy = model.generate(ids, **options, do_sample=False)
            torch.manual_seed(7)
            sampled = model.generate(ids, **options, do_sample=True, temperature=0.8)
        if fuse:
            calls = counted
        runs["fused" if fuse else "plain"] = dict(
            greedy=greedy.sequences.tolist(), accepted=greedy.accepted.tolist(), sampled=sampled.sequences.tolist(),
            sampled_accepted=sampled.accepted.tolist())
    restored = all(vars(module).get("forward") is owns[name] for name, module in model.named_modules())
    return dict(**runs, calls=calls, restored=restored, fusable=fusable)


@contextlib.contextmanager
def _counted_kernels(*names):
    """Inside the block, each of the named `hf_vegas_kernels` ops counts its calls (counted as the steps run eagerly
    and are captured; a graph replay runs no Python) into the dict it yields; the ops are put back when it exits."""
    import hf_vegas_kernels

    calls = dict.fromkeys(names, 0)
    originals = {name: getattr(hf_vegas_kernels, name) for name in names}

    def counted(name):
        def kernel(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return kernel

    try:
        for name in names:
            setattr(hf_vegas_kernels, name, counted(name))
        yield calls
    finally:
        for name, kernel in originals.items():
            setattr(hf_vegas_kernels, name, kernel)


def _symmetric_memory_run(model, ids, common) -> dict:
    """Vegas greedy with `vegas_tp_all_reduce="symmetric_memory"` and how many all-reduces took that path, and how
    many sums of fused draft layers went through the two-rank sum + norm op (counted as the steps run eagerly and are
    captured; a replay runs no Python), with the acceptances of the fused layers (Triton backend, no graphs) with
    and without it; or the error (on the CPU it is refused before any forward)."""
    calls = []
    original = symmetric_all_reduce.symmetric_all_reduce_
    symmetric_all_reduce.symmetric_all_reduce_ = lambda *args: calls.append(1) or original(*args)
    try:
        out = model.generate(ids, **common, do_sample=False, **VEGAS, vegas_tp_all_reduce="symmetric_memory")
        result = dict(greedy=out.tolist(), symmetric_calls=len(calls))
        options = dict(**common, **VEGAS, do_sample=False, vegas_backend="triton", vegas_cuda_graphs=False,
                       return_dict_in_generate=True)
        with _counted_kernels("exchange_sum_norm") as counted:
            fused = model.generate(ids, **options, vegas_tp_all_reduce="symmetric_memory")
        nccl = model.generate(ids, **options)
        return dict(result, fused_sums=counted["exchange_sum_norm"], fused_greedy=fused.sequences.tolist(),
                    fused_accepted=fused.accepted.tolist(), nccl_accepted=nccl.accepted.tolist())
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
