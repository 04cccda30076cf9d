"""Triton attention kernels == naive ops, on odd shapes, with NaN wherever they must not read or write.

On the CPU they run in Triton's interpreter (the root conftest.py sets TRITON_INTERPRET=1); the GPU variants at the end
repeat the comparison at real sizes in bf16/fp16.
"""

import dataclasses

import pytest
import torch

from hf_vegas_kernels import naive
from kernel_cases import DEVICE, dense_readable, import_kernels, make_case, poisoned, sparse_readable

kernels = import_kernels()
from hf_vegas_kernels import _launch  # noqa: E402
from hf_vegas_kernels import attention as attention_kernels  # noqa: E402
from hf_vegas_kernels import attention_splits  # noqa: E402
from hf_vegas_kernels.attention_splits import _num_splits  # noqa: E402

# (head_dim, query heads, KV heads): GQA groups 1, 3, 4 and 8.
HEADS = [(64, 2, 2), (128, 6, 2), (256, 8, 2), (64, 8, 1)]
LENGTHS = [70, 131, 9]  # not multiples of any block, ragged


@pytest.fixture(autouse=True)
def nan_scratch(monkeypatch):
    """Every buffer a kernel allocates starts as NaN (or -1 for integers), so an unwritten element fails."""
    def empty(*shape, dtype, device):
        return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)

    monkeypatch.setattr(_launch, "empty", empty)


@pytest.fixture
def interpreter_sms(monkeypatch):
    """The interpreter's 4 "SMs" on any device, so a test that counts splits or launches sees the same grid on a GPU
    (which has far more SMs, so far more splits) as on the CPU."""
    monkeypatch.setattr(_launch, "device_sm_count", lambda device: 4)


@pytest.fixture
def combine_launches(monkeypatch):
    """Counts launches of the split-combine kernel, to tell which path a call took (the paths compute the same)."""
    launches = []
    kernel = attention_splits._combine_splits

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(attention_splits, "_combine_splits", Counted())
    return launches


def _assert_close(actual, expected, dtype):
    assert not actual.isnan().any(), "kernel output has NaN: an element was not written or a poisoned slot was read"
    tol = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("tokens", [1, 4, 7])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", HEADS)
def test_sparse_draft_attention(head_dim, q_heads, kv_heads, tokens):
    tails = [tokens, tokens + 2, tokens]  # the tail: accepted tokens since the selection plus the drafts
    case = make_case(LENGTHS, tails, tokens, head_dim, q_heads, kv_heads, seed=head_dim + tokens)
    readable = sparse_readable(case)
    args = (case.q_slot, case.kv_len, case.sel_idx, case.sel_count, case.sel_end, case.scaling)
    got = kernels.sparse_draft_attention(case.q, poisoned(case.k, readable), poisoned(case.v, readable), *args)
    expected = naive.sparse_draft_attention(case.q, case.k, case.v, *args)
    _assert_close(got, expected, torch.float32)


@pytest.mark.parametrize("waves", [0, 8])
def test_a_row_of_length_zero_reads_nothing(monkeypatch, waves):
    """Finished rows get length 0 (the step plan's `attend_lengths`): no slot of theirs is read, selection included,
    and their output is zeros; the other rows are untouched."""
    monkeypatch.setitem(_launch.TUNING, "sparse", {**_launch.TUNING["sparse"], "waves": waves})
    case = make_case(LENGTHS, [1, 3, 1], 1, 64, 6, 2, seed=8)
    readable = sparse_readable(case)
    readable[1] = False  # row 1 has finished: all of its cache is poisoned
    kv_len = case.kv_len.clone()
    kv_len[1] = 0
    k, v = poisoned(case.k, readable), poisoned(case.v, readable)
    draft = kernels.sparse_draft_attention(case.q, k, v, case.q_slot, kv_len, case.sel_idx, case.sel_count,
                                           case.sel_end, case.scaling)
    dense = kernels.dense_attention(case.q, k, v, case.q_slot, kv_len, case.scaling)
    expected = naive.sparse_draft_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, case.sel_idx,
                                                case.sel_count, case.sel_end, case.scaling)
    for out in (draft, dense):
        assert torch.equal(out[1], torch.zeros_like(out[1]))
    _assert_close(draft[[0, 2]], expected[[0, 2]], torch.float32)


@pytest.mark.parametrize("list_len", [1, 10_000])
def test_split_hint_changes_balance_not_result(list_len):
    """A list-length hint far too small or too large must still cover every selected and tail slot."""
    case = make_case([200, 150], [3, 5], 1, 64, 4, 2, seed=3)
    args = (case.q_slot, case.kv_len, case.sel_idx, case.sel_count, case.sel_end, case.scaling)
    got = kernels.sparse_draft_attention(case.q, case.k, case.v, *args, list_len=list_len)
    _assert_close(got, naive.sparse_draft_attention(case.q, case.k, case.v, *args), torch.float32)


@pytest.mark.parametrize("waves", [0, 2])
def test_a_split_length_gives_long_lists_more_programs(monkeypatch, interpreter_sms, combine_launches, waves):
    """`split_len` (the budget boost's hint): a row whose list is several times the others' runs in several splits
    of at most that length; the result is the reference's, nothing unselected is read."""
    monkeypatch.setitem(_launch.TUNING, "sparse", {**_launch.TUNING["sparse"], "block_n": 16, "waves": waves,
                                                  "nearest": True})
    case = make_case([300, 90, 61], [3, 2, 3], 1, 64, 6, 2, seed=21, sparsity=0.5)  # lists of 151, 46, 32 entries
    # 10 blocks of 16; at most 4 blocks (64 >= 50 entries) per split: 3 splits, where one split would do without
    assert _num_splits(151, 6, 16, waves, case.q.device, True, split_len=50) == (3, 64)
    assert _num_splits(151, 6, 16, waves, case.q.device, True) == (1, 160)
    readable = sparse_readable(case)
    args = (case.q_slot, case.kv_len, case.sel_idx, case.sel_count, case.sel_end, case.scaling)
    got = kernels.sparse_draft_attention(case.q, poisoned(case.k, readable), poisoned(case.v, readable), *args,
                                         list_len=151, split_len=50)
    assert combine_launches, "several splits: their states were combined"
    _assert_close(got, naive.sparse_draft_attention(case.q, case.k, case.v, *args), torch.float32)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("balance", [True, False])
