"""The next iteration's draft queued before the host reads the kept counts (`DecodeLoop._draft_ahead`): taken only when
the batch surely goes on, and never a change to the output (greedy stays vanilla's, sampling keeps its tokens)."""

import pytest
import torch
from transformers import TextStreamer

import hf_vegas.loop as loop
from tiny_models import ragged_batch, tiny_model

SPARSE = dict(vegas_sparsity=0.1, vegas_min_tokens=4)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="the CUDA-graph draft needs a GPU (the eager tests above take the same path)")


@pytest.fixture
def ahead_calls(monkeypatch):
    calls = []
    original = loop.DecodeLoop._draft_ahead

    def counted(loop):
        calls.append(len(loop.generated))
        return original(loop)

    monkeypatch.setattr(loop.DecodeLoop, "_draft_ahead", counted)
    return calls


def test_greedy_with_drafts_queued_ahead_is_vanilla(ahead_calls):
    model = tiny_model("llama")
    ids, mask = ragged_batch([40, 29, 13])
    common = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = model.generate(ids, **common)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=3, **SPARSE)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # 24 tokens in chunks of at most 4: the batch surely goes on until a row is within 4 of the limit
    assert len(ahead_calls) >= 3, f"the draft was queued ahead {len(ahead_calls)} times"


def test_sampling_draws_the_same_tokens_with_and_without_drafts_queued_ahead(monkeypatch):
    """The queued draft runs in the same order as before (after the acceptance), so one seed gives the same tokens."""
    model = tiny_model("qwen3", seed=3)
    ids, mask = ragged_batch([50, 33], seed=3)
    common = dict(attention_mask=mask, max_new_tokens=20, do_sample=True, temperature=1.3, top_k=20, top_p=0.9,
                  pad_token_id=0, eos_token_id=None, custom_generate="vegas", vegas_gamma=3, **SPARSE)
    torch.manual_seed(7)
    ahead = model.generate(ids, **common)
    monkeypatch.setattr(loop.DecodeLoop, "_may_draft_ahead", lambda loop, gamma: False)
    torch.manual_seed(7)
    in_order = model.generate(ids, **common)
    assert torch.equal(ahead, in_order)


def test_no_draft_queued_ahead_for_a_lone_row_that_eos_may_end_or_a_streamer(ahead_calls):
    model = tiny_model("llama")
    ids, mask = ragged_batch([30])
    common = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, custom_generate="vegas",
                  vegas_gamma=3, **SPARSE)
    model.generate(ids, **common, eos_token_id=5)  # one row that EOS may stop: a queued draft could be wasted
    assert ahead_calls == []
    model.generate(ids, **common, eos_token_id=None, streamer=TextStreamer(_Tokens()))  # the streamer would wait
    assert ahead_calls == []
    model.generate(ids, **common, eos_token_id=None)  # the length limit alone: it surely goes on
    assert len(ahead_calls) >= 2


def test_a_wasted_queued_draft_leaves_the_generator_where_it_was(ahead_calls, monkeypatch):
    """A draft queued for a batch that then stops (every row at once, as `max_time` or EOS can end it) is wasted; its
    draws must not move the generator, so a second call samples what it would have sampled without it. Forced here
    by queueing after every iteration, the last one included."""
    model = tiny_model("qwen3", seed=3)
    ids, mask = ragged_batch([50, 33, 41], seed=3)
    common = dict(attention_mask=mask, max_new_tokens=20, do_sample=True, temperature=1.3, top_k=20, pad_token_id=0,
                  eos_token_id=None, custom_generate="vegas", vegas_gamma=3, return_dict_in_generate=True, **SPARSE)
    runs = []
    for policy in (lambda loop, gamma: True, lambda loop, gamma: False):
        monkeypatch.setattr(loop.DecodeLoop, "_may_draft_ahead", policy)
        torch.manual_seed(5)
        out = model.generate(ids, **common)
        runs.append((out.sequences, torch.rand(8)))
        if not ahead_calls:
            continue
        assert len(ahead_calls) == out.accepted.shape[1], "each iteration, the last included, queued the next draft"
        ahead_calls.clear()
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1]), "the wasted draft's draws moved the generator"


@needs_gpu
def test_graph_drafts_queued_ahead_keep_greedy_vanilla_and_the_sampled_tokens(ahead_calls, monkeypatch):
    """On the GPU the queued draft is a graph replay that runs while the host reads the previous counts."""
    model = tiny_model("llama").cuda()
    ids, mask = (t.cuda() for t in ragged_batch([60, 41, 52]))
    common = dict(attention_mask=mask, max_new_tokens=24, pad_token_id=0, eos_token_id=None)
    expected = model.generate(ids, **common, do_sample=False)
    out = model.generate(ids, **common, do_sample=False, custom_generate="vegas", vegas_gamma=3, **SPARSE)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert len(ahead_calls) >= 3
    sampling = dict(common, do_sample=True, temperature=0.6, top_p=0.95, custom_generate="vegas", vegas_gamma=3,
                    **SPARSE)
    torch.manual_seed(11)
    ahead = model.generate(ids, **sampling)
    monkeypatch.setattr(loop.DecodeLoop, "_may_draft_ahead", lambda loop, gamma: False)
    torch.manual_seed(11)
    assert torch.equal(model.generate(ids, **sampling), ahead)
    # a queued draft wasted at the end (forced) leaves the CUDA generator where the in-order run leaves it
    draws = []
    for policy in (lambda loop, gamma: True, lambda loop, gamma: False):
        monkeypatch.setattr(loop.DecodeLoop, "_may_draft_ahead", policy)
        torch.manual_seed(11)
        draws.append((model.generate(ids, **sampling), torch.rand(8, device="cuda")))
    assert torch.equal(draws[0][0], draws[1][0]) and torch.equal(draws[0][1], draws[1][1])


class _Tokens:
    """The least a `TextStreamer` asks of a tokenizer."""

    def decode(self, ids, **kwargs):
        return " ".join(str(int(i)) for i in ids)
