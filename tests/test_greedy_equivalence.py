"""Greedy Vegas output is token-identical to vanilla greedy `generate` (CPU, fp32)."""

import pytest
import torch

import hf_vegas
from hf_vegas._compat.internals import CACHE_KEYWORD
from hf_vegas.selection_state import budget_tensor
from transformers import StoppingCriteria, StoppingCriteriaList

from kernel_cases import DEVICE
from tiny_models import BUILDERS, MORE_BUILDERS, ragged_batch, tiny_model

# Long enough that the budget (8 of ~80 candidates) really drops tokens.
SPARSE = dict(vegas_sparsity=0.1, vegas_min_tokens=8)
SHAPES = {"batch1": [80], "ragged3": [80, 61, 37]}


@pytest.mark.parametrize("ops", ["eager", "naive"])
@pytest.mark.parametrize("gamma", [1, 4, 8])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("arch", list(BUILDERS))
def test_greedy_matches_vanilla(arch, shape, gamma, ops, monkeypatch):
    """On the CPU the cache runs the eager ops (the CPU path); the reference ops, which the kernels and the GPU's
    "torch" backend follow, are run here end to end too."""
    if ops == "naive":
        monkeypatch.setattr(hf_vegas.cache, "uses_eager_ops", lambda backend, device: False)
    model = tiny_model(arch)
    ids, mask = ragged_batch(SHAPES[shape])
    common = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **common)
    out = model.generate(
        ids, **common, custom_generate=hf_vegas.generate, vegas_gamma=gamma, return_dict_in_generate=True, **SPARSE
    )
    torch.testing.assert_close(out.sequences, expected, rtol=0, atol=0)
    cache = getattr(out, CACHE_KEYWORD)
    assert cache.eager_ops == (ops == "eager")
    sel = cache.selection
    assert bool((sel.sel_count < sel.sel_end).all()), "the selection must drop tokens for this test to mean much"
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("policy", ["vegas", "streaming", "last_token"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_eager_ops_draft_and_select_as_the_reference_does(arch, policy, shape, monkeypatch):
    """Greedy output cannot tell a wrong draft or selection op apart (verification corrects any draft); the accepted
    counts can: the CPU path accepts exactly the drafts the reference ops do."""
    model = tiny_model(arch)
    ids, mask = ragged_batch(SHAPES[shape])
    common = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, custom_generate="vegas",
                  vegas_gamma=4, vegas_policy=policy, return_dict_in_generate=True, **SPARSE)
    eager_out = model.generate(ids, **common)
    monkeypatch.setattr(hf_vegas.cache, "uses_eager_ops", lambda backend, device: False)
    reference_out = model.generate(ids, **common)
    assert getattr(eager_out, CACHE_KEYWORD).eager_ops and not getattr(reference_out, CACHE_KEYWORD).eager_ops
    assert torch.equal(eager_out.accepted, reference_out.accepted)
    assert bool(((eager_out.accepted >= 0) & (eager_out.accepted < 4)).any()), "some drafts must be rejected"


@pytest.mark.parametrize("entry", ["callable", "short_name"])
@pytest.mark.parametrize("arch", list(MORE_BUILDERS))
def test_more_architectures_greedy_match_vanilla(arch, entry):
    model = tiny_model(arch)
    ids, mask = ragged_batch(SHAPES["ragged3"])
    common = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **common)
    custom = hf_vegas.generate if entry == "callable" else "vegas"
    out = model.generate(ids, **common, custom_generate=custom, vegas_gamma=4, return_dict_in_generate=True, **SPARSE)
    torch.testing.assert_close(out.sequences, expected, rtol=0, atol=0)
    sparse_layers = getattr(out, CACHE_KEYWORD).selection.sparse_layers
    assert sparse_layers == list(range(model.config.num_hidden_layers)), "every layer is sparse"


@pytest.mark.parametrize("policy,score", [(p, s) for p in ("vegas", "streaming", "last_token") for s in
                                          ("logits", "weights")] + [("oracle", "weights")])