def test_balanced_drafts_spread_each_rows_own_list_over_the_splits(monkeypatch, interpreter_sms, combine_launches,
                                                                  balance, fused):
    """`balance` (the wide-head kind's default): each row's list is divided over the launch's splits by its own
    length, so a row far shorter than the hint (the most boosted list) keeps every split busy instead of filling the
    first; the split states show it, whether the combine launch or the last split merges them. Either way the result
    is the reference's."""
    monkeypatch.setitem(_launch.TUNING, "sparse", {**_launch.TUNING["sparse"], "block_n": 16, "waves": 0,
                                                  "fused_combine": fused, "fused_combine_max_splits": 8,
                                                  "balance": balance})
    states = []
    empty = _launch.empty

    def recorded(*shape, dtype, device):
        tensor = empty(*shape, dtype=dtype, device=device)
        if len(shape) == 1 and dtype == torch.float32:  # the split states: maxima, sums, outputs
            states.append(tensor)
        return tensor

    monkeypatch.setattr(_launch, "empty", recorded)
    case = make_case([300, 90, 61], [3, 2, 3], 1, 64, 6, 2, seed=21, sparsity=0.5)  # lists of 151, 46, 32 entries
    readable = sparse_readable(case)
    args = (case.q_slot, case.kv_len, case.sel_idx, case.sel_count, case.sel_end, case.scaling)
    got = kernels.sparse_draft_attention(case.q, poisoned(case.k, readable), poisoned(case.v, readable), *args,
                                         list_len=151, split_len=50)  # 3 splits of up to 64 entries (4 blocks)
    _assert_close(got, naive.sparse_draft_attention(case.q, case.k, case.v, *args), torch.float32)
    assert bool(combine_launches) != fused
    sums = states[1].view(3, 2, 3, 3)  # (row, KV head, split, query row): each split's softmax sum
    busy = (sums > 0).all(dim=-1)  # (row, KV head, split): the split read some slot
    assert busy[0].all(), "the longest list fills its three splits either way"
    if balance:
        assert busy[1].all(), "46 entries (3 blocks): a block in each split"
        assert busy[2, :, :2].all() and not busy[2, :, 2].any(), "32 entries (2 blocks): the third split is empty"
    else:
        assert busy[1:, :, 0].all() and not busy[1:, :, 1:].any(), "the short lists all in the first split"


@pytest.mark.parametrize("window", [40, 9])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", HEADS[:2])
def test_sparse_draft_attention_inside_a_window(head_dim, q_heads, kv_heads, tokens, window):
    """A sliding-window layer that drafts sparsely: selected slots the query's window has left (the selection was
    made a few positions back, or is arbitrary here) are masked, not attended."""
    case = make_case(LENGTHS, [tokens, tokens + 2, tokens], tokens, head_dim, q_heads, kv_heads, seed=window + tokens)
    readable = sparse_readable(case)  # the kernel reads the whole list; the window masks some of it
    args = (case.q_slot, case.kv_len, case.sel_idx, case.sel_count, case.sel_end, case.scaling)
    got = kernels.sparse_draft_attention(case.q, poisoned(case.k, readable), poisoned(case.v, readable), *args,
                                         window=window)
    expected = naive.sparse_draft_attention(case.q, case.k, case.v, *args, window=window)
    _assert_close(got, expected, torch.float32)
    assert not torch.allclose(expected, naive.sparse_draft_attention(case.q, case.k, case.v, *args)), \
        "the window must cut some selected slot for this test to mean much"


@pytest.mark.parametrize("window,softcap", [(None, None), (None, 7.0), (24, None), (5, 3.0)])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", HEADS[:2])
def test_dense_attention(head_dim, q_heads, kv_heads, tokens, window, softcap):
    case = make_case(LENGTHS, [tokens] * 3, tokens, head_dim, q_heads, kv_heads, seed=tokens)
    readable = dense_readable(case, window)
    args = (case.q_slot, case.kv_len, case.scaling, window, softcap)
    got = kernels.dense_attention(case.q, poisoned(case.k, readable), poisoned(case.v, readable), *args)
    _assert_close(got, naive.dense_attention(case.q, case.k, case.v, *args), torch.float32)


def _expected_scores(case, rows, score, softcap):
    return naive.row_scores(
        case.q[:, :, rows], case.k, case.q_slot[:, rows], case.kv_len, case.sel_end, case.scaling, score, softcap
    )


@pytest.mark.parametrize("score", ["logits", "weights"])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", HEADS)
def test_verify_attention_emits_collect_2_query_scores(head_dim, q_heads, kv_heads, tokens, score):
    # Verification: `tokens` rows, the first is the pending token's; candidates end right after it.
    case = make_case(LENGTHS, [tokens - 1] * 3, tokens, head_dim, q_heads, kv_heads, seed=tokens + q_heads)
    softcap = 9.0 if head_dim == 128 else None
    rows = torch.tensor(sorted({0, tokens - 1}), device=DEVICE)
    readable = dense_readable(case)
    out, emitted, lse = kernels.verify_attention(
        case.q, poisoned(case.k, readable), poisoned(case.v, readable), case.q_slot, case.kv_len, case.scaling,
        rows, score, softcap,
    )
    expected_out = naive.dense_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling,
                                             None, softcap)
    _assert_close(out, expected_out, torch.float32)
    expected = _expected_scores(case, rows, score, softcap)  # (B, R, S)
    candidate = torch.isfinite(expected)
    for mean_rows in (True, False):
        got = kernels.finalize_scores(emitted, lse, rows, case.sel_end, q_heads, score == "weights", mean_rows)
        want = expected.mean(dim=1, keepdim=True) if mean_rows else expected
        assert torch.equal(torch.isfinite(got), candidate[:, :1] if mean_rows else candidate)
        _assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)], torch.float32)


