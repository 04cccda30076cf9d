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

CONFIG = VegasConfig(gamma=6)
REAL = dict(real_weights=True, method="vegas", decoding="greedy", model="smollm2", batch=64, prompt_tokens=7502,
            commit="abc", config=CONFIG.to_dict(), tokens_per_iteration=6.5, new_tokens=256, iterations=45,
            budget_scale=1.3)


def test_the_source_is_the_latest_real_run_of_the_largest_batch_with_the_same_settings_and_decoding():
    records = [dict(REAL, batch=16), dict(REAL, commit="old"), dict(REAL), dict(REAL, decoding="sample", batch=128),
               dict(REAL, batch=128, config=VegasConfig(gamma=6, policy="streaming").to_dict()),
               dict(REAL, batch=128, config=VegasConfig(gamma=4).to_dict()),
               dict(REAL, batch=128, config=VegasConfig(gamma=6, sparsity=0.05).to_dict()),
               dict(REAL, batch=128, config=VegasConfig(gamma=6, budget_boost=1.0).to_dict()),
               dict(REAL, real_weights=False, batch=256), dict(REAL, batch=256) | {"error": "x"}]
    del records[-1]["tokens_per_iteration"]  # a failed run has no acceptance
    assert projection.source(records, CONFIG, "greedy") is records[2], "the latest of the largest batch"
    assert projection.source(records, CONFIG, "sample") is records[3]
    assert projection.source(records, VegasConfig(gamma=4), "greedy") is records[5]
    assert projection.source(records[3:], VegasConfig(gamma=6, score="logits"), "greedy") is None
    # the compute settings (compile, graphs, backend) do not change acceptance: they need not match
    assert projection.source(records, VegasConfig(gamma=6, compile=True, backend="torch"), "greedy") is records[2]


def test_matched_budget_holds_the_rows_at_the_average_whose_boost_is_the_real_runs_mean_scale(capsys):
    held, fields = projection.held_rejection(CONFIG, REAL, "matched")
    assert held == pytest.approx(0.3) and fields == dict(held_rejection=held)
    boost3 = VegasConfig(gamma=6, budget_boost=3.0)
    assert projection.held_rejection(boost3, REAL, "matched")[0] == pytest.approx(0.15)
    assert projection.held_rejection(CONFIG, dict(REAL, budget_scale=2.6), "matched")[0] == 1.0, "at most the boost"
    assert projection.held_rejection(CONFIG, REAL, "config") == (None, {})
    assert projection.held_rejection(CONFIG, None, "matched") == (None, {})
    assert projection.held_rejection(VegasConfig(gamma=6, budget_boost=1.0), REAL, "matched") == (None, {})
    old = {k: v for k, v in REAL.items() if k != "budget_scale"}
    assert projection.held_rejection(CONFIG, old, "matched") == (None, {})
    assert "has no budget_scale" in capsys.readouterr().out, "a record from before the scale was kept says so"
    with pytest.raises(ValueError, match="projected budget must be one of"):
        projection.held_rejection(CONFIG, REAL, "half")


def test_a_held_rejection_sets_every_selection_after_the_first_verification_and_is_put_back(monkeypatch):
    """Inside `pinned_rejection` each verification sets its active rows' averages to the held value (whatever they
    accepted), with the configured boost kept (it sizes the draft attention's splits); the replay in `budget_fields`
    gives what the selections read; on exit, even through an error, the library's `note_acceptance` is back."""
    import hf_vegas.selection_state as state

    seen = []

    def spy(candidates, config, rejection=None):
        seen.append(rejection.clone())
        return budget_tensor(candidates, config, rejection)

    budget_tensor = state.budget_tensor
    monkeypatch.setattr(state, "budget_tensor", spy)
    original = state.SelectionState.note_acceptance
    config = VegasConfig(gamma=3, sparsity=0.2, min_tokens=4, budget_boost=3.0, cuda_graphs=False)
    ids, mask = ragged_batch([40, 27, 33], seed=1)
    with projection.pinned_rejection(0.25):
        out = tiny_model("llama").generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False,
                                           pad_token_id=0, custom_generate="vegas", vegas_config=config,
                                           return_dict_in_generate=True)
    assert state.SelectionState.note_acceptance is original
    active = out.accepted >= 0
    assert not active.all() and out.accepted.shape[1] >= 4, "the case needs a row that finished early"
    assert not seen[0].any() and not seen[1].any(), "the prefill's and the first verification's selections: at 0"
    for k in range(2, out.accepted.shape[1]):
        row_was_active = active[:, k - 1]  # the rows the previous verification noted
        assert torch.all(seen[k][row_was_active] == 0.25), k
    fields = projection.budget_fields(out, config, pinned=0.25)
    scales = torch.tensor([1.0 if k < 2 else 1.5 for k in range(out.accepted.shape[1])], dtype=torch.float64)
    assert fields["budget_scale"] == pytest.approx(float(scales.expand_as(out.accepted)[active].mean()))
    assert projection.budget_fields(out, config)["budget_scale"] != fields["budget_scale"], "the replay read the hold"
    with pytest.raises(RuntimeError, match="boom"), projection.pinned_rejection(0.5):
        raise RuntimeError("boom")
    assert state.SelectionState.note_acceptance is original
    with projection.pinned_rejection(None):
        assert state.SelectionState.note_acceptance is original, "None: nothing held"


def test_a_projected_record_takes_the_real_tokens_per_iteration_and_says_from_what():
    record = dict(tokens_per_iteration=1.0)
    assert projection.project(record, REAL) == 6.5
    assert record["projected"] and record["measured_tokens_per_iteration"] == 1.0
    assert record["projected_from"] == "smollm2 64x7502 greedy (abc)"
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
                 budget_scale=1.1216, held_rejection=0.1346, projected_budget_scale=1.1346)
    unboosted = {k: v for k, v in timed.items() if "budget" not in k} | dict(method="streaming")
    print_table([timed, unboosted])
    out = capsys.readouterr().out
    assert "1399*" in out and "36.59/27.87/0.14/0.00" in out
    assert ("greedy vegas: draft step 6.099 ms, 1.21x its traffic bound 5.060 ms; drafts at 1.12x the plain budget "
            "(rejection average held at 0.135), the real model's 1.13\n") in out
    assert "greedy streaming: draft step 6.099 ms, 1.21x its traffic bound 5.060 ms\n" in out, "no scale: no note"
