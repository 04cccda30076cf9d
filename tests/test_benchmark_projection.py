"""The throughput benchmark's projection of random-weight shapes (`benchmarks/projection.py`): the real model's tokens
per iteration, and its drafts' budget scale for the timed drafts and the traffic bounds."""

import math
import pathlib
import sys

import pytest
import torch

from hf_vegas import VegasConfig, traffic
from tiny_models import ragged_batch, tiny_model

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import projection  # noqa: E402
from throughput import draft_step  # noqa: E402
from workloads import Workload  # noqa: E402

REAL = dict(real_weights=True, method="vegas", decoding="greedy", model="smollm2", batch=64, commit="abc",
            tokens_per_iteration=6.5, new_tokens=256, iterations=45, budget_scale=1.3)


def test_the_source_is_the_largest_real_batch_of_the_same_policy_and_decoding():
    records = [dict(REAL, batch=16), dict(REAL, commit="old"), dict(REAL), dict(REAL, decoding="sample", batch=128),
               dict(REAL, method="streaming", batch=128), dict(REAL, real_weights=False, batch=256),
               dict(REAL, batch=256, tokens_per_iteration=None) | {"error": "x"}]
    del records[-1]["tokens_per_iteration"]  # a failed run has no acceptance
    assert projection.source(records, "vegas", "greedy") is records[2], "the latest of the largest batch"
    assert projection.source(records, "vegas", "sample") is records[3]
    assert projection.source(records[4:], "vegas", "greedy") is None


def test_matched_budget_times_the_drafts_at_the_real_runs_mean_scale(capsys):
    config = VegasConfig(gamma=6)
    timed, fields = projection.timed_config(config, REAL, "matched")
    assert timed.budget_boost == 1.3 and timed.gamma == 6 and timed.sparsity == config.sparsity
    assert fields == dict(projected_budget_boost=1.3, configured_budget_boost=2.0)
    assert projection.timed_config(config, REAL, "config") == (config, {})
    assert projection.timed_config(config, None, "matched") == (config, {})
    assert projection.timed_config(VegasConfig(gamma=6, budget_boost=1.0), REAL, "matched")[0].budget_boost == 1.0
    old = {k: v for k, v in REAL.items() if k != "budget_scale"}
    assert projection.timed_config(config, old, "matched") == (config, {})
    assert "has no budget_scale" in capsys.readouterr().out, "a record from before the scale was kept says so"
    with pytest.raises(ValueError, match="projected budget must be one of"):
        projection.timed_config(config, REAL, "half")


def test_a_projected_record_takes_the_real_tokens_per_iteration_and_says_from_what():
    record = dict(tokens_per_iteration=1.0)
    assert projection.project(record, REAL) == 6.5
    assert record["projected"] and record["measured_tokens_per_iteration"] == 1.0
    assert record["projected_net_tokens_per_iteration"] == 255 / 45 and record["projected_budget_scale"] == 1.3
    alone = dict(tokens_per_iteration=1.0)
    assert projection.project(alone, None) == 1.0 and alone["projected"] is False


def test_bounds_read_the_budget_the_drafts_ran_at():
    config = VegasConfig(gamma=3, sparsity=0.07, min_tokens=64, budget_boost=2.0)
    assert projection.rejection(dict(budget_scale=1.25), config) == 0.25
    assert projection.rejection({}, config) == 0.0
    assert projection.rejection(dict(budget_scale=1.25), VegasConfig(budget_boost=1.0)) == 0.0
    model, workload = tiny_model("llama"), Workload("smollm2", batch=4, prompt_tokens=3000)
    context = 3000 + 32
    kv_per_token = (traffic.dense_step_bytes(model, 4, context) - traffic.weight_bytes(model)) / (4 * context)
    for rejection, scale in ((0.0, 1.0), (0.25, 1.25), (1.0, 2.0)):
        out = draft_step(model, workload, 64, config, {"draft": 6.0}, 1e9, rejection=rejection)
        # per row and layer: the budget scaled by the boost at that average, plus a tail of up to 2 * gamma slots
        per_layer = int(config.budget(context) * scale) + 2 * config.gamma
        expected = traffic.weight_bytes(model) + 4 * per_layer * kv_per_token  # (KV bytes per token: every layer)
        assert math.isclose(out["draft_step_bound_ms"], expected / 1e9 * 1e3, rel_tol=1e-9), rejection


def test_a_generations_budget_fields_average_the_scales_of_the_rows_that_drafted():
    config = VegasConfig(gamma=3, sparsity=0.2, min_tokens=4, budget_boost=3.0, cuda_graphs=False)
    ids, mask = ragged_batch([40, 27, 33], seed=1)
    out = tiny_model("llama").generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=0,
                                       custom_generate="vegas", vegas_config=config, return_dict_in_generate=True)
    fields = projection.budget_fields(out, config)
    active = out.accepted >= 0
    rejected = (out.accepted < 3) & active
    assert fields["rejection_share"] == pytest.approx(float(rejected.sum() / active.sum()))
    assert 0 < fields["rejection_share"] < 1, "the case needs both"
    assert 1.0 < fields["budget_scale"] < 3.0
    unboosted = VegasConfig(gamma=3, sparsity=0.2, min_tokens=4, budget_boost=1.0)
    assert projection.budget_fields(out, unboosted)["budget_scale"] == 1.0
    nothing = type(out)(sequences=out.sequences, accepted=torch.full_like(out.accepted, -1), gammas=out.gammas)
    assert projection.budget_fields(nothing, config) == {}


def test_the_table_says_what_budget_the_drafts_ran_at(capsys):
    from throughput_table import print_table

    timed = dict(model="qwen3-8b-shape", batch=16, prompt_tokens=32768, decoding="greedy", method="vegas",
                 tokens_per_s=1399.2, step_ms=64.41, bound_tokens_per_s=1995.0, fraction_of_bound=0.70,
                 tokens_per_iteration=6.53, iterations=31,
                 split_ms=dict(draft=36.59, verify=27.87, accept=0.14, host=0),
                 projected=True, draft_step_ms=6.099, draft_step_bound_ms=5.06, draft_step_x_bound=1.205,
                 budget_scale=1.1216, projected_budget_boost=1.1346, configured_budget_boost=2.0,
                 projected_budget_scale=1.1346)
    unboosted = {k: v for k, v in timed.items() if "budget" not in k} | dict(method="streaming")
    print_table([timed, unboosted])
    out = capsys.readouterr().out
    assert "1399*" in out and "36.59/27.87/0.14/0.00" in out
    assert ("greedy vegas: draft step 6.099 ms, 1.21x its traffic bound 5.060 ms; drafts at 1.12x the plain budget "
            "(budget_boost 1.13 for the configured 2), the real model's 1.13\n") in out
    assert "greedy streaming: draft step 6.099 ms, 1.21x its traffic bound 5.060 ms\n" in out, "no scale: no note"