@pytest.mark.parametrize("score", ["logits", "weights"])
def test_half_precision_verification_emits_fp16_logits(score):
    """Half-precision queries emit fp16 logits (half the bytes of the verification's largest write), which rank the
    candidates as fp32 ones do to fp16's precision; a logit past fp16's range saturates instead of turning
    infinite. (The interpreter computes fp16 products correctly, unlike bf16 ones.)"""
    case = make_case(LENGTHS, [6] * 3, 7, 64, 6, 2, dtype=torch.float16, seed=11)
    f32 = dataclasses.replace(case, q=case.q.float(), k=case.k.float(), v=case.v.float())  # same rounded inputs
    rows = torch.tensor([0, 6], device=DEVICE)
    args = (case.k, case.v, case.q_slot, case.kv_len, case.scaling, rows, score)
    _, emitted, lse = kernels.verify_attention(case.q, *args)
    assert emitted.dtype == torch.float16
    got = kernels.finalize_scores(emitted, lse, rows, case.sel_end, 6, score == "weights", True)[:, 0]
    want = _expected_scores(f32, rows, score, None).mean(dim=1)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    tol = {"atol": 1e-4, "rtol": 1e-2} if score == "weights" else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(got[finite], want[finite], **tol)
    # Logits of ~1e5: saturated at fp16's largest finite value, never inf (which would rank every slot alike).
    _, loud, _ = kernels.verify_attention(case.q.sign() * 30000, *args)
    read = loud[..., :case.kv_len.min()]
    assert torch.isfinite(read).all() and read.abs().max() == torch.finfo(torch.float16).max


@pytest.mark.parametrize("score", ["logits", "weights"])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", HEADS[:2])
def test_verify_attention_inside_a_window_emits_the_window_candidates(head_dim, q_heads, kv_heads, score):
    """A windowed sparse layer's verification reads (and emits) from its forward's first visible slot; its
    candidates, the `window - 1` slots before `sel_end`, all lie there, and only they get finite scores."""
    tokens, window = 7, 30
    case = make_case(LENGTHS, [tokens - 1] * 3, tokens, head_dim, q_heads, kv_heads, seed=q_heads + 1)
    rows = torch.tensor([0, tokens - 1], device=DEVICE)
    readable = dense_readable(case, window)
    out, emitted, lse = kernels.verify_attention(
        case.q, poisoned(case.k, readable), poisoned(case.v, readable), case.q_slot, case.kv_len, case.scaling,
        rows, score, window=window,
    )
    _assert_close(out, naive.dense_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling,
                                                 window), torch.float32)
    cand_start = (case.sel_end - window + 1).clamp_min(0)
    expected = naive.row_scores(case.q[:, :, rows], case.k, case.q_slot[:, rows], case.kv_len, case.sel_end,
                                    case.scaling, score, window=window, cand_start=cand_start)
    for mean_rows in (True, False):
        got = kernels.finalize_scores(emitted, lse, rows, case.sel_end, q_heads, score == "weights", mean_rows,
                                      cand_start=cand_start, window=window, q_slot=case.q_slot)
        want = expected.mean(dim=1, keepdim=True) if mean_rows else expected
        assert torch.equal(torch.isfinite(got), torch.isfinite(want))
        _assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)], torch.float32)
    assert int(torch.isfinite(expected[0, 0]).sum()) == window - 1, "a long row has exactly window - 1 candidates"
    assert bool((expected[:, -1][torch.isfinite(expected[:, -1])] == 0).any()), "the last row's window left some"



def test_dense_decode_equals_verify_without_scores():
    """The dense decode path (gamma = 0) is the verification kernel with score emission off."""
    case = make_case(LENGTHS, [0, 0, 0], 1, 64, 6, 2, seed=5)
    dense = kernels.dense_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling)
    verify, _, _ = kernels.verify_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling,
                                            torch.tensor([0], device=DEVICE), "logits")
    assert torch.equal(dense, verify)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("tokens", [1, 7])
def test_whole_blocks_skip_the_mask_only_where_every_query_sees_them(monkeypatch, tokens, splits):
    """Dense and verification lists run the blocks that every query row sees whole without the visibility mask.
    Lengths put the end of what every query sees one before, at and one after a block's end (16-slot blocks here),
    in the first and, with three splits of 32 slots, in the middle split (whose share ends before the list does): a
    block taken whole one slot too far would let the first query row see the second's key, and the comparison with
    the naive op fails. Two rows have queries out of order, one with a gap, one with left-pad queries at slot 0: the
    boundary is the smallest query slot of the row, not its first one's."""
    for kind in ("dense", "verify"):
        monkeypatch.setitem(_launch.TUNING, kind, {**_launch.TUNING[kind], "block_n": 16, "waves": 0})
    if splits > 1:
        monkeypatch.setattr(attention_kernels, "_num_splits", lambda *args, **kwargs: (splits, 32))
    ends = [15, 16, 17, 47, 48, 49, 64]  # the smallest query slot + 1 of each plain row
    # (the unordered row's smallest query slot, 29, sits a block before its first query's, 35)
    lengths = [end + tokens - 1 for end in ends] + [29 + tokens, 40 + tokens]
    case = make_case(lengths, [tokens] * len(lengths), tokens, 64, 6, 2, seed=11)
    if tokens > 1:
        q_slot = case.q_slot.clone()
        q_slot[-2] = q_slot[-2].flip(0) - torch.arange(tokens, device=DEVICE) % 2  # unordered, gaps, first is last
        q_slot[-1, :2] = 0  # left-pad queries (`StepPlan.lay_out` clamps them to slot 0)
        case = dataclasses.replace(case, q_slot=q_slot)
    readable = dense_readable(case)
    k, v = poisoned(case.k, readable), poisoned(case.v, readable)
    args = (case.q_slot, case.kv_len, case.scaling)
    expected = naive.dense_attention(case.q, case.k, case.v, *args)
    _assert_close(kernels.dense_attention(case.q, k, v, *args), expected, torch.float32)
    rows = torch.tensor([0, tokens - 1], device=DEVICE).unique()
    out, emitted, lse = kernels.verify_attention(case.q, k, v, *args, rows, "weights")
    _assert_close(out, expected, torch.float32)
    # The softmax weights are rebuilt from the log-sum-exp, which the kernel keeps in base 2 until it stores it.
    # (Rows whose scored queries sit before their candidates' end break finalize_scores' precondition: left out.)
    plain = len(ends)
    got = kernels.finalize_scores(emitted, lse, rows, case.sel_end, 6, True, False)[:plain]
    want = _expected_scores(case, rows, "weights", None)[:plain]
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    _assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)], torch.float32)


