"""The CPU path's ops (`hf_vegas/ops/eager.py`) against the reference ops they must equal.

Each eager op gets caches poisoned with NaN wherever it must not read (beyond a row's length; for drafts, every slot
that is neither selected nor in the tail), the reference gets the clean caches: equal outputs prove both the result
and that the eager op reads only what it claims. Both cache layouts are covered: the CPU cache's heads-first storage
behind the `(B, S, H, D)` view, and a plain `(B, S, H, D)` tensor.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import dense_readable, make_case, poisoned, sparse_readable

from hf_vegas.ops import eager
from hf_vegas_kernels import naive

SHAPES = [(64, 9, 3), (48, 4, 4), (80, 8, 2)]  # (head_dim, q_heads, kv_heads): GQA 3, MHA, GQA 4; odd head dims


def _stale(cache: torch.Tensor, case, readable: torch.Tensor) -> torch.Tensor:
    """NaN past every row's length (no op may read there); large finite junk in the slots a dense op reads but must
    mask out (a shorter row's slots up to the longest row, slots a window leaves), as stale KV from earlier steps."""
    out = cache.clone()
    read = torch.arange(cache.shape[1])[None, :] < case.kv_len.max()
    out[read & ~readable] = 1e3
    out[~read.expand_as(readable)] = float("nan")
    return out


def _layout(cache: torch.Tensor, heads_first: bool) -> torch.Tensor:
    """The values of `cache` `(B, S, H, D)`, stored heads-first (as `VegasCache` stores them on the CPU) or not."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2) if heads_first else cache.contiguous()


@pytest.mark.parametrize("heads_first", [True, False])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", SHAPES)
def test_sparse_draft_attention_reads_only_the_selection_and_tail(head_dim, q_heads, kv_heads, tokens, heads_first):
    case = make_case([37, 90, 61], [3, 9, 1], tokens, head_dim, q_heads, kv_heads, device="cpu")
    readable = sparse_readable(case)
    args = (case.q_slot, case.kv_len, case.sel_idx, case.sel_count, case.sel_end, case.scaling)
    expected = naive.sparse_draft_attention(case.q, case.k, case.v, *args)
    k, v = (_layout(poisoned(c, readable), heads_first) for c in (case.k, case.v))
    got = eager.sparse_draft_attention(case.q, k, v, *args)
    assert not got.isnan().any()
    assert got.is_contiguous(), "models may `view` the attention output as (B, T, H * D), as transformers' is"
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads_first", [True, False])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_one_row_one_query_draft_reads_only_the_selection_and_tail(softcap, heads_first):
    """The CPU's usual draft (batch 1, one query) takes the mask-free list path; the same result and reads."""
    case = make_case([97], [5], 1, 64, 9, 3, device="cpu")
    args = (case.q_slot, case.kv_len, case.sel_idx, case.sel_count, case.sel_end, case.scaling, softcap)
    assert eager._one_query_list(case.q_slot, case.kv_len, case.sel_idx, case.sel_count, case.sel_end) is not None
    expected = naive.sparse_draft_attention(case.q, case.k, case.v, *args)
    k, v = (_layout(poisoned(c, sparse_readable(case)), heads_first) for c in (case.k, case.v))
    got = eager.sparse_draft_attention(case.q, k, v, *args)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_one_query_list_falls_back_when_its_preconditions_fail():
    """A selection that is not a candidate, or `sel_end` past the length, takes the general (mask) path."""
    case = make_case([60], [4], 1, 32, 4, 2, device="cpu")
    args = (case.q_slot, case.kv_len, case.sel_idx, case.sel_count)
    past = case.sel_idx.clone()
    past[0, 0] = int(case.sel_end[0])  # a slot of the tail, not a candidate
    assert eager._one_query_list(case.q_slot, case.kv_len, past, case.sel_count, case.sel_end) is None
    assert eager._one_query_list(*args, case.kv_len + 1) is None
    expected = naive.sparse_draft_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, past,
                                                case.sel_count, case.sel_end, case.scaling)
    got = eager.sparse_draft_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, past, case.sel_count,
                                       case.sel_end, case.scaling)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [eager.GROUPED_MAX_TOKENS + 1])
