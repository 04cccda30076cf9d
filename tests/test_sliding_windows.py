"""Sliding-window layers that draft sparsely inside their window (Mistral v0.1, Phi-3-mini-4k and StarCoder2 past
their window, a hybrid model's long windows): lossless, and the selection and the drafts keep to the window."""

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import hf_vegas
from hf_vegas import VegasConfig
from hf_vegas._compat.internals import CACHE_KEYWORD
from hf_vegas.cache import sparse_layers
from hf_vegas.selection_state import budget_tensor
from hf_vegas.traffic import dense_step_bytes, vegas_iteration_bytes, weight_bytes
from tiny_models import COMMON, ragged_batch, tiny_model

# Tiny windows draft sparsely here: `SHORT_WINDOW` is lowered (`short_windows_draft` in tests/conftest.py), except
# where a test says otherwise.
pytestmark = pytest.mark.usefixtures("short_windows_draft")

SPARSE = dict(vegas_sparsity=0.1, vegas_min_tokens=8)
WINDOW = 40  # tiny_models' "mistral_short_window"
SHAPES = {"batch1": [80], "ragged3": [80, 61, 37]}


def hybrid(window: int = WINDOW, seed: int = 0):
    """Gemma-3's 5:1 pattern with a window long enough to draft sparsely: both kinds of sparse layer in one model."""
    torch.manual_seed(seed)
    return Gemma3ForCausalLM(Gemma3TextConfig(**COMMON, num_hidden_layers=6, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=16, sliding_window=window)).eval()


def _text(**fields):
    return type("Text", (), {"num_hidden_layers": 3, "layer_types": None, "sliding_window": None, **fields})()


def test_which_layers_draft_sparsely(monkeypatch):
    """Full attention always; a window longer than 1024 slots when a draft would read under a quarter of it; a window
    at least the generation's reach is full attention."""
    monkeypatch.setattr(hf_vegas.config, "SHORT_WINDOW", 1024)  # the real threshold
    config = VegasConfig()  # budget floor 256
    assert not VegasConfig(min_tokens=64).drafts_window_sparsely(1024), "hybrid models' short windows stay whole"
    for window, sparse in ((4096, True), (2047, True), (1025, True), (1024, False), (512, False), (128, False)):
        assert config.drafts_window_sparsely(window) is sparse, window
        assert sparse_layers(_text(sliding_window=window), config, reach=10_000) == (
            {i: window for i in range(3)} if sparse else {})
    assert sparse_layers(_text(sliding_window=4096), config, reach=4096) == {0: None, 1: None, 2: None}
    assert config.drafts_window_sparsely(1500) and not VegasConfig(min_tokens=512).drafts_window_sparsely(1500), \
        "a window stays whole where a draft would read a quarter of it or more"
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    assert sparse_layers(_text(layer_types=types, sliding_window=512), config, reach=10_000) == {1: None}


@pytest.mark.parametrize("ops", ["eager", "naive"])
@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_windowed_model_greedy_matches_vanilla(shape, gamma, ops, monkeypatch):
    if ops == "naive":
        monkeypatch.setattr(hf_vegas.cache, "uses_eager_ops", lambda backend, device: False)
    model = tiny_model("mistral_short_window")
    ids, mask = ragged_batch(SHAPES[shape])
    common = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **common)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=gamma, vegas_budget_boost=1.0,
                         return_dict_in_generate=True, **SPARSE)
    assert torch.equal(out.sequences, expected)
    cache = getattr(out, CACHE_KEYWORD)
    sel = cache.selection
    assert sel.windows == {0: WINDOW, 1: WINDOW}, "every layer drafts sparsely inside its window"
    # The candidates are the window's last WINDOW - 1 slots before sel_end, the budget counts only them, and the
    # selection stays among them.
    candidates = torch.minimum(sel.sel_end, torch.tensor(WINDOW - 1))
    assert torch.equal(sel.cand_start, (sel.sel_end - candidates).expand_as(sel.cand_start))
    assert bool((sel.sel_end > WINDOW).all()), "the rows must outgrow the window for this test to mean much"
    for layer in sel.windows:
        assert torch.equal(sel.sel_count[layer], budget_tensor(candidates, cache.vegas_config))
        for b in range(ids.shape[0]):
            chosen = sel.sel_idx[layer, b, : sel.sel_count[layer, b]]
            assert bool(((chosen >= sel.cand_start[layer, b]) & (chosen < sel.sel_end[b])).all())
    assert bool((sel.sel_count < candidates).all()), "the selection must drop some of the window"