@pytest.mark.parametrize("tokens", [1, 7])
def test_a_dense_list_from_a_start_slot_takes_whole_blocks_from_there(monkeypatch, tokens):
    """`attend` with a `tail_start` and no window (a list `[tail_start, kv_len)`): whole blocks count from the start,
    so the smallest query slot's block end is `q_min + 1 - tail_start` positions into the list."""
    monkeypatch.setitem(_launch.TUNING, "verify" if tokens > 1 else "dense",
                        {**_launch.TUNING["verify" if tokens > 1 else "dense"], "block_n": 16, "waves": 0})
    case = make_case([40 + tokens, 45 + tokens, 50 + tokens, 33 + tokens], [tokens] * 4, tokens, 64, 6, 2, seed=13)
    # q_min + 1 - start = 31, 32, 33 and 34 list positions: one before a block's end, at it, one and two past it
    start = torch.tensor([10, 14, 18, 0], device=DEVICE)
    slots = torch.arange(case.k.shape[1], device=DEVICE)
    readable = (slots[None, :] >= start[:, None]) & (slots[None, :] < case.kv_len[:, None])
    out, _, _ = attention_kernels.attend(case.q, poisoned(case.k, readable), poisoned(case.v, readable), case.q_slot,
                                         case.kv_len, case.scaling, tail_start=start, list_len=case.k.shape[1])
    visible = naive.visible_slots(case.q_slot, case.kv_len, case.k.shape[1], None) & readable[:, None, :]
    _assert_close(out, naive.masked_attention(case.q, case.k, case.v, visible, case.scaling), torch.float32)


@pytest.mark.parametrize("tokens", [1, 7])
def test_unmasked_blocks_round_as_masked_ones(tokens):
    """A block that every query sees whole computes the same bits in the unmasked phase as in the masked one, so
    where a program's boundary falls (it depends on all its query rows) changes no row's result: the dense step of
    one query and the verification of seven then round alike. Compared here against the same launch with a window
    longer than the rows (every block masked, the same list and splits). On a GPU in bf16 at SmolLM2's heads."""
    cuda = DEVICE == "cuda"
    lengths = [7500, 3001, 77, 8191] if cuda else LENGTHS
    case = make_case(lengths, [tokens] * len(lengths), tokens, 64, 9 if cuda else 6, 3 if cuda else 2, seed=17,
                     dtype=torch.bfloat16 if cuda else torch.float32)
    list_len, window = case.k.shape[1], case.k.shape[1] + 1
    args = (case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling)
    whole = kernels.dense_attention(*args, None, list_len=list_len)
    masked = kernels.dense_attention(*args, window, list_len=list_len)
    assert torch.equal(whole, masked)
    rows = torch.tensor([0, tokens - 1], device=DEVICE).unique()
    out, _, lse = kernels.verify_attention(*args, rows, "weights", list_len=list_len)
    out_masked, _, lse_masked = kernels.verify_attention(*args, rows, "weights", window=window, list_len=list_len)
    assert torch.equal(out, out_masked) and torch.equal(lse, lse_masked)


@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [HEADS[0], HEADS[1]])
def test_sparse_drafts_with_wide_heads_take_their_own_launch_setting(monkeypatch, combine_launches, head_dim, q_heads,
                                                                     kv_heads):
    """head_dim >= 128 reads `_launch.TUNING["sparse_wide_head"]`, narrower heads `["sparse"]`: many splits (a combine
    launch) come only from the setting of the head's own kind."""
    case = make_case(LENGTHS, [2] * 3, 1, head_dim, q_heads, kv_heads, seed=5)
    args = (case.q_slot, case.kv_len, case.sel_idx, case.sel_count, case.sel_end, case.scaling)
    own, other = ("sparse_wide_head", "sparse") if head_dim >= 128 else ("sparse", "sparse_wide_head")
    one_split, many = {"waves": 0}, {"waves": 8, "block_n": 16, "fused_combine": False}
    for split_kind, expected in ((other, 0), (own, 1)):
        for kind in (own, other):
            monkeypatch.setitem(_launch.TUNING, kind, {**_launch.TUNING[kind], **(many if kind == split_kind else
                                                                                   one_split)})
        combine_launches.clear()
        got = kernels.sparse_draft_attention(case.q, case.k, case.v, *args)
        assert len(combine_launches) == expected, f"{split_kind} split, head_dim {head_dim}"
        _assert_close(got, naive.sparse_draft_attention(case.q, case.k, case.v, *args), torch.float32)


