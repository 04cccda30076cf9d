"""The throughput benchmark under transformers' tensor parallelism (`tp_plan="auto"`), one process per GPU:

    torchrun --nproc_per_node 2 benchmarks/throughput.py --workloads qwen3-8b-shape:16x32768 --methods hf dense \\
        vegas vegas-all --compile --decodings greedy --prefill-chunk 8192 --project-from FILE

Every rank runs the same generations; rank 0 writes the records and prints the table. A random-weight shape is built
once (rank 0, seeded), saved to `--tp-model-dir` and loaded by every rank with `from_pretrained(..., tp_plan="auto")`,
as a user loads a checkpoint. Records add the world size, each rank's peak memory and the NCCL time of an iteration:
the all-reduces and all-gathers its forwards make, at the same sizes, captured in a CUDA graph as the steps are and
timed alone on this group (inside a step they cannot be timed apart from its kernels without a profiler).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def start() -> int:
    """One GPU per rank (`LOCAL_RANK`), NCCL. Returns this rank."""
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    return dist.get_rank()


def finish() -> None:
    """Every rank at the end: free what hf_vegas keeps (the pooled caches and graphs, the symmetric buffers) while the
    group is alive, then leave it together. (On 2 x H200 at 6bdac13 two runs with symmetric buffers alive had not
    exited by their timeouts after their work was done; an NCCL-only run exited.)"""
    import hf_vegas

    hf_vegas.release_graphs()
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


def load_sharded(name: str, max_positions: int, model_dir: Path):
    """`(model, None)`: the random-weight shape `name` sharded over the ranks. Rank 0 saves it first if `model_dir`
    holds no checkpoint (the same seeded weights as the one-GPU runs)."""
    import workloads
    from transformers import AutoModelForCausalLM, DistributedConfig

    if workloads.parse_workload(f"{name}:1x1").real_weights:
        raise SystemExit(f"--tp runs the random-weight shapes only; {name}'s heads do not split over the ranks.")
    if dist.get_rank() == 0 and not model_dir.exists():
        model, _ = workloads.load_model(name, max_positions)
        partial = model_dir.with_name(model_dir.name + ".partial")  # renamed once whole: a broken save is not reused
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial, max_shard_size="20GB")
        partial.rename(model_dir)
        del model
        torch.cuda.empty_cache()
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=DistributedConfig(tp_plan="auto"),
                                                 dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model, None


def any_rank_failed(failed: bool) -> bool:
    """Whether this or any other rank's measurement failed: then no rank times its collectives (a rank that skipped
    them would leave the others waiting)."""
    flag = torch.tensor([int(failed)], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def per_rank_peaks(record: dict) -> dict:
    """Every rank's peak and after-call memory (this rank's are in `record`)."""
    mine = (record.get("peak_memory_GiB"), record.get("memory_after_GiB"))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return dict(per_rank_peak_memory_GiB=[p for p, _ in everyone], per_rank_memory_after_GiB=[a for _, a in everyone])


def capture(run, warmups: int) -> torch.cuda.CUDAGraph:
    """`run()` captured in a CUDA graph after `warmups` eager runs (NCCL's communicators and buffers, or a compiled
    function's compilation, exist before the capture, as they do before a step's)."""
    for _ in range(warmups):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Milliseconds per replay of `graph` on the GPU's clock (back to back, without the host's launch costs), after
    one replay and a barrier: every rank replays in step, as the steps do (a one-shot all-reduce waits for its
    peers)."""
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def _graphed_ms(collectives, replays: int = 20) -> float:
    """Mean time of `collectives` captured in one CUDA graph, as the captured steps run them."""
    return replay_ms(capture(collectives, warmups=3), replays)


