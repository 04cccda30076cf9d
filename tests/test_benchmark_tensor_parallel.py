"""The throughput benchmark's tensor-parallel pieces that run without GPUs (the GPU run is
`torchrun --nproc_per_node 2 benchmarks/throughput.py ...`, see `benchmarks/tensor_parallel_runs.py`)."""

from __future__ import annotations

import argparse
import pathlib
import sys

import pytest
import torch
from tiny_models import tiny_model

from hf_vegas import VegasConfig, traffic

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
from throughput import vegas_config  # noqa: E402


def test_vegas_all_is_the_vegas_policy_with_scores_averaged_over_every_head():
    args = argparse.Namespace(gamma=6, sparsity=0.07, min_tokens=256, budget_boost=1.0, score="weights",
                              compile=False, tp_all_reduce="nccl")
    everyone, local = vegas_config("vegas-all", args), vegas_config("vegas", args)
    assert (everyone.policy, everyone.selection_heads) == ("vegas", "all")
    assert (local.policy, local.selection_heads) == ("vegas", "local")


def test_tp_all_reduce_reaches_our_methods_dense_included():
    args = argparse.Namespace(gamma=6, sparsity=0.07, min_tokens=256, budget_boost=1.0, score="weights",
                              compile=False, tp_all_reduce="symmetric_memory")
    assert {vegas_config(m, args).tp_all_reduce for m in ("dense", "vegas", "vegas-all")} == {"symmetric_memory"}


@pytest.fixture
def one_rank_group(tmp_path):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this torch build has no torch.distributed gloo backend")
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_weight_bytes_of_tensor_parallel_shards_count_the_whole_weights(one_rank_group):
    """Under `tp_plan="auto"` the parameters are `DTensor` shards, which have no data pointer of their own: the
    traffic model counts their global bytes (here each weight is a half shard of a weight twice as tall, as on
    two ranks) and tells tied from untied embeddings by their local shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    model = tiny_model("llama")
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied
    mesh = init_device_mesh("cpu", (1,))
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            local = module.weight.detach()
            module.weight = torch.nn.Parameter(DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=torch.Size([2 * local.shape[0], local.shape[1]]),
                stride=local.stride()))
    assert type(model.lm_head.weight).__name__ == "DTensor"
    embedding = model.model.embed_tokens.weight
    every = sum(p.numel() * p.element_size() for p in model.parameters())  # DTensors: global sizes
    linear_and_embedding = sum(m.weight.to_local().numel() * 2 * m.weight.element_size() for m in model.modules()
                               if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)))
    others = sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))
    assert every == linear_and_embedding + others, "the shards count as the whole (two-rank) weights"
    assert traffic.weight_bytes(model) == every - embedding.numel() * embedding.element_size(), (
        "untied: a step reads one embedding row")
    model.lm_head.weight = embedding  # tied: the embedding is the LM head, read whole
    assert traffic.weight_bytes(model) == sum(p.numel() * p.element_size() for p in model.parameters())


def test_an_auto_gamma_run_is_timed_and_bounded_at_the_gamma_it_ran_most():
    """`gamma="auto"`: the NCCL timing under TP and the bounds take the gamma the run chose most (an integer the
    collectives can be counted for), or its dense path; a fixed gamma stays as it is."""
    from throughput_records import as_run

    auto = VegasConfig(gamma="auto")
    assert as_run(auto, {"gammas_run": {"0": 3, "4": 9, "6": 2}}).gamma == 4
    assert as_run(auto, {"gammas_run": {"0": 9, "4": 3}}) == 0
    fixed = VegasConfig(gamma=6)
    assert as_run(fixed, {"gammas_run": {"6": 31}}) is fixed