@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("rows,head_dim", [(4, 128), (3, 128), (4, 64)])
def test_dense_and_verify_over_many_wide_head_pairs_take_their_own_launch_setting(monkeypatch, combine_launches,
                                                                                  tokens, rows, head_dim):
    """head_dim >= 128 over at least 32 (row, KV head) pairs (4 rows x 8 KV heads) reads `_launch.TUNING`'s
    "dense_wide_head" (one query token) or "verify_wide_head"; 3 rows, or narrower heads, the plain kinds. The kind
    whose setting splits without merging in the kernel is the one that launches the combine."""
    case = make_case([40, 9, 33, 17][:rows], [tokens + 1] * rows, tokens, head_dim, 16, 8, seed=3)
    dense_ok = dense_readable(case)
    plain = "dense" if tokens == 1 else "verify"
    own = plain + "_wide_head" if head_dim >= 128 and rows * 8 >= 32 else plain
    for split_kind in (plain, plain + "_wide_head"):
        for kind in (plain, plain + "_wide_head"):
            monkeypatch.setitem(_launch.TUNING, kind, {"block_n": 16, "num_warps": 4, "num_stages": 1, "waves": 8,
                                                       "fused_combine": kind != split_kind})
        combine_launches.clear()
        got = kernels.dense_attention(case.q, poisoned(case.k, dense_ok), poisoned(case.v, dense_ok), case.q_slot,
                                      case.kv_len, case.scaling)
        assert len(combine_launches) == (split_kind == own), f"{split_kind} split, {own} expected"
        _assert_close(got, naive.dense_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling),
                      torch.float32)


@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [HEADS[1], HEADS[3]])
@pytest.mark.parametrize("tokens", [1, 7])
def test_one_split_writes_what_the_combine_would(monkeypatch, combine_launches, head_dim, q_heads, kv_heads, tokens):
    """A sparse draft of one split per (row, KV head) writes output and log-sum-exp itself, without the combine
    launch: the same output as the reference, the same log-sum-exp as the split path."""
    from hf_vegas_kernels.attention import attend

    case = make_case(LENGTHS, [tokens + 1] * 3, tokens, head_dim, q_heads, kv_heads, seed=11)
    readable = sparse_readable(case)
    k, v = poisoned(case.k, readable), poisoned(case.v, readable)

    def run():
        return attend(case.q, k, v, case.q_slot, case.kv_len, case.scaling, tail_start=case.sel_end,
                      list_len=case.sel_idx.shape[1] + tokens + 1, sel_idx=case.sel_idx, sel_count=case.sel_count)

    from hf_vegas_kernels.attention_splits import _num_splits

    def tune(**setting):  # head_dim 128 drafts take the wide-head setting, the others "sparse"
        for kind in ("sparse", "sparse_wide_head"):
            monkeypatch.setitem(_launch.TUNING, kind, {**_launch.TUNING[kind], **setting})

    with pytest.raises(ValueError, match="a sparse list needs tail_start"):  # (None reads from slot 0: dense only)
        attend(case.q, k, v, case.q_slot, case.kv_len, case.scaling, tail_start=None, list_len=8,
               sel_idx=case.sel_idx, sel_count=case.sel_count)
    tune(waves=8, block_n=16, fused_combine=False)
    assert _num_splits(case.sel_idx.shape[1], 3 * kv_heads, 16, 8, torch.device(DEVICE))[0] > 1
    split_out, split_lse, _ = run()
    assert len(combine_launches) == 1, "several splits: the combine launch merged them"
    tune(waves=0)
    out, lse, _ = run()
    assert len(combine_launches) == 1, "one split: no combine launch"
    expected = naive.sparse_draft_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, case.sel_idx,
                                                case.sel_count, case.sel_end, case.scaling)
    _assert_close(out, expected, torch.float32)
    _assert_close(split_out, expected, torch.float32)
    _assert_close(lse, split_lse, torch.float32)