def forward_nccl_ms(model, batch: int, tokens: int, logits_kept: int, all_reduce=dist.all_reduce, fused_sums: int = 0,
                    fused_sum=None) -> float:
    """The collectives of one forward of `tokens` tokens per row under the model's TP plan: an all-reduce of the
    hidden states after every row-parallel projection (attention output and MLP down, per layer, and the embedding;
    by `all_reduce`, or for `fused_sums` of them by `fused_sum(hidden, parity)`, the sums of fused draft layers, the
    norm after each included) and the all-gather of the kept logits from the column-parallel LM head."""
    text = model.config.get_text_config(decoder=True)
    world = dist.get_world_size()
    hidden = torch.zeros(batch, tokens, text.hidden_size, dtype=model.dtype, device="cuda")
    local = torch.zeros(batch * logits_kept, text.vocab_size // world, dtype=model.dtype, device="cuda")
    gathered = torch.empty(world * local.shape[0], local.shape[1], dtype=model.dtype, device="cuda")

    def collectives():
        for i in range(fused_sums):
            fused_sum(hidden.view(-1, text.hidden_size), i % 2)
        for _ in range(2 * text.num_hidden_layers + 1 - fused_sums):
            all_reduce(hidden)
        dist.all_gather_into_tensor(gathered, local)

    return _graphed_ms(collectives)


def nccl_per_iteration(model, batch: int, config, capacity: int) -> dict:
    """Collective time of a dense step (gamma = 0) or a Vegas iteration (gamma one-token drafts and a verification of
    gamma + 1 tokens), and, with `selection_heads="all"`, the verification's all-reduce of the fp32 scores of every
    sparse layer over the cache's slots. With `tp_all_reduce="symmetric_memory"` the hidden states' all-reduces are
    the symmetric ones the generation ran (`tp_all_reduce` in the record says which), and in the drafts the sums of
    the layers that fuse (`fused_layer_parts`, under `fuse_projections`) are the fused sum + norm
    (`hf_vegas_kernels.exchange_sum_norm`, `fused_draft_sums` in the record)."""
    all_reduce, fused_sum, fused_sums = dist.all_reduce, None, 0
    if config.tp_all_reduce == "symmetric_memory":
        import hf_vegas_kernels

        from hf_vegas import symmetric_all_reduce, tensor_parallel
        from hf_vegas.fused_layer_parts import layer_parts

        group = tensor_parallel.tp_group(model, "timing the symmetric all-reduces")
        rows = batch * (config.max_gamma + 1)  # the generation's buffer and exchange
        numel = symmetric_all_reduce.buffer_numel(model, rows)
        device = torch.device("cuda", torch.cuda.current_device())
        buffer = symmetric_all_reduce.buffer_for(group, numel, device, model.dtype)
        text = model.config.get_text_config(decoder=True)
        # the generation's exchange, for its draft rows (None where it made none)
        exchange = symmetric_all_reduce.exchange_for(group, batch, text.hidden_size, device, model.dtype)
        if config.fuse_projections and exchange is not None:
            fused_sums = 2 * sum(parts is not None and batch <= parts.max_rows
                                 for parts in map(layer_parts, model.get_decoder().layers))

        def all_reduce(tensor):
            symmetric_all_reduce.symmetric_all_reduce_(tensor, buffer, group.group_name)

        norm = torch.ones(text.hidden_size, dtype=model.dtype, device=device)

        def fused_sum(rows_2d, parity):
            hf_vegas_kernels.exchange_sum_norm(rows_2d, norm, 1e-6, exchange.name, parity)
    out = dict(tp_all_reduce=config.tp_all_reduce)
    if config.gamma == 0:
        return dict(out, nccl_ms_per_iteration=forward_nccl_ms(model, batch, 1, 1, all_reduce))
    gamma = config.gamma
    ms = (gamma * forward_nccl_ms(model, batch, 1, 1, all_reduce, fused_sums, fused_sum)
          + forward_nccl_ms(model, batch, gamma + 1, gamma + 1, all_reduce))
    out["fused_draft_sums"] = fused_sums
    if config.selection_heads == "all":
        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        scores = torch.zeros(layers, batch, capacity, dtype=torch.float32, device="cuda")
        out["selection_all_reduce_ms"] = _graphed_ms(lambda: dist.all_reduce(scores))
        ms += out["selection_all_reduce_ms"]
    return dict(out, nccl_ms_per_iteration=ms)
