"""Selection equals a brute-force reading of the paper's Eq. 3 (Collect-2-Query), and the reference masks mean what
they say."""

import math
import types

import pytest
import torch

import hf_vegas.cache
from hf_vegas import VegasConfig
from hf_vegas.attention import active_cache, vegas_attention_forward
from hf_vegas.cache import VegasCache
import hf_vegas.selection_state
from hf_vegas.selection_state import SelectionState, budget_tensor, draft_budget_scales
from hf_vegas.ops import eager
from hf_vegas_kernels import naive
from tiny_models import tiny_model


def brute_force_eq3(q_first, q_last, keys, num_candidates, budget, scaling, groups, score):
    """T = argmax_{|T|=k} sum_h sum_{i in T} (l_1i^h + l_{g+1,i}^h) over the candidates, one row, by loops."""
    heads = q_first.shape[0]
    totals = []
    for i in range(num_candidates):
        total = 0.0
        for h in range(heads):
            k = keys[i, h // groups].double()
            for q in (q_first, q_last):
                total += float(q[h].double() @ k) * scaling if score == "logits" else 0.0
        totals.append(total)
    if score == "weights":  # softmax weights of each row over the slots it sees, summed over heads and rows
        totals = [0.0] * num_candidates
        for q, visible in ((q_first, num_candidates), (q_last, keys.shape[0])):
            for h in range(heads):
                logits = [float(q[h].double() @ keys[j, h // groups].double()) * scaling for j in range(visible)]
                m = max(logits)
                z = sum(math.exp(x - m) for x in logits)
                for i in range(num_candidates):
                    totals[i] += math.exp(logits[i] - m) / z
    return set(sorted(range(num_candidates), key=lambda i: -totals[i])[:budget])


@pytest.mark.parametrize("score", ["logits", "weights"])
@pytest.mark.parametrize("groups", [1, 3])
def test_verify_selection_is_eq3(score, groups):
    torch.manual_seed(0)
    batch, kv_heads, dim, gamma = 3, 2, 16, 4
    heads = kv_heads * groups
    config = VegasConfig(gamma=gamma, sparsity=0.2, min_tokens=5, score=score)
    model_config = types.SimpleNamespace(
        get_text_config=lambda decoder=True: types.SimpleNamespace(num_hidden_layers=1, layer_types=None)
    )
    cache = VegasCache(model_config, batch, capacity=64, vegas_config=config)
    prefix = torch.tensor([40, 17, 29])  # committed lengths; verify writes gamma + 1 tokens after them
    cache.plan.lengths.copy_(prefix)
    keys = torch.randn(batch, gamma + 1, kv_heads, dim)
    cache.begin("verify")
    k_all, v_all = cache.update(keys.transpose(1, 2), keys.transpose(1, 2), 0)  # (B, H, S, D) views
    k_all[:, :, :] = torch.randn_like(k_all)  # arbitrary cached prefix
    q = torch.randn(batch, heads, gamma + 1, dim)
    module = types.SimpleNamespace(layer_idx=0, head_dim=dim)
    with active_cache(cache):
        vegas_attention_forward(module, q, k_all, v_all, None, scaling=dim**-0.5)
    for b in range(batch):
        candidates = int(prefix[b]) + 1  # the prefix plus the first query position
        budget = config.budget(candidates)
        sel = cache.selection
        assert int(sel.sel_end[b]) == candidates and int(sel.sel_count[0, b]) == budget < candidates
        ours = set(sel.sel_idx[0, b, :budget].tolist())
        expected = brute_force_eq3(q[b, :, 0], q[b, :, -1], k_all[b, :, : candidates + gamma].transpose(0, 1),
                                   candidates, budget,
                                   dim**-0.5, groups, score)
        assert ours == expected


@pytest.mark.parametrize("eager_ops", [False, True])
@pytest.mark.parametrize("groups", [1, 3])
def test_oracle_draft_reads_the_draft_querys_own_top_weights(groups, eager_ops, monkeypatch):
    """The oracle policy: a draft step's slots are the candidates its own query weighs most (softmax over every slot
    it sees, summed over heads), not anything a verification chose."""
    monkeypatch.setattr(hf_vegas.cache, "uses_eager_ops", lambda backend, device: eager_ops)
    torch.manual_seed(1)
    batch, kv_heads, dim, gamma = 3, 2, 16, 3
    heads = kv_heads * groups
    config = VegasConfig(gamma=gamma, sparsity=0.2, min_tokens=5, policy="oracle")
    model_config = types.SimpleNamespace(
        get_text_config=lambda decoder=True: types.SimpleNamespace(num_hidden_layers=1, layer_types=None)
    )
    cache = VegasCache(model_config, batch, capacity=64, vegas_config=config)
    prefix = torch.tensor([40, 17, 29])
    cache.plan.lengths.copy_(prefix)
    module = types.SimpleNamespace(layer_idx=0, head_dim=dim)
    cache.begin("verify")
    fresh = torch.randn(batch, kv_heads, gamma + 1, dim)
    k_all, v_all = cache.update(fresh, fresh, 0)
    k_all[:, :, :] = torch.randn_like(k_all)
    with active_cache(cache):
        vegas_attention_forward(module, torch.randn(batch, heads, gamma + 1, dim), k_all, v_all, None,
                                scaling=dim**-0.5)
    sel = cache.selection
    candidates = sel.sel_end.clone()
    cache.plan.rollback(prefix + 2)  # two tokens kept: the draft starts after them
    cache.begin("draft")
    k_all, v_all = cache.update(torch.randn(batch, kv_heads, 1, dim), torch.randn(batch, kv_heads, 1, dim), 0)
    q = torch.randn(batch, heads, 1, dim)
    with active_cache(cache):
        vegas_attention_forward(module, q, k_all, v_all, None, scaling=dim**-0.5)
    for b in range(batch):
        seen = int(prefix[b]) + 3
        logits = torch.einsum("hd,hsd->hs", q[b, :, 0].double(),
                              k_all[b, :, :seen].double().repeat_interleave(groups, dim=0)) * dim**-0.5
        weights = logits.softmax(dim=-1).sum(dim=0)[: int(candidates[b])]
        count = int(sel.sel_count[0, b])
        assert count == config.budget(int(candidates[b])) < int(candidates[b])
        assert set(sel.sel_idx[0, b, :count].tolist()) == set(weights.topk(count).indices.tolist())


@pytest.mark.parametrize("length,expected", [(100, 100), (4000, 280), (10, 10), (3658, 257), (3657, 256)])
def test_budget(length, expected):
    assert VegasConfig().budget(length) == expected == min(max(math.ceil(0.07 * length), 256), length)
    assert VegasConfig(budget_boost=1.0).max_budget(length) == expected
    assert VegasConfig(budget_boost=1e308).max_budget(length) == length, "a huge boost reads every candidate"


def test_a_row_whose_drafts_are_rejected_gets_a_boosted_budget():
    """`budget_boost`: each row's budget scales with its running rejection average, within the buffer sized for the
    largest boost; rows that accept everything keep the plain budget, finished rows keep their average."""
    config = VegasConfig(gamma=4, sparsity=0.1, min_tokens=8, budget_boost=3.0)
    model_config = types.SimpleNamespace(
        get_text_config=lambda decoder=True: types.SimpleNamespace(num_hidden_layers=1, layer_types=None)
    )
    cache = VegasCache(model_config, 3, capacity=400, vegas_config=config)
    assert cache.selection.max_selected == config.max_budget(400) == 120
    accepted, active = torch.tensor([4, 1, 0]), torch.tensor([True, True, False])
    cache.selection.note_acceptance(accepted, active)
    assert cache.selection.rejection.tolist() == [0.0, 0.5, 0.0]
    cache.selection.note_acceptance(accepted, torch.tensor([True, True, True]))
    assert cache.selection.rejection.tolist() == [0.0, 0.75, 0.5]
    candidates = torch.tensor([300, 300, 50])
    expected = [30, math.ceil(30 * (1 + 2 * 0.75)), 8 * 2]  # plain, boosted, the floor boosted
    assert budget_tensor(candidates, config, cache.selection.rejection).tolist() == expected
    assert budget_tensor(torch.tensor([300, 12, 50]), config, cache.selection.rejection)[1] == 12, "at most n"
    assert budget_tensor(candidates, config).tolist() == [30, 30, 8]
    cache.restart()
    assert not cache.selection.rejection.any(), "a new generation starts unboosted"
    unboosted = VegasConfig(gamma=4, sparsity=0.1, min_tokens=8, budget_boost=1.0)
    plain = VegasCache(model_config, 3, capacity=400, vegas_config=unboosted)
    plain.selection.note_acceptance(accepted, active)
    assert not plain.selection.rejection.any() and plain.selection.draft_split_len is None, "no boost: nothing tracked"


def test_draft_budget_scales_replay_the_boost_each_draft_read(monkeypatch):
    """`draft_budget_scales` (what the benchmarks read from a finished generation) gives, per row and iteration, the
    boost of the selection that iteration's drafts read: the rejection average each selection was made with, spied
    on in a generation whose rows reject some drafts and finish at different iterations."""
    from tiny_models import ragged_batch

    seen = []  # the rejection average of every selection: the prefill's, then each verification's

    def spy(candidates, config, rejection=None):
        seen.append(rejection.clone())
        return budget_tensor(candidates, config, rejection)

    monkeypatch.setattr(hf_vegas.selection_state, "budget_tensor", spy)
    config = VegasConfig(gamma=3, sparsity=0.2, min_tokens=4, budget_boost=3.0, cuda_graphs=False)
    ids, mask = ragged_batch([40, 27, 33], seed=1)
    out = tiny_model("llama").generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=0,
                                       custom_generate="vegas", vegas_config=config, return_dict_in_generate=True)
    scales = draft_budget_scales(out.accepted, out.gammas, config)
    active = out.accepted >= 0
    assert ((out.accepted < 3) & active).any() and not active.all(), "the case needs rejections and a finished row"
    assert len(seen) >= out.accepted.shape[1], "a selection for every iteration's drafts"
    for k in range(out.accepted.shape[1]):  # iteration k drafts over the selection made k selections in
        expected = config.boost(seen[k].double())
        assert torch.equal(scales[active[:, k], k], expected[active[:, k]]), k
        assert scales[~active[:, k], k].isnan().all()


def test_draft_budget_scales_skip_dense_steps_and_finished_rows():
    """By hand, `gamma="auto"` style: a dense step (gamma 0) neither drafts nor moves the average, a finished row
    (-1) keeps its average, and each drafting iteration reads the average of two drafting iterations back."""
    config = VegasConfig(budget_boost=3.0)
    accepted = torch.tensor([[1, 0, 3, 0, 2],    # rejects, (dense), accepts all, rejects, rejects
                             [3, 0, 0, -1, -1]])  # accepts all, (dense), rejects, finished
    gammas = torch.tensor([3, 0, 3, 3, 3])
    nan = float("nan")
    # row 0: averages noted 0.5 (it. 0), 0.25 (it. 2), 0.625 (it. 3); read with a lag of one drafting iteration
    expected = torch.tensor([[1.0, nan, 1.0, 1 + 2 * 0.5, 1 + 2 * 0.25],
                             [1.0, nan, 1.0, nan, nan]], dtype=torch.float64)
    torch.testing.assert_close(draft_budget_scales(accepted, gammas, config), expected, equal_nan=True)


def test_draft_mask_is_selection_plus_tail():
    sel_idx = torch.tensor([[5, 1, 3, 0], [2, 7, 0, 0]])
    sel_count = torch.tensor([3, 2])
    sel_end = torch.tensor([8, 9])
    kv_len = torch.tensor([11, 10])
    q_slot = (kv_len - 1)[:, None]
    visible = naive.draft_visible(q_slot, kv_len, sel_idx, sel_count, sel_end, num_slots=12)[:, 0]
    assert torch.nonzero(visible[0]).flatten().tolist() == [1, 3, 5, 8, 9, 10]
    assert torch.nonzero(visible[1]).flatten().tolist() == [2, 7, 9]


def test_streaming_selection_is_sinks_plus_recent():
    idx = naive.streaming_select(torch.tensor([6, 3]), torch.tensor([20, 3]), k_max=7, sink=4)
    assert idx[0, :6].tolist() == [0, 1, 2, 3, 18, 19]
    assert sorted(idx[1, :3].tolist()) == [0, 1, 2]


def test_sparse_attention_equals_dense_attention_over_the_gathered_slots():
    """The masked reference equals plain attention over an explicit gather of the visible slots."""
    torch.manual_seed(1)
    batch, heads, kv_heads, dim, slots = 2, 6, 2, 8, 30
    q = torch.randn(batch, heads, 1, dim)
    k, v = torch.randn(batch, slots, kv_heads, dim), torch.randn(batch, slots, kv_heads, dim)
    sel_idx = torch.tensor([[3, 11, 4, 0, 0], [7, 1, 2, 9, 13]])
    sel_count, sel_end, kv_len = torch.tensor([3, 5]), torch.tensor([15, 20]), torch.tensor([19, 24])
    q_slot = (kv_len - 1)[:, None]
    out = naive.sparse_draft_attention(q, k, v, q_slot, kv_len, sel_idx, sel_count, sel_end, dim**-0.5)
    for b in range(batch):
        keep = sorted(set(sel_idx[b, : sel_count[b]].tolist()) | set(range(int(sel_end[b]), int(kv_len[b]))))
        kb = k[b, keep].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # (H, n, D)
        vb = v[b, keep].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        weights = torch.softmax((q[b] @ kb.transpose(-1, -2)) * dim**-0.5, dim=-1)
        torch.testing.assert_close(out[b, 0], (weights @ vb)[:, 0], rtol=1e-5, atol=1e-6)


def test_sliding_layers_are_never_sparsified():
    """Gemma-3: only its full-attention layer gets a draft selection; sliding layers keep their window."""
    model = tiny_model("gemma3")
    calls = []
    original = eager.sparse_draft_attention  # the CPU path's draft attention

    def spy(*args, **kwargs):
        calls.append(True)
        return original(*args, **kwargs)

    eager.sparse_draft_attention, restore = spy, original
    try:
        ids = torch.randint(1, 128, (1, 60))
        out = model.generate(ids, max_new_tokens=6, do_sample=False, custom_generate="vegas", vegas_gamma=2,
                             vegas_min_tokens=4, return_dict_in_generate=True)
    finally:
        eager.sparse_draft_attention = restore
    full_layers = model.config.layer_types.count("full_attention")
    draft_forwards = 2 * out.accepted.shape[1]
    assert len(calls) == full_layers * draft_forwards


@pytest.mark.parametrize("policy", ["vegas", "last_token", "oracle"])
def test_selections_never_rank_the_scratch_slot(policy, monkeypatch):
    """Every selection ranks the cache's `capacity` slots, not its extra scratch slot (the pads' writes): a row of one
    slot past a power of two would double the kernel's register block (`kernels/.../select.py`), and the scratch
    slot is never a candidate."""
    from tiny_models import ragged_batch

    widths = []

    def spy(original):
        def select_topk(scores, *args, **kwargs):
            widths.append(scores.shape[-1])
            return original(scores, *args, **kwargs)
        return select_topk

    for module in (naive, eager):
        monkeypatch.setattr(module, "select_topk", spy(naive.select_topk))
    capacities = []
    state_init = SelectionState.__init__

    def init(self, config, num_layers, windows, batch_size, capacity, *args, **kwargs):
        capacities.append(capacity)
        state_init(self, config, num_layers, windows, batch_size, capacity, *args, **kwargs)

    monkeypatch.setattr(SelectionState, "__init__", init)
    model = tiny_model("llama")
    ids, mask = ragged_batch([40, 27])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                         custom_generate="vegas", vegas_gamma=3, vegas_sparsity=0.2, vegas_min_tokens=4,
                         vegas_policy=policy, vegas_cuda_graphs=False, return_dict_in_generate=True)
    vanilla = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(out.sequences, vanilla)
    assert len(capacities) == 1 and widths and set(widths) == set(capacities), (widths[:4], capacities)