@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [HEADS[1], HEADS[3]])
@pytest.mark.parametrize("tokens", [1, 7])
def test_the_last_split_merges_in_the_kernel(monkeypatch, interpreter_sms, combine_launches, head_dim, q_heads,
                                            kv_heads, tokens):
    """`fused_combine`: the last split of each (row, KV head) merges the others' states in the kernel. Every kind
    against the reference, the log-sum-exp equal to the combine launch's, and the tickets zero again after each launch
    (a second round reuses them). Six waves of the interpreter's 4 "SMs" give 4 to 8 splits of these lists: all
    merged in the kernel (no combine launch), which one more than `FUSED_COMBINE_MAX_SPLITS` would hand back."""
    case = make_case(LENGTHS, [tokens + 1] * 3, tokens, head_dim, q_heads, kv_heads, seed=17)
    sparse_ok, dense_ok = sparse_readable(case), dense_readable(case)
    rows = torch.tensor(sorted({0, tokens - 1}), device=DEVICE)
    args = (case.q_slot, case.kv_len, case.sel_idx, case.sel_count, case.sel_end, case.scaling)

    def run(fused):
        for kind in ("sparse", "sparse_wide_head", "dense", "verify"):  # (no kind's own split limit: the module's)
            own = {k: v for k, v in _launch.TUNING[kind].items() if k != "fused_combine_max_splits"}
            monkeypatch.setitem(_launch.TUNING, kind, {**own, "waves": 6, "block_n": 16, "fused_combine": fused})
        draft = kernels.sparse_draft_attention(case.q, poisoned(case.k, sparse_ok), poisoned(case.v, sparse_ok),
                                               *args)
        dense = kernels.dense_attention(case.q, poisoned(case.k, dense_ok), poisoned(case.v, dense_ok),
                                        case.q_slot, case.kv_len, case.scaling)
        verify = kernels.verify_attention(case.q, poisoned(case.k, dense_ok), poisoned(case.v, dense_ok),
                                          case.q_slot, case.kv_len, case.scaling, rows, "weights")
        return draft, dense, verify

    launched = run(fused=False)
    assert len(combine_launches) >= 2, "without fused_combine the dense and verify splits merge in a combine launch"
    for _ in range(2):
        combine_launches.clear()
        draft, dense, (out, emitted, lse) = run(fused=True)
        assert not combine_launches, "with fused_combine and at most 8 splits no kind launches the combine"
        assert not _launch.tickets(1, case.q.device).any(), "the kernel must leave its tickets at zero"
        _assert_close(draft, naive.sparse_draft_attention(case.q, case.k, case.v, *args), torch.float32)
        expected = naive.dense_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling)
        _assert_close(dense, expected, torch.float32)
        _assert_close(out, expected, torch.float32)
        _assert_close(lse, launched[2][2], torch.float32)
        got = kernels.finalize_scores(emitted, lse, rows, case.sel_end, q_heads, True, mean_rows=False)
        want = _expected_scores(case, rows, "weights", None)
        assert torch.equal(torch.isfinite(got), torch.isfinite(want))
        _assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)], torch.float32)
    monkeypatch.setattr(_launch, "FUSED_COMBINE_MAX_SPLITS", 2)
    combine_launches.clear()
    dense = kernels.dense_attention(case.q, poisoned(case.k, dense_ok), poisoned(case.v, dense_ok), case.q_slot,
                                    case.kv_len, case.scaling)
    assert len(combine_launches) == 1, "past FUSED_COMBINE_MAX_SPLITS the combine launch merges"
    _assert_close(dense, launched[1], torch.float32)
    monkeypatch.setattr(_launch, "FUSED_COMBINE_MAX_SPLITS", 8)
    for kind in ("dense", "verify"):  # (a forward of several tokens runs the verify kind)
        monkeypatch.setitem(_launch.TUNING, kind, {**_launch.TUNING[kind], "fused_combine_max_splits": 2})
    combine_launches.clear()
    dense = kernels.dense_attention(case.q, poisoned(case.k, dense_ok), poisoned(case.v, dense_ok), case.q_slot,
                                    case.kv_len, case.scaling)
    assert len(combine_launches) == 1, "past a kind's own fused_combine_max_splits the combine launch merges"
    _assert_close(dense, launched[1], torch.float32)


def test_a_larger_ticket_buffer_keeps_the_replaced_one_alive(monkeypatch):
    """A captured graph keeps the address of the ticket buffer current at its capture: growing the buffer must not
    free the old one (its memory would be handed to other tensors and the graph's counters would corrupt them)."""
    monkeypatch.setattr(_launch, "_TICKETS", {})
    monkeypatch.setattr(_launch, "_RETIRED", [])
    first = _launch.tickets(1, torch.device("cpu"))
    assert _launch.tickets(first.numel(), torch.device("cpu")) is first
    grown = _launch.tickets(first.numel() + 1, torch.device("cpu"))
    assert grown.numel() >= 2 * first.numel() and not grown.any()
    assert any(t is first for t in _launch._RETIRED)
    assert _launch.tickets(2, torch.device("cpu")) is grown


# one split writing its result, splits and the combine launch, splits merged by the last one in the kernel
@pytest.mark.parametrize("waves,fused", [(0, False), (6, False), (6, True)])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [HEADS[1], HEADS[3]])
def test_sinks_in_every_kernel(monkeypatch, interpreter_sms, combine_launches, head_dim, q_heads, kv_heads, waves,
                               fused):
    """gpt-oss' per-head sink logits: draft, dense (also windowed) and verify kernels against the reference, and the
    verification's softmax-weight scores against the reference's weights with the sinks in their denominators."""
    sinks = torch.linspace(-2.0, 3.0, q_heads, device=DEVICE)
    for kind in ("sparse", "sparse_wide_head", "dense", "verify"):
        own = {k: v for k, v in _launch.TUNING[kind].items() if k != "fused_combine_max_splits"}  # (the module's)
        monkeypatch.setitem(_launch.TUNING, kind, {**own, "waves": waves, "block_n": 16, "fused_combine": fused})
    tokens = 4
    case = make_case(LENGTHS, [tokens + 1] * 3, tokens, head_dim, q_heads, kv_heads, seed=13)
    readable = sparse_readable(case)
    args = (case.q_slot, case.kv_len, case.sel_idx, case.sel_count, case.sel_end, case.scaling)
    got = kernels.sparse_draft_attention(case.q, poisoned(case.k, readable), poisoned(case.v, readable), *args,
                                         sinks=sinks)
    _assert_close(got, naive.sparse_draft_attention(case.q, case.k, case.v, *args, sinks=sinks), torch.float32)
    for window in (None, 5):
        readable = dense_readable(case, window)
        dense_args = (case.q_slot, case.kv_len, case.scaling, window)
        got = kernels.dense_attention(case.q, poisoned(case.k, readable), poisoned(case.v, readable), *dense_args,
                                      sinks=sinks)
        expected = naive.dense_attention(case.q, case.k, case.v, *dense_args, sinks=sinks)
        _assert_close(got, expected, torch.float32)
    rows = torch.tensor([0, tokens - 1], device=DEVICE)
    readable = dense_readable(case)
    out, emitted, lse = kernels.verify_attention(
        case.q, poisoned(case.k, readable), poisoned(case.v, readable), case.q_slot, case.kv_len, case.scaling,
        rows, "weights", sinks=sinks,
    )
    _assert_close(out, naive.dense_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling,
                                                 sinks=sinks), torch.float32)
    expected = naive.row_scores(case.q[:, :, rows], case.k, case.q_slot[:, rows], case.kv_len, case.sel_end,
                                    case.scaling, "weights", sinks=sinks)
    got = kernels.finalize_scores(emitted, lse, rows, case.sel_end, q_heads, True, mean_rows=False)
    assert torch.equal(torch.isfinite(got), torch.isfinite(expected))
    _assert_close(got[torch.isfinite(got)], expected[torch.isfinite(expected)], torch.float32)
    # waves 0 combines the dense and verify kernels' single split in a launch (only a sparse draft writes it itself)
    assert (len(combine_launches) == 0) == fused, "the splits merged where this case asked for"
    with pytest.raises(ValueError, match="one logit per query head"):
        kernels.dense_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling, sinks=sinks[:1])