def test_every_policy_and_score_is_lossless(policy, score):
    model = tiny_model("llama", seed=1)
    ids, mask = ragged_batch([70, 44], seed=1)
    common = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **common)
    out = model.generate(
        ids, **common, custom_generate="vegas", vegas_gamma=4, vegas_policy=policy, vegas_score=score, **SPARSE
    )
    assert torch.equal(out, expected)


@pytest.mark.parametrize("ops", ["naive", "eager"])
def test_a_boosted_budget_is_lossless_and_grows_the_rejecting_rows_budget(ops, monkeypatch):
    """`budget_boost`: rows whose drafts were rejected draft from more slots; the tokens stay vanilla's."""
    if ops == "naive":
        monkeypatch.setattr(hf_vegas.cache, "uses_eager_ops", lambda backend, device: False)
    model = tiny_model("llama", seed=1)
    ids, mask = ragged_batch([70, 44], seed=1)
    common = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **common)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=4, vegas_budget_boost=3.0,
                         return_dict_in_generate=True, **SPARSE)
    assert torch.equal(out.sequences, expected)
    cache = getattr(out, CACHE_KEYWORD)
    sel = cache.selection
    # The last verification's budgets used each row's average before that iteration's acceptance: rebuild it.
    before_last = torch.zeros(2)
    for step in out.accepted[:, :-1].T:
        before_last = torch.where(step >= 0, 0.5 * (before_last + (step < 4).float()), before_last)
    assert before_last.max() > 0, "some draft was rejected: a boost ran"
    counts = sel.sel_count[sel.sparse_layers]  # (sparse layers, B): full attention here, one budget for all
    assert torch.equal(counts, budget_tensor(sel.sel_end, cache.vegas_config, before_last).expand_as(counts))
    assert (counts > budget_tensor(sel.sel_end, cache.vegas_config)).any()


def test_dense_budget_accepts_every_draft():
    """With the whole prefix selected the draft is the target, so greedy accepts all gamma drafts."""
    model = tiny_model("qwen3")
    ids, mask = ragged_batch([50, 30])
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0, custom_generate="vegas",
        vegas_gamma=3, vegas_sparsity=1.0, vegas_min_tokens=1, return_dict_in_generate=True,
    )
    assert out.accepted.tolist() == [[3, 3, 3, 3]] * 2  # 1 token at prefill + 4 iterations x 4 tokens = 17 >= 16


def test_history_dependent_processors_per_row():
    """Repetition penalty, n-gram blocking and min length see each row's own history, as in vanilla."""
    model = tiny_model("llama", seed=2)
    ids, mask = ragged_batch([60, 23, 41], seed=2)
    common = dict(
        attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
        repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=10, eos_token_id=5,
    )
    expected = model.generate(ids, **common)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=4, **SPARSE)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13])
def test_max_new_tokens_inside_a_chunk(max_new_tokens):
    model = tiny_model("gemma3")
    ids, mask = ragged_batch([40, 33])
    common = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **common)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=5, vegas_sparsity=1.0, vegas_min_tokens=1)
    assert torch.equal(out, expected)


def test_eos_inside_a_chunk_pads_finished_rows():
    model = tiny_model("llama")
    ids, mask = ragged_batch([80, 61, 37])
    free = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    eos = int(free[0, ids.shape[1] + 5])  # a token row 0 emits mid-way, so it stops inside an accepted chunk
    common = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=eos)
    expected = model.generate(ids, **common)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=6, vegas_sparsity=1.0, vegas_min_tokens=1)
    # The whole prefix is selected, so every draft is accepted: after the prefill's token, row 0 commits chunks of 7.
    generated = expected[0, ids.shape[1]:]
    first = int((generated == eos).nonzero()[0])
    assert (first - 1) % 7 != 6, "row 0's EOS must fall inside an accepted chunk, not at its end"
    assert generated.shape[0] > first + 1 and bool((generated[first + 1:] == 0).all()), "then pads, as others go on"
    assert torch.equal(out, expected)