def test_a_whole_window_budget_drafts_exactly_the_window(monkeypatch):
    """With every candidate selected a windowed draft is the model's own window attention, so greedy accepts every
    draft: the candidates and the drafts' window mask are exactly the window (a slot too few or too many would make
    some draft differ). The rule would keep such a window dense; it is bypassed here."""
    monkeypatch.setattr(VegasConfig, "drafts_window_sparsely", lambda self, window: True)
    model = tiny_model("mistral_short_window")
    ids, mask = ragged_batch([80, 61])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0,
                         custom_generate="vegas", vegas_gamma=3, vegas_sparsity=1.0, vegas_min_tokens=1,
                         return_dict_in_generate=True)
    assert out.accepted.tolist() == [[3, 3, 3, 3]] * 2


@pytest.mark.parametrize("policy", ["vegas", "streaming", "last_token"])
def test_hybrid_long_windows_and_full_layers_each_take_their_own_budget(policy, monkeypatch):
    """Gemma-3's pattern with a 40-slot window: five windowed sparse layers and one full layer, each with its own
    candidates and budget; the CPU path drafts and selects as the reference ops do."""
    model = hybrid()
    ids, mask = ragged_batch([80, 37])
    common = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **common)
    vegas = dict(custom_generate="vegas", vegas_gamma=4, vegas_policy=policy, vegas_budget_boost=1.0,
                 return_dict_in_generate=True, **SPARSE)
    out = model.generate(ids, **common, **vegas)
    assert torch.equal(out.sequences, expected)
    cache = getattr(out, CACHE_KEYWORD)
    sel = cache.selection
    assert sel.windows == {0: WINDOW, 1: WINDOW, 2: WINDOW, 3: WINDOW, 4: WINDOW, 5: None}
    assert bool((sel.cand_start[5] == 0).all()) and bool((sel.cand_start[0] > 0).all())
    assert torch.equal(sel.sel_count[5], budget_tensor(sel.sel_end, cache.vegas_config))  # the whole prefix
    in_window = torch.minimum(sel.sel_end, torch.tensor(WINDOW - 1))
    assert torch.equal(sel.sel_count[0], budget_tensor(in_window, cache.vegas_config))
    assert bool((sel.sel_count[5] > sel.sel_count[0]).any()), "the rows must be long enough for budgets to differ"
    monkeypatch.setattr(hf_vegas.cache, "uses_eager_ops", lambda backend, device: False)
    reference_out = model.generate(ids, **common, **vegas)
    assert torch.equal(out.accepted, reference_out.accepted)
    assert bool(((out.accepted >= 0) & (out.accepted < 4)).any()), "some drafts must be rejected"


def test_oracle_inside_a_window_is_lossless():
    model = tiny_model("mistral_short_window")
    ids, mask = ragged_batch([80, 50])
    common = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=3, vegas_policy="oracle", **SPARSE)
    assert torch.equal(out, model.generate(ids, **common))


def test_gamma_zero_runs_a_model_whose_windows_are_all_too_short_to_draft():
    """Drafting would refuse it (tests/test_errors.py); the dense path drafts nothing and runs it."""
    model = tiny_model("mistral_short_window")
    ids, mask = ragged_batch([60, 33])
    common = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=0)
    assert torch.equal(out, model.generate(ids, **common))


def test_traffic_model_reads_a_budget_of_each_sparse_window():
    model = tiny_model("mistral_short_window")
    config = VegasConfig(gamma=3, sparsity=0.1, min_tokens=8, budget_boost=1.0)
    batch, context = 4, 200
    per_token = 2 * model.config.num_key_value_heads * model.config.head_dim * model.dtype.itemsize
    drafted = config.budget(WINDOW - 1) + 2 * config.gamma  # selection + tail, per layer, instead of the window
    draft = weight_bytes(model) + batch * model.config.num_hidden_layers * drafted * per_token
    expected = config.gamma * draft + dense_step_bytes(model, batch, context + config.gamma + 1)
    assert vegas_iteration_bytes(model, batch, context, config) == expected
    assert drafted < WINDOW