# Latent attention (DeepSeek-V2/V3, MiniCPM3): keys of a no-RoPE part plus a RoPE part, values of another width.
MLA_HEADS = [(96, 64, 4, 4), (192, 128, 2, 2), (40, 24, 3, 1)]  # (key dim, value dim, query heads, KV heads)


@pytest.mark.parametrize("head_dim,v_dim,q_heads,kv_heads", MLA_HEADS)
def test_value_head_dim_other_than_the_keys(head_dim, v_dim, q_heads, kv_heads):
    """Every kernel with values narrower than the keys: outputs of the values' width, equal to the reference's."""
    tokens = 3
    case = make_case(LENGTHS, [tokens + 1] * 3, tokens, head_dim, q_heads, kv_heads, seed=17, v_dim=v_dim)
    readable = sparse_readable(case)
    args = (case.q_slot, case.kv_len, case.sel_idx, case.sel_count, case.sel_end, case.scaling)
    got = kernels.sparse_draft_attention(case.q, poisoned(case.k, readable), poisoned(case.v, readable), *args)
    assert got.shape[-1] == v_dim
    _assert_close(got, naive.sparse_draft_attention(case.q, case.k, case.v, *args), torch.float32)
    readable = dense_readable(case)
    k, v = poisoned(case.k, readable), poisoned(case.v, readable)
    dense_args = (case.q_slot, case.kv_len, case.scaling)
    expected = naive.dense_attention(case.q, case.k, case.v, *dense_args)
    _assert_close(kernels.dense_attention(case.q, k, v, *dense_args), expected, torch.float32)
    rows = torch.tensor([0, tokens - 1], device=DEVICE)
    out, emitted, lse = kernels.verify_attention(case.q, k, v, *dense_args, rows, "weights")
    _assert_close(out, expected, torch.float32)
    want = naive.row_scores(case.q[:, :, rows], case.k, case.q_slot[:, rows], case.kv_len, case.sel_end,
                                case.scaling, "weights")
    got = kernels.finalize_scores(emitted, lse, rows, case.sel_end, q_heads, True, mean_rows=False)
    _assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)], torch.float32)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU versions above cover it")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("score,softcap", [("weights", None), ("logits", None), ("logits", 30.0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [(64, 9, 3), (128, 32, 8), (256, 8, 1)])
def test_kernels_at_real_sizes_on_gpu(head_dim, q_heads, kv_heads, dtype, score, softcap):
    lengths, tokens = [8191, 3000, 20_001, 77], 7
    case = make_case(lengths, [tokens - 1] * 4, tokens, head_dim, q_heads, kv_heads, dtype=dtype, device="cuda",
                     sparsity=0.07)
    f32 = dataclasses.replace(case, q=case.q.float(), k=case.k.float(), v=case.v.float())  # same rounded inputs
    draft_args = (case.q_slot, case.kv_len, case.sel_idx, case.sel_count, case.sel_end, case.scaling)
    readable = sparse_readable(case)
    got = kernels.sparse_draft_attention(case.q, poisoned(case.k, readable), poisoned(case.v, readable),
                                         *draft_args, softcap)
    _assert_close(got, naive.sparse_draft_attention(f32.q, f32.k, f32.v, *draft_args, softcap), dtype)
    rows = torch.tensor([0, tokens - 1], device="cuda")
    out, emitted, lse = kernels.verify_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling,
                                                 rows, score, softcap)
    expected_out = naive.dense_attention(f32.q, f32.k, f32.v, f32.q_slot, f32.kv_len, f32.scaling, None, softcap)
    _assert_close(out, expected_out, dtype)
    got = kernels.finalize_scores(emitted, lse, rows, case.sel_end, q_heads, score == "weights", True)[:, 0]
    want = _expected_scores(f32, rows, score, softcap).mean(dim=1)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    # Weights are compared in absolute terms (most are ~0); group-summed logits carry one more half rounding.
    tol = {"atol": 1e-4, "rtol": 5e-2} if score == "weights" else {"atol": 5e-2, "rtol": 2e-2}
    torch.testing.assert_close(got[finite], want[finite], **tol)


def _attend_compact(case, b, slots):
    """Reference attention of row `b`'s query over exactly `slots`, from a small copy of just those slots."""
    index = torch.as_tensor(sorted(slots), device=case.k.device)
    k, v = case.k[b : b + 1, index].float(), case.v[b : b + 1, index].float()
    n = torch.tensor([index.numel()], device=index.device)
    return naive.dense_attention(case.q[b : b + 1].float(), k, v, n[:, None] - 1, n, case.scaling)