def test_custom_stopping_criterion_without_eos_keeps_decoding_finished_rows():
    """Without EOS, vanilla keeps generating real tokens for rows a custom criterion stopped; so does Vegas."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopOnToken(StoppingCriteria):
        def __init__(self, token):
            self.token = token

        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == self.token

    model = tiny_model("llama")
    ids, mask = ragged_batch([80, 61, 37])
    free = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    criteria = lambda: StoppingCriteriaList([StopOnToken(int(free[1, ids.shape[1] + 3]))])  # noqa: E731
    common = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **common, stopping_criteria=criteria())
    out = model.generate(ids, **common, stopping_criteria=criteria(), custom_generate=hf_vegas.generate, vegas_gamma=4)
    assert torch.equal(out, expected)


def test_rows_cut_by_a_criterion_keep_decoding_like_vanilla_without_eos():
    """Without EOS, vanilla keeps decoding a row a stopping criterion cut (until every row stops). A cut inside an
    accepted chunk must leave the cache and the pending token at the cut, not at the end of the chunk."""

    class StopAtLength(StoppingCriteria):
        def __init__(self, row, length):
            self.row, self.length = row, length

        def __call__(self, input_ids, scores, **kwargs):
            stop = torch.zeros(input_ids.shape[0], dtype=torch.bool)
            stop[self.row] = input_ids.shape[1] >= self.length
            return stop

    model = tiny_model("llama", seed=5)
    model.generation_config.eos_token_id = None
    ids, mask = ragged_batch([60, 45, 30], seed=5)
    criteria = lambda: StoppingCriteriaList([StopAtLength(1, ids.shape[1] + 9), StopAtLength(0, ids.shape[1] + 30)])  # noqa: E731
    common = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **common, stopping_criteria=criteria())
    out = model.generate(ids, **common, stopping_criteria=criteria(), custom_generate="vegas", vegas_gamma=5,
                         vegas_sparsity=1.0, vegas_min_tokens=1)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_batch_ends_where_its_last_row_first_stops_without_eos():
    """Without EOS, vanilla's output ends at the step where the last row first stops; rows that stopped earlier
    keep decoding real tokens up to there. Vegas rows that ran ahead in chunks must be cut back to that length."""

    class StopRowAtLength(StoppingCriteria):
        """Row b says stop once, when its history is exactly `lengths[b]` tokens long."""

        def __init__(self, lengths):
            self.lengths = lengths

        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([input_ids.shape[1] == n for n in self.lengths])

    model = tiny_model("qwen3", seed=5)
    model.generation_config.eos_token_id = None
    ids, mask = ragged_batch([70, 52, 33], seed=5)
    # gamma 6 with a full budget accepts every draft: a row advances 7 tokens per iteration. Rows 0 and 1 stop at
    # 3 and 5 new tokens and then run on in whole chunks (17 and 19 after three iterations); row 2 stops last, at 16,
    # the first token of its third chunk, behind them.
    stops = [3, 5, 16]
    criteria = lambda: StoppingCriteriaList([StopRowAtLength([ids.shape[1] + n for n in stops])])  # noqa: E731
    common = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **common, stopping_criteria=criteria())
    assert expected.shape[1] == ids.shape[1] + max(stops)
    for custom in (hf_vegas.generate, "vegas"):
        out = model.generate(ids, **common, stopping_criteria=criteria(), custom_generate=custom, vegas_gamma=6,
                             vegas_sparsity=1.0, vegas_min_tokens=1)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpt_oss_attention_sinks_give_vanilla_greedy_tokens(backend):
    """gpt-oss' learned sinks join every softmax (full and sliding layers, drafts, verifications, the selection's
    weights): the tokens are vanilla's. The Triton backend runs its sink layers on the plain ops. Sinks drawn large
    enough that ignoring them would change the tokens."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=16, pad_token_id=0)
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(4) * 3)
    ids, mask = ragged_batch([50, 33])  # tiny_models.VOCAB ids fit the 128-token vocabulary
    if backend == "triton":  # the kernels on the GPU where there is one, else in Triton's CPU interpreter
        model, ids, mask = model.to(DEVICE), ids.to(DEVICE), mask.to(DEVICE)
    common = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    vanilla = model.generate(ids, **common)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=3, vegas_sparsity=0.2,
                         vegas_min_tokens=8, vegas_backend=backend)
    torch.testing.assert_close(out, vanilla, rtol=0, atol=0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.zero_()
    assert not torch.equal(model.generate(ids, **common), vanilla), "the sinks must matter for this test to prove it"
