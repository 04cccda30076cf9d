"""The throughput benchmark's projection of random-weight shapes (`benchmarks/projection.py`): the real model's tokens
per iteration, and its drafts' budget scale for the timed drafts and the traffic bounds."""

import math
import pathlib
import sys
import types

import pytest
import torch

from hf_vegas import VegasConfig, traffic
from tiny_models import ragged_batch, tiny_model

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import projection  # noqa: E402
from throughput_records import draft_step  # noqa: E402
from workloads import Workload  # noqa: E402

CONFIG = VegasConfig(gamma=6)
REAL = dict(real_weights=True, method="vegas", decoding="greedy", model="smollm2", batch=64, prompt_tokens=7502,
            commit="abc", config=CONFIG.to_dict(), tokens_per_iteration=6.5, new_tokens=256, iterations=45,
            budget_scale=1.3, rejected_rows=["0100", "0011", "1-", "0000"])


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


def test_a_real_runs_rows_are_replayed_iteration_by_iteration(capsys):
    history, fields = projection.history(CONFIG, REAL, "rows")
    assert history == REAL["rejected_rows"]
    assert fields == dict(projected_budget="rows", replayed_rejections_from="smollm2 64x7502 (abc)")
    assert projection.history(CONFIG, REAL, "config") == (None, dict(projected_budget="config"))
    assert projection.history(CONFIG, None, "rows") == (None, {})
    assert projection.history(VegasConfig(gamma=6, budget_boost=1.0), REAL, "rows") == (None, {})
    old = {k: v for k, v in REAL.items() if k != "rejected_rows"}
    assert projection.history(CONFIG, old, "rows") == (None, dict(projected_budget="config (the source has no "
                                                                                 "rejected_rows)")), "recorded"
    assert "has no rejected_rows" in capsys.readouterr().out, "a record from before the rows were kept says so"
    with pytest.raises(ValueError, match="projected budget must be one of"):
        projection.history(CONFIG, REAL, "half")
    # 2 rows follow real rows 0 and 2 (of 4); past a row's end its history starts over; "-" (finished) accepts
    replay = projection.replayed_rejections(REAL["rejected_rows"], 2, 5, gamma=6)
    assert replay.tolist() == [[6, 0, 6, 6, 6], [0, 6, 0, 6, 0]]
    assert projection.replayed_rejections(["01"], 3, 2, gamma=4).tolist() == [[4, 0]] * 3


def test_rejected_rows_mark_each_drafting_iteration():
    out = types.SimpleNamespace(accepted=torch.tensor([[3, 0, 1, 3], [2, 0, 3, -1]]),
                                gammas=torch.tensor([3, 0, 3, 3]))
    assert projection.rejected_rows(out) == ["010", "10-"], "the dense step (gamma 0) is left out"


def test_replayed_selections_note_the_real_rows_and_the_library_is_put_back(monkeypatch):
    """Inside `replaying` each verification notes, for its rows, the real run's rejections at that iteration (through
    the library's own update, into the same tensor a captured graph reads), a new generation starts the history over,
    and `budget_fields` replays what the selections read; on exit, even through an error, the library is back."""
    import hf_vegas.selection_state as state

    seen = []

    def spy(candidates, config, rejection=None):
        seen.append((rejection.clone(), rejection.data_ptr()))
        return budget_tensor(candidates, config, rejection)

    budget_tensor = state.budget_tensor
    monkeypatch.setattr(state, "budget_tensor", spy)
    original = (state.SelectionState.note_acceptance, state.SelectionState.restart)
    config = VegasConfig(gamma=3, sparsity=0.2, min_tokens=4, budget_boost=3.0, cuda_graphs=False)
    ids, mask = ragged_batch([40, 27, 33], seed=1)
    history = ["1100", "0000", "0101"]
    model = tiny_model("llama")
    common = dict(attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=0, custom_generate="vegas",
                  vegas_config=config, return_dict_in_generate=True)
    with projection.replaying(history):
        out = model.generate(ids, **common)
        first = list(seen)
        seen.clear()
        again = model.generate(ids, **common)
    assert (state.SelectionState.note_acceptance, state.SelectionState.restart) == original
    assert torch.equal(again.accepted, out.accepted)
    assert [r.tolist() for r, _ in seen] == [r.tolist() for r, _ in first], "the second generation starts over"
    assert len({ptr for _, ptr in first}) == 1, "written in place: a captured graph reads the same tensor"
    active = out.accepted >= 0
    assert not active.all() and out.accepted.shape[1] >= 4, "the case needs a row that finished early"
    replay = projection.replayed_rejections(history, 3, out.accepted.shape[1], 3)
    expected = torch.zeros(3)
    for k in range(min(out.accepted.shape[1], len(first) - 2)):  # the prefill's, then verification j's after j notes
        rejected = (replay[:, k] < 3).float()
        expected = torch.where(active[:, k], 0.5 * (expected + rejected), expected)
        assert torch.equal(first[k + 2][0], expected), k
    fields = projection.budget_fields(out, config, history)
    noted = torch.where(active, replay, -1)
    scales = state.draft_budget_scales(noted, out.gammas, config)
    assert fields["budget_scale"] == pytest.approx(float(scales[active].mean()))
    assert fields["budget_scale"] != projection.budget_fields(out, config)["budget_scale"], "the replay counted"
    with pytest.raises(RuntimeError, match="boom"), projection.replaying(history):
        raise RuntimeError("boom")
    assert (state.SelectionState.note_acceptance, state.SelectionState.restart) == original
    with projection.replaying(None):
        assert state.SelectionState.note_acceptance is original[0], "None: nothing replayed"


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
                 budget_scale=1.1216, replayed_rejections_from="smollm2 64x7502 (abc)",
                 projected_budget_scale=1.1346)
    unboosted = {k: v for k, v in timed.items() if "budget" not in k} | dict(method="streaming")
    print_table([timed, unboosted])
    out = capsys.readouterr().out
    assert "1399*" in out and "36.59/27.87/0.14/0.00" in out
    assert ("greedy vegas: draft step 6.099 ms, 1.21x its traffic bound 5.060 ms; drafts at 1.12x the plain budget "
            "(rows' rejections replayed from smollm2 64x7502 (abc)), the real model's 1.13\n") in out
    assert "greedy streaming: draft step 6.099 ms, 1.21x its traffic bound 5.060 ms\n" in out, "no scale: no note"