def test_a_window_above_the_real_threshold_drafts_sparsely_through_every_entry_point(monkeypatch):
    """At the real `SHORT_WINDOW`: a 1100-slot window under prompts of 1300 tokens, on the CPU path, through the
    callable, the short name, the Hub-style folder (its own copy of the code) and HF's assisted loop."""
    monkeypatch.setattr(hf_vegas.config, "SHORT_WINDOW", 1024)
    torch.manual_seed(0)
    from transformers import MistralConfig, MistralForCausalLM

    from hf_vegas.assisted import assisted_generate
    from hub_folder import hub_folder

    model = MistralForCausalLM(MistralConfig(**COMMON, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, sliding_window=1100)).eval()
    ids, mask = ragged_batch([1300, 1180])
    common = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    vegas = dict(vegas_gamma=4, vegas_min_tokens=64)
    expected = model.generate(ids, **common)
    out = model.generate(ids, **common, custom_generate="vegas", return_dict_in_generate=True, **vegas)
    assert torch.equal(out.sequences, expected)
    sel = getattr(out, CACHE_KEYWORD).selection
    assert sel.windows == {0: 1100, 1: 1100} and bool((sel.sel_count < 1099).all())
    assert torch.equal(model.generate(ids, **common, custom_generate=hf_vegas.generate, **vegas), expected)
    hub = model.generate(ids, **common, custom_generate=hub_folder(), trust_remote_code=True, **vegas)
    assert torch.equal(hub, expected)
    one = ids[:1]
    assert torch.equal(assisted_generate(model, one, max_new_tokens=12, do_sample=False, **vegas),
                       model.generate(one, max_new_tokens=12, do_sample=False))


@pytest.mark.parametrize("arch", ["phi3", "starcoder2"])
def test_phi3_and_starcoder2_past_their_window_draft_inside_it(arch, monkeypatch):
    """Phi-3-mini-4k (2047) and StarCoder2 (4096) window every layer like Mistral v0.1; past the window (here 1100
    slots, at the real threshold) they draft inside it and keep vanilla's tokens."""
    monkeypatch.setattr(hf_vegas.config, "SHORT_WINDOW", 1024)
    model = tiny_model(arch)
    model.config.sliding_window = 1100
    ids, mask = ragged_batch([1250, 1130])
    common = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=3, vegas_min_tokens=64,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(ids, **common))
    assert getattr(out, CACHE_KEYWORD).selection.windows == {i: 1100 for i in range(model.config.num_hidden_layers)}


def test_the_cpu_draft_list_keeps_the_window_s_first_slot():
    """The CPU path's one-query list (no mask) is the naive visible set, the window's first slot included; a
    selected slot the window has left sends it to the general (masked) path."""
    from hf_vegas.ops import eager
    from hf_vegas_kernels import naive

    q_slot, kv_len, count, end = torch.tensor([[19]]), torch.tensor([20]), torch.tensor([2]), torch.tensor([16])
    chosen = torch.tensor([[12, 14, 0]])  # window 8: the query at 19 sees slots 12..19
    visible = naive.draft_visible(q_slot, kv_len, chosen, count, end, 20, window=8)[0, 0]
    assert visible.nonzero().flatten().tolist() == [12, 14, 16, 17, 18, 19]
    assert eager._one_query_list(q_slot, kv_len, chosen, count, end, window=8).tolist() == [[12, 14, 16, 17, 18, 19]]
    assert eager._one_query_list(q_slot, kv_len, torch.tensor([[11, 14, 0]]), count, end, window=8) is None


def test_streaming_keeps_no_sink_slots_inside_a_window():
    from hf_vegas.selection import Streaming

    count, end = torch.tensor([5]), torch.tensor([40])
    assert Streaming().select_by_position(count, end, 7, windowed=True)[0, :5].tolist() == [35, 36, 37, 38, 39]
    assert Streaming().select_by_position(count, end, 7)[0, :5].tolist() == [0, 1, 2, 3, 39]