def test_long_masked_forward_equals_the_reference(tokens):
    """A prefill after a prompt cache (many queries, a mask): the grouped-query SDPA path."""
    case = make_case([tokens + 30, tokens + 9], [0, 0], tokens, 32, 6, 2, device="cpu")
    args = (case.q_slot, case.kv_len, case.scaling, None, None)
    k, v = (_layout(_stale(c, case, dense_readable(case)), True) for c in (case.k, case.v))
    torch.testing.assert_close(eager.dense_attention(case.q, k, v, *args),
                               naive.dense_attention(case.q, case.k, case.v, *args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", SHAPES)
def test_dense_attention_reads_only_valid_slots(head_dim, q_heads, kv_heads, tokens, window, softcap):
    case = make_case([40, 73, 12], [0, 0, 0], tokens, head_dim, q_heads, kv_heads, device="cpu")
    readable = dense_readable(case, window)
    args = (case.q_slot, case.kv_len, case.scaling, window, softcap)
    expected = naive.dense_attention(case.q, case.k, case.v, *args)
    k, v = (_layout(_stale(c, case, readable), True) for c in (case.k, case.v))
    got = eager.dense_attention(case.q, k, v, *args)
    assert not got.isnan().any()
    assert got.is_contiguous(), "models may `view` the attention output as (B, T, H * D), as transformers' is"
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_one_row_decode_runs_unmasked_and_equals_the_reference():
    """A single decode row sees every valid slot: the eager op passes no mask (vanilla's SDPA call)."""
    case = make_case([300], [0], 1, 64, 9, 3, device="cpu")
    args = (case.q_slot, case.kv_len, case.scaling)
    assert eager._all_or_mask(naive.visible_slots(case.q_slot, case.kv_len, 300, None)) is None
    torch.testing.assert_close(eager.dense_attention(case.q, case.k, case.v, *args),
                               naive.dense_attention(case.q, case.k, case.v, *args), atol=1e-5, rtol=1e-5)


def test_value_head_dim_may_differ_from_the_key_head_dim():
    """Latent attention (DeepSeek-V2/V3, MiniCPM3) caches values narrower than keys."""
    case = make_case([33, 50], [2, 4], 1, 48, 4, 4, device="cpu")
    v = torch.randn(*case.v.shape[:-1], 32)
    args = (case.q_slot, case.kv_len, case.sel_idx, case.sel_count, case.sel_end, case.scaling)
    expected = naive.sparse_draft_attention(case.q, case.k, v, *args)
    torch.testing.assert_close(eager.sparse_draft_attention(case.q, case.k, v, *args), expected,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("score", ["weights", "logits"])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", SHAPES)
def test_row_scores_equal_the_reference(head_dim, q_heads, kv_heads, score, softcap):
    case = make_case([45, 81, 20], [0, 0, 0], 7, head_dim, q_heads, kv_heads, device="cpu")
    rows = torch.tensor([0, 6])
    cand_end = case.kv_len - 6
    args = (case.q_slot[:, rows], case.kv_len, cand_end, case.scaling, score, softcap)
    expected = naive.row_scores(case.q[:, :, rows], case.k, *args)
    k = _layout(_stale(case.k, case, dense_readable(case)), True)
    got = eager.row_scores(case.q[:, :, rows], k, *args)
    assert got.shape == expected.shape
    assert torch.equal(got.isinf(), expected.isinf())
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_row_scores_reject_an_unknown_score():
    case = make_case([10], [0], 1, 16, 2, 2, device="cpu")
    with pytest.raises(ValueError, match="score must be 'logits' or 'weights'"):
        eager.row_scores(case.q, case.k, case.q_slot, case.kv_len, case.kv_len, 1.0, "probabilities")


# -- attention sinks (gpt-oss) -------------------------------------------------------------------------------------


def _sinks(q_heads: int) -> torch.Tensor:
    return torch.linspace(-2.0, 3.0, q_heads)  # one logit per query head, some above the usual logits


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", SHAPES)
def test_sinks_in_every_op_match_the_reference(head_dim, q_heads, kv_heads, tokens):
    """The CPU path's dense, draft and scoring ops with sinks equal the reference's, reading only what they claim."""
    case = make_case([37, 90, 61], [3, 9, 1], tokens, head_dim, q_heads, kv_heads, device="cpu")
    sinks = _sinks(q_heads)
    draft_args = (case.q_slot, case.kv_len, case.sel_idx, case.sel_count, case.sel_end, case.scaling)
    expected = naive.sparse_draft_attention(case.q, case.k, case.v, *draft_args, sinks=sinks)
    k, v = (_layout(poisoned(c, sparse_readable(case)), True) for c in (case.k, case.v))
    torch.testing.assert_close(eager.sparse_draft_attention(case.q, k, v, *draft_args, sinks=sinks), expected,
                               atol=1e-5, rtol=1e-5)
    for window in (None, 7):
        expected = naive.dense_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling, window,
                                             sinks=sinks)
        k, v = (_layout(_stale(c, case, dense_readable(case, window)), True) for c in (case.k, case.v))
        got = eager.dense_attention(case.q, k, v, case.q_slot, case.kv_len, case.scaling, window, sinks=sinks)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    rows = torch.tensor([0, tokens - 1])
    args = (case.q[:, :, rows], case.k, case.q_slot[:, rows], case.kv_len, case.sel_end, case.scaling, "weights")
    torch.testing.assert_close(eager.row_scores(*args, sinks=sinks), naive.row_scores(*args, sinks=sinks))


def test_reference_sinks_are_gpt_oss_attention():
    """The reference's sinks follow transformers' own gpt-oss attention: the sink joins the softmax's denominator
    and adds nothing to the output. A sink far below every logit changes nothing; a high one scales the output."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    case = make_case([23, 23], [0, 0], 4, 16, 4, 2, device="cpu")
    sinks = _sinks(4)
    expected = naive.dense_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling,
                                         sinks=sinks)
    n = 23  # both rows hold 23 slots, the 4 queries are the last ones
    k, v = case.k[:, :n].transpose(1, 2), case.v[:, :n].transpose(1, 2)
    slots = torch.arange(n)
    mask = torch.where(slots[None, :] <= case.q_slot[0][:, None], 0.0, float("-inf"))[None, None]
    module = SimpleNamespace(num_key_value_groups=2, sinks=sinks, training=False)
    got, _ = eager_attention_forward(module, case.q, k, v, mask.expand(2, 1, 4, n), scaling=case.scaling,
                                     dropout=0.0, s_aux=sinks)
    torch.testing.assert_close(expected, got, atol=1e-5, rtol=1e-5)
    plain = naive.dense_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling)
    far_below = naive.dense_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling,
                                          sinks=torch.full((4,), -1e4))
    torch.testing.assert_close(far_below, plain)
    assert (expected.norm(dim=-1) < plain.norm(dim=-1) + 1e-6).all(), "a sink only takes weight away"
