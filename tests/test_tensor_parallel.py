"""Vegas under transformers' tensor parallelism (`from_pretrained(..., tp_plan="auto")`), on the CPU: two processes
with the gloo backend (`tests/tensor_parallel_worker.py`, launched with torchrun).

Each rank holds its share of the attention heads, and the `VegasCache` it builds holds only those KV heads (it
sizes itself from the keys the model hands it). Each rank selects its heads' slots from its own query heads, with no
communication: the selection only decides which drafts are accepted, and every rank takes the same acceptance
decisions because the logits after the row-parallel output projection are all-reduced, hence identical. So greedy
output equals vanilla greedy under the same parallelism, and sampling draws the same tokens on every rank (each
rank's generator starts from the same seed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import BUILDERS, COMMON
from transformers import Qwen3Config, Qwen3ForCausalLM

WORKER = Path(__file__).with_name("tensor_parallel_worker.py")
# The tiny models the ranks shard: each needs a KV head count the two ranks divide (the shared tiny Qwen3 has one).
SHARDED = {
    "llama": BUILDERS["llama"], "gemma3": BUILDERS["gemma3"],
    "qwen3": lambda: Qwen3ForCausalLM(
        Qwen3Config(**COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
}


@pytest.fixture(scope="module")
def gloo():
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this torch build has no torch.distributed gloo backend")


@pytest.mark.parametrize("arch", list(SHARDED))
def test_tensor_parallel_ranks_give_vanilla_greedy_and_agree_when_sampling(arch, tmp_path, gloo):
    torch.manual_seed(0)
    SHARDED[arch]().save_pretrained(tmp_path / "model")
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
         str(tmp_path / "model"), str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert rank["world"] == 2 and rank["sharded"] == "DTensor", "the model must really be tensor parallel"
        assert rank["cache_kv_heads"] * 2 == rank["model_kv_heads"], "each rank caches only its own KV heads"
        assert rank["greedy"] == rank["vanilla"], "Vegas greedy = vanilla greedy under the same parallelism"
    assert ranks[0]["accepted"] == ranks[1]["accepted"], "every rank takes the same acceptance decisions"
    assert ranks[0]["greedy"] == ranks[1]["greedy"]
    assert ranks[0]["sampled"] == ranks[1]["sampled"], "the speculative-sampling draws agree across ranks"
    accepted = [a for row in ranks[0]["accepted"] for a in row if a >= 0]
    assert any(a < 3 for a in accepted), "some drafts rejected: the drafts ran sparse, not the full attention"
    # `vegas_selection_heads="all"`: each rank's head-mean scores averaged over both, so both draft from the same slots
    # (with "local" each rates from its own heads, and the ranks' selections differ); greedy stays vanilla's.
    assert ranks[0]["local_selection"] != ranks[1]["local_selection"], "local selections must differ to tell"
    everyone = [rank["all_heads"] for rank in ranks]
    assert everyone[0]["selection"] == everyone[1]["selection"]
    assert everyone[0]["accepted"] == everyone[1]["accepted"]
    for rank, pooled in zip(ranks, everyone):
        assert pooled["greedy"] == rank["vanilla"]
    # ... and that is the selection of the whole model on one device (the mean over every head).
    assert everyone[0]["selection"] == ranks[0]["single_device"]["selection"]
    # `vegas_tp_all_reduce="symmetric_memory"`: on two GPUs the decode, draft and verification steps' sums go through
    # symmetric memory and greedy stays vanilla's; on the CPU (gloo) it is refused before any forward.
    for rank in ranks:
        symmetric = rank["symmetric"]
        if rank["device"].startswith("cuda"):
            assert symmetric.get("greedy") == rank["vanilla"], symmetric.get("error")
            assert symmetric["symmetric_calls"] > 0, "no all-reduce went through symmetric memory"
            # Fused draft layers sum over the ranks and normalise in one launch (`exchange_sum_norm`), two per layer
            # and draft step; in fp32 they draft what the fused layers draft through NCCL (rounding only).
            assert symmetric["fused_greedy"] == rank["vanilla"]
            if arch in ("llama", "qwen3"):
                layers = rank["model_layers"]
                assert symmetric["fused_sums"] > 0 and symmetric["fused_sums"] % (2 * layers) == 0, symmetric
                assert symmetric["fused_accepted"] == symmetric["nccl_accepted"]
            else:
                assert symmetric["fused_sums"] == 0, symmetric
        else:
            assert "needs CUDA devices" in symmetric["error"] and symmetric["symmetric_calls"] == 0
    # Draft steps on the Triton backend run each rank's column-parallel q/k/v and gate/up as one kernel over its
    # shards; greedy stays vanilla's, and the projections get transformers' tensor-parallel forwards back.
    for rank in ranks:
        fused = rank["fused"]
        assert fused["greedy"] == rank["vanilla"]
        assert fused["calls"]["qkv_linear"] > 0 and fused["calls"]["gated_linear_op"] > 0, fused["calls"]
        # with every weight counted as large, the row-parallel output and down projections too (then summed)
        assert fused["calls"]["linear_op"] > 0, fused["calls"]
        assert fused["restored"] and fused["tensor_parallel_forwards"] > 0
        assert fused["projection_error"] < 1e-4, fused["projection_error"]
        assert fused["row_parallel_error"] < 1e-4, fused["row_parallel_error"]
        large = fused["large_counts"]
        assert large["attention"] > 0 and large["output"] == large["attention"] + large["mlp"], large
    # Draft steps run Llama's and Qwen3's layers as the fused kernels over each rank's shards (Gemma-3's keep their
    # forward): each row-parallel partial product goes to transformers' sum, the first rank's with the residual, so the
    # sum holds it once. In fp32 the drafts differ from the model's own layers' by rounding only: the same tokens and
    # acceptances.
    for rank in ranks:
        layers = rank["fused_layers"]
        if not layers["fusable"]:
            continue
        assert layers["fused"]["greedy"] == layers["plain"]["greedy"] == rank["vanilla"]
        assert layers["fused"]["accepted"] == layers["plain"]["accepted"]
        assert layers["fused"]["sampled"] == layers["plain"]["sampled"]
        assert layers["fused"]["sampled_accepted"] == layers["plain"]["sampled_accepted"]
        assert layers["restored"]
    calls = [rank["fused_layers"]["calls"] for rank in ranks]
    if arch in ("llama", "qwen3"):  # (Qwen3's replicated q/k norms: a TP forward in 5.24, a backward hook in 5.17)
        count = ranks[0]["model_layers"]
        assert all(rank["fused_layers"]["fusable"] == count for rank in ranks), "every layer fuses on every rank"
        assert all(c["qkv_rope_write"] > 0 and c["qkv_rope_write"] % count == 0 for c in calls), calls
        assert all(c["sparse_draft_attention"] >= c["qkv_rope_write"] for c in calls), calls
        assert all(c["rms_norm"] == 2 * c["qkv_rope_write"] for c in calls), "both norms are launches under TP"
        assert calls[0]["linear_residual_op"] == 2 * calls[0]["qkv_rope_write"] and calls[0]["linear_op"] == 0, calls
        assert calls[1]["linear_op"] == 2 * calls[1]["qkv_rope_write"] and calls[1]["linear_residual_op"] == 0, calls
    else:
        assert all(c["qkv_rope_write"] == 0 and rank["fused_layers"]["fusable"] == 0 for c, rank in zip(calls, ranks))
    # ... and a compiled draft step traces them whole, the row-parallel sums inside, and computes what the eager one
    # does
    for rank in ranks:
        trace = rank["fused_draft_trace"]
        assert trace["error"] is None, trace["error"]
        assert trace["fused"] == rank["fused_layers"]["fusable"]
        assert trace["difference"] < 1e-5, trace["difference"]
    # A compiled step traces the sharded forward whole: with the backward hooks that transformers 5.17 puts on the
    # replicated norms (Gemma-3's q/k norms) set aside, as a compiled generation does, dynamo breaks no graph; nor in a
    # draft-sized forward whose projections run the kernels (the row-parallel ones then transformers' sum).
    for rank in ranks:
        traced = rank["traced"]
        assert traced["graph_breaks"] == 0 and traced["graph_breaks_fused"] == 0, traced["reasons"]
        if traced["hooks_set_aside"]:  # (transformers 5.17) and with them, it would
            assert traced["graph_breaks_with_hooks"] >= traced["hooks_set_aside"], traced
    print(arch, "backward hooks set aside per rank:", [rank["traced"]["hooks_set_aside"] for rank in ranks])


def test_on_one_device_all_heads_are_the_local_heads():
    """Without tensor parallelism there is no group to average over: `selection_heads="all"` selects as "local"."""
    from hf_vegas.tensor_parallel import score_group
    from tiny_models import ragged_batch, tiny_model

    model = tiny_model("llama")
    assert score_group(model) is None
    ids, mask = ragged_batch([30, 21])
    common = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, custom_generate="vegas",
                  vegas_gamma=3, vegas_sparsity=0.2, vegas_min_tokens=8, return_dict_in_generate=True)
    local, everyone = (model.generate(ids, **common, vegas_selection_heads=heads) for heads in ("local", "all"))
    assert torch.equal(local.sequences, everyone.sequences) and torch.equal(local.accepted, everyone.accepted)