def test_offsets_inside_a_row_are_int32_only_where_they_fit():
    """The kernels index a row's keys and values with int32 offsets only where every offset inside a row fits; a row
    past 2**31 elements (`test_offsets_past_int32_on_gpu`) takes 64-bit ones."""
    fits = attention_kernels._row_offsets_fit_int32
    small = torch.empty(64, 8192, 3, 64, device="meta")
    huge = torch.empty(2, (1 << 31) // (8 * 128) + 4096, 8, 128, device="meta")
    assert fits(small, small) and not fits(huge, huge) and not fits(small, huge)


@pytest.mark.parametrize("tokens", [1, 7])
def test_64_bit_row_offsets_give_the_same_results(monkeypatch, tokens):
    """The 64-bit offsets that rows past 2**31 elements take (forced here at a small size): every kind as the
    reference, nothing unread touched."""
    monkeypatch.setattr(attention_kernels, "_row_offsets_fit_int32", lambda k_cache, v_cache: False)
    case = make_case(LENGTHS, [tokens, tokens + 2, tokens], tokens, 64, 6, 2, seed=40 + tokens)
    args = (case.q_slot, case.kv_len, case.sel_idx, case.sel_count, case.sel_end, case.scaling)
    readable = sparse_readable(case)
    got = kernels.sparse_draft_attention(case.q, poisoned(case.k, readable), poisoned(case.v, readable), *args)
    _assert_close(got, naive.sparse_draft_attention(case.q, case.k, case.v, *args), torch.float32)
    dense_args = (case.q_slot, case.kv_len, case.scaling)
    readable = dense_readable(case)
    got = kernels.dense_attention(case.q, poisoned(case.k, readable), poisoned(case.v, readable), *dense_args)
    _assert_close(got, naive.dense_attention(case.q, case.k, case.v, *dense_args), torch.float32)


@gpu
@pytest.mark.gpu
def test_offsets_past_int32_on_gpu():
    """Row 1 of a 4.5 GB key buffer starts past 2**31 elements: offsets must be computed in 64 bits."""
    slots, kv_heads, head_dim, window = (1 << 31) // (8 * 128) + 4096, 8, 128, 256
    case = make_case([slots - 9, slots - 100], [3, 3], 1, head_dim, 32, kv_heads, slots=slots, dtype=torch.bfloat16,
                     device="cuda", sparsity=0.001)
    assert case.k.stride(0) >= 2**31
    draft_args = (case.q_slot, case.kv_len, case.sel_idx, case.sel_count, case.sel_end, case.scaling)
    draft = kernels.sparse_draft_attention(case.q, case.k, case.v, *draft_args)
    windowed = kernels.dense_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling, window)
    for b in range(2):
        length, end = int(case.kv_len[b]), int(case.sel_end[b])
        chosen = set(case.sel_idx[b, : case.sel_count[b]].tolist()) | set(range(end, length))
        _assert_close(draft[b : b + 1], _attend_compact(case, b, chosen), torch.bfloat16)
        recent = range(length - window, length)
        _assert_close(windowed[b : b + 1], _attend_compact(case, b, recent), torch.bfloat16)
    # A dense list without a window reads its whole blocks unmasked (64-bit offsets there too): as the masked reads.
    args = (case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling)
    whole = kernels.dense_attention(*args, None, list_len=slots)
    assert torch.equal(whole, kernels.dense_attention(*args, slots + 1, list_len=slots))


def test_split_counts_round_to_the_nearest_where_asked():
    """Sparse drafts round the wanted split count to the nearest (one split at 192 (row, KV head) pairs on 132 SMs at
    2 waves, where rounding up would take two), bounded by the list's blocks."""
    from hf_vegas_kernels.attention_splits import _num_splits

    device = torch.device("cpu")
    sms = _launch.device_sm_count(device)
    pairs = round(sms * 2 / 1.375)  # 1.375 splits wanted
    assert _num_splits(580, pairs, 128, 2, device, nearest=True) == (1, 640)
    assert _num_splits(580, pairs, 128, 2, device)[0] == 2
    assert _num_splits(580, 1, 128, 2, device, nearest=True) == (5, 128), "at most one split per block"
    assert _num_splits(580, pairs, 128, 0, device) == (1, 640)


def test_split_counts_round_up_to_the_nearest_or_fill_whole_waves():
    """`waves` 2 on 132 SMs over 128 (row, KV head) pairs wants 2.06 splits: 3 rounded up, 2 to the nearest; over 96
    pairs 2.75: 3 and 3. Filling whole waves of 264 programs at least 90 % (`fill`): 2 splits over 128 pairs (256
    programs), 8 over 32, 4 over 64; over 96 pairs 2 (192 of 264), 3 (288 of 528) and 4 (384 of 528) fill less, 5
    (480 of 528) enough; over 264 pairs one. A count the chunking cannot make is skipped (a 513-block list: 31
    splits, not 32), and never more splits than the list has blocks."""
    from hf_vegas_kernels.attention_splits import _wave_filling_splits

    cuda = torch.device("cuda", 0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_launch, "device_sm_count", lambda device: 132)
        for pairs, up, nearest, filled in ((128, 3, 2, 2), (96, 3, 3, 5), (32, 9, 8, 8), (64, 5, 4, 4),
                                           (264, 1, 1, 1)):
            assert _num_splits(32768, pairs, 64, 2, cuda)[0] == up
            assert _num_splits(32768, pairs, 64, 2, cuda, nearest=True)[0] == nearest
            assert _num_splits(32768, pairs, 64, 2, cuda, fill=0.9)[0] == filled, pairs
        assert _num_splits(100, 32, 64, 2, cuda, fill=0.9)[0] == 2  # two blocks of 64: the fullest it can make
    assert _wave_filling_splits(513, 33, 264, 0.9) == 8 and _wave_filling_splits(513, 8, 264, 0.9) == 31
    # 32 splits of 8 pairs would fill 256 of 264 slots (97 %), but 513 blocks make 31 or 33 splits, not 32
    assert _wave_filling_splits(513, 8, 264, 0.95) == 33


def test_wide_head_kinds_pass_their_wave_fill_on(monkeypatch):
    """`attend` hands a kind's `fill` to the split count (the default dense and verify settings at head_dim 128 over
    32 pairs take it; the plain kinds none)."""
    seen = []
    real = attention_kernels._num_splits

    def spy(*args, **kwargs):
        seen.append(args[-1])  # (fill is the last positional argument)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_kernels, "_num_splits", spy)
    for rows in (4, 3):
        case = make_case([40, 9, 33, 17][:rows], [2] * rows, 1, 128, 16, 8, seed=3)
        kernels.dense_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling)
    assert seen == [_launch.TUNING["dense_wide_head"]["fill"], 0.0] and seen[0] > 0
