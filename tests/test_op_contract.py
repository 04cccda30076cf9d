"""One contract per op: the naive ops (`hf_vegas_kernels.naive`), the CPU path (`ops.eager`) and the Triton kernels
(`hf_vegas_kernels`) take the same arguments and give the same results, so `hf_vegas.attention` runs whichever a
cache holds without branching on it. The kernels are `torch.library` custom ops whose fakes and declared mutations
`torch.library.opcheck` checks.

Caches are poisoned with NaN wherever an op must not read, and every buffer a kernel allocates starts as NaN.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from kernel_cases import DEVICE, dense_readable, import_kernels, make_case, poisoned, sparse_readable

from hf_vegas.ops import eager
from hf_vegas_kernels import naive

kernels = import_kernels()
from hf_vegas_kernels import _launch  # noqa: E402

OPS = ["dense_attention", "sparse_draft_attention", "verify_attention", "finalize_scores", "select_topk", "write_kv"]


@pytest.fixture(autouse=True)
def nan_scratch(monkeypatch):
    def empty(*shape, dtype, device):
        return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)

    monkeypatch.setattr(_launch, "empty", empty)


def _caches_for(ops, case, readable):
    """What `ops` gets: the reference the clean caches; the kernels NaN wherever they must not read; the CPU path
    NaN past the longest row (it reads `[0, max(kv_len))` and masks), large junk where it must mask."""
    if ops is naive:
        return case.k, case.v
    if ops is kernels:
        return poisoned(case.k, readable), poisoned(case.v, readable)
    read = torch.arange(case.k.shape[1], device=case.k.device)[None, :] < case.kv_len.max()
    out = []
    for cache in (case.k, case.v):
        cache = cache.clone()
        cache[read & ~readable] = 1e3
        cache[~read.expand_as(readable)] = float("nan")
        out.append(cache)
    return out


def _parameters(function) -> list[tuple[str, object]]:
    function = getattr(function, "_init_fn", function)  # a custom op: the Python function it was made from
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("name", OPS)
def test_every_implementation_has_one_signature(name):
    expected = _parameters(getattr(naive, name))
    assert _parameters(getattr(eager, name)) == expected
    assert _parameters(getattr(kernels, name)) == expected


@pytest.mark.parametrize("window", [None, 30])
@pytest.mark.parametrize("score,softcap,sinks", [("logits", None, False), ("weights", None, True),
                                                 ("logits", 9.0, False)])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [(64, 6, 2), (48, 4, 4)])
def test_verify_and_finalize_equal_row_scores_in_every_implementation(head_dim, q_heads, kv_heads, score, softcap,
                                                                      sinks, window):
    tokens = 5
    case = make_case([70, 131, 9], [tokens - 1] * 3, tokens, head_dim, q_heads, kv_heads, seed=q_heads)
    rows = torch.tensor([0, tokens - 1], device=DEVICE)
    sink = torch.randn(q_heads, device=DEVICE) if sinks else None
    cand_start = (case.sel_end - window + 1).clamp_min(0) if window else torch.zeros_like(case.sel_end)
    expected = naive.row_scores(case.q[:, :, rows], case.k, case.q_slot[:, rows], case.kv_len, case.sel_end,
                                    case.scaling, score, softcap, sinks=sink, window=window, cand_start=cand_start)
    expected_out = naive.dense_attention(case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling, window,
                                             softcap, sink)
    readable = dense_readable(case, window)
    for ops in (naive, eager, kernels):
        keys, values = _caches_for(ops, case, readable)
        out, emitted, lse = ops.verify_attention(case.q, keys, values, case.q_slot, case.kv_len, case.scaling, rows,
                                                 score, softcap, sink, window)
        torch.testing.assert_close(out, expected_out, atol=2e-5, rtol=2e-5)
        for mean_rows in (True, False):
            got = ops.finalize_scores(emitted, lse, rows, case.sel_end, q_heads, score == "weights", mean_rows,
                                      cand_start=cand_start, window=window, q_slot=case.q_slot)
            want = expected.mean(dim=1, keepdim=True) if mean_rows else expected
            assert torch.equal(torch.isfinite(got), torch.isfinite(want)), ops.__name__
            torch.testing.assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("ops_name", ["eager", "kernels"])
def test_select_topk_equals_the_reference_ties_and_budgets_per_layer(ops_name):
    ops = eager if ops_name == "eager" else kernels
    gen = torch.Generator().manual_seed(3)
    scores = (torch.randint(-3, 4, (4, 3, 300), generator=gen).float() * 0.5).to(DEVICE)  # heavy ties
    cand_end = torch.tensor([300, 211, 40], device=DEVICE)
    count = torch.tensor([[5, 60, 40], [1, 7, 3], [100, 200, 9], [0, 2, 1]], device=DEVICE)
    layers = torch.tensor([0, 2, 3], device=DEVICE)
    want = torch.full((4, 3, 210), -7, dtype=torch.long, device=DEVICE)
    got = want.clone()
    naive.select_topk(scores, count, cand_end, want, layers=layers)
    ops.select_topk(scores, count, cand_end, got, layers=layers)
    assert torch.equal(got, want)
    assert (want[1] == -7).all(), "a layer not asked for is left alone"
    assert (want[0, 0, 5:] == -7).all(), "entries past a row's budget are left alone"
    assert torch.equal(want[0, 2, :40], torch.arange(40, device=DEVICE)), "all candidates: every slot, ascending"


@pytest.mark.parametrize("op", ["dense_attention", "sparse_draft_attention", "verify_attention"])
def test_a_finished_row_reads_nothing_and_outputs_zeros(op):
    case = make_case([70, 131, 9], [3, 3, 3], 4, 64, 6, 2, seed=4)
    finished = case.kv_len.clone()
    finished[1] = 0
    readable = (sparse_readable(case) if op == "sparse_draft_attention" else dense_readable(case))
    readable[1] = False
    sparse = (case.sel_idx, case.sel_count, case.sel_end) if op == "sparse_draft_attention" else ()
    extra = (torch.tensor([0, 3], device=DEVICE), "weights") if op == "verify_attention" else ()
    for ops in (naive, eager, kernels):
        keys, values = _caches_for(ops, case, readable)
        out = getattr(ops, op)(case.q, keys, values, case.q_slot, finished, *sparse, case.scaling, *extra)
        out = out[0] if isinstance(out, tuple) else out
        assert not out.isnan().any(), ops.__name__
        assert (out[1] == 0).all(), ops.__name__
        full = getattr(naive, op)(case.q, case.k, case.v, case.q_slot, case.kv_len, *sparse, case.scaling, *extra)
        full = full[0] if isinstance(full, tuple) else full
        torch.testing.assert_close(out[[0, 2]], full[[0, 2]], atol=2e-5, rtol=2e-5)


def _opcheck_cases():
    case = make_case([70, 19], [3, 2], 4, 32, 4, 2, seed=7)
    rows = torch.tensor([0, 3], device=DEVICE)
    dense = (case.q, case.k, case.v, case.q_slot, case.kv_len, case.scaling)
    _, emitted, lse = kernels.verify_attention(*dense, rows, "weights")
    # The verification emits only the slots it reads (the rest of `emitted` is unspecified): rows that read them all.
    full = make_case([70, 70], [3, 3], 4, 32, 4, 2, slots=70, seed=8)
    verify = (full.q, full.k, full.v, full.q_slot, full.kv_len, full.scaling, rows, "logits")
    scores = torch.randn(2, case.k.shape[1], device=DEVICE)
    key = torch.randn(2, 2, 4, 32, device=DEVICE)
    return {
        "sparse_draft_attention": ((case.q, case.k, case.v, case.q_slot, case.kv_len, case.sel_idx, case.sel_count,
                                    case.sel_end, case.scaling), dict(list_len=40)),
        "dense_attention": (dense, dict(window=20)),
        "verify_attention": (verify, dict(softcap=None)),
        "finalize_scores": ((emitted, lse, rows, case.sel_end, 4, True, True,
                             torch.empty(2, 1, case.k.shape[1], device=DEVICE)), {}),
        "select_topk": ((scores, case.sel_count, case.sel_end, torch.zeros(2, 30, dtype=torch.long, device=DEVICE)),
                        {}),
        "write_kv": ((case.k.clone(), case.v.clone(), key, key.clone(), case.q_slot.contiguous()), {}),
        "rms_norm": ((torch.randn(5, 32, device=DEVICE), torch.randn(32, device=DEVICE), 1e-6), {}),
        "linear": ((torch.randn(5, 32, device=DEVICE), torch.randn(48, 32, device=DEVICE),
                    torch.randn(48, device=DEVICE)), {}),
        "linear_residual": ((torch.randn(5, 32, device=DEVICE), torch.randn(48, 32, device=DEVICE),
                             torch.randn(5, 48, device=DEVICE)), {}),
        "linear_residual_norm_into": ((torch.randn(5, 32, device=DEVICE), torch.randn(48, 32, device=DEVICE),
                                       torch.randn(5, 48, device=DEVICE), torch.randn(48, device=DEVICE),
                                       torch.empty(5, 48, device=DEVICE), torch.empty(5, 48, device=DEVICE),
                                       torch.empty(5, kernels.linear.norm_partials(5, 48, key), device=DEVICE)), {}),
        "gated_linear": ((torch.randn(5, 32, device=DEVICE), torch.randn(48, 32, device=DEVICE),
                          torch.randn(48, 32, device=DEVICE), "silu", torch.rand(5, 3, device=DEVICE), 1e-6), {}),
        "qkv_rope_write": ((torch.randn(2, 1, 40, device=DEVICE), torch.randn(128, 40, device=DEVICE),
                            torch.randn(64, 40, device=DEVICE), torch.randn(64, 40, device=DEVICE), None, None, None,
                            torch.rand(2, 1, 32, device=DEVICE), torch.rand(2, 1, 32, device=DEVICE),
                            case.k.clone(), case.v.clone(), case.q_slot[:, :1].contiguous(), 4, 2, 32),
                           dict(row_sumsq=torch.rand(2, 3, device=DEVICE), eps=1e-6,
                                q_norm=torch.rand(32, device=DEVICE), k_norm=torch.rand(32, device=DEVICE),
                                head_eps=1e-6)),
        "rope_write_kv": ((torch.randn(2, 1, 256, device=DEVICE), torch.rand(2, 1, 32, device=DEVICE),
                           torch.rand(2, 1, 32, device=DEVICE), case.k.clone(), case.v.clone(),
                           case.q_slot[:, :1].contiguous(), 4, 2, 32),
                          dict(q_norm=torch.rand(32, device=DEVICE), k_norm=torch.rand(32, device=DEVICE),
                               head_eps=1e-6)),
        "qkv_linear": ((torch.randn(5, 32, device=DEVICE), torch.randn(48, 32, device=DEVICE),
                        torch.randn(16, 32, device=DEVICE), torch.randn(16, 32, device=DEVICE), None, None, None,
                        torch.rand(5, 3, device=DEVICE), 1e-6), {}),
        # (hf_vegas' own op: a compiled forward's, or a fused layer chain's, rotary tables)
        "rotary_tables": ((torch.rand(2, 7, 32, device=DEVICE), torch.rand(2, 7, 32, device=DEVICE)), {}),
    }


@pytest.mark.parametrize("name", ["sparse_draft_attention", "dense_attention", "verify_attention", "finalize_scores",
                                  "select_topk", "write_kv", "rms_norm", "linear", "linear_residual",
                                  "linear_residual_norm_into", "gated_linear", "qkv_rope_write",
                                  "rope_write_kv", "qkv_linear", "rotary_tables"])
def test_custom_ops_have_true_fakes_and_declared_mutations(name):
    """Checks the schema (mutations declared are the mutations made), the fake against the real op, and tracing."""
    import hf_vegas.rotary_tables  # noqa: F401  (registers `rotary_tables`)

    op = getattr(torch.ops.hf_vegas, name).default
    args, kwargs = _opcheck_cases()[name]
    torch.library.opcheck(op, args, kwargs, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
