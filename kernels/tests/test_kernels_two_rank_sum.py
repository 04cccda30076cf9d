"""The two-rank sum + RMSNorm (`two_rank_sum.py`) against its reference, on one process: looped back to itself (the
peer's buffer and flags being the rank's own: each row summed with itself, every flag raised and consumed), and with
the peer's push already made (its row in the receive buffer, this rank's flag raised). The real two-GPU exchange runs
in `benchmarks/all_reduce.py --norm` and the TP worker's generations."""

import pytest
import torch
from hf_vegas_kernels import naive
from kernel_cases import DEVICE, NAN, assert_fp32_close, import_kernels

kernels = import_kernels()


def _case(rows, width, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    partial = (3 * torch.randn(rows, width, generator=gen) + 1).to(DEVICE, dtype)
    peer_partial = (3 * torch.randn(rows, width, generator=gen) - 1).to(DEVICE, dtype)
    weight = (torch.rand(width, generator=gen) + 0.5).to(DEVICE, dtype)
    return partial, peer_partial, weight


def _buffers(rows, width, dtype, capacity):
    """NaN receive buffers of two halves (rows past `rows` must stay NaN: nothing reads or writes them) and zeroed
    flags with one spare flag past `capacity`."""
    return (torch.full((2, capacity, width), NAN, dtype=dtype, device=DEVICE),
            torch.zeros(capacity + 1, dtype=torch.int32, device=DEVICE))


def _assert_sums_equal(got, want):
    """One fp32 addition rounded once: the same bits. (Triton's CPU interpreter truncates fp32 to bf16 where a GPU
    rounds to nearest: there within one bf16 step.)"""
    if got.dtype == torch.bfloat16 and DEVICE == "cpu":
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(got, want)


def _check(got, want, dtype):
    _assert_sums_equal(got[0], want[0])
    if dtype == torch.float32:
        assert_fp32_close(got[1], want[1])
    else:
        torch.testing.assert_close(got[1].float(), want[1].float(), rtol=2 ** -6, atol=2 ** -6)


@pytest.mark.parametrize("rows,width", [(1, 64), (5, 100), (9, 37)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_looped_back_it_sums_each_row_with_itself_and_leaves_the_flags_zeroed(rows, width, dtype, poison):
    partial, _, weight = _case(rows, width, dtype, rows * width)
    outputs = {}
    for name, ops in (("kernel", kernels), ("reference", naive)):
        recv, pad = _buffers(rows, width, dtype, capacity=rows + 3)
        outputs[name] = ops.all_reduce_norm(partial, weight, 1e-6, recv[1], recv[1], pad, pad)
        assert torch.equal(recv[1, :rows], partial), name  # the push landed in the half it was given
        assert recv[0].isnan().all() and recv[1, rows:].isnan().all(), name  # and nowhere else
        assert int(pad.abs().sum()) == 0, name
    _check(outputs["kernel"], outputs["reference"], dtype)
    total = (partial.float() * 2).to(dtype)
    assert torch.equal(outputs["reference"][0], total)
    _check(outputs["reference"], (total, naive.rms_norm(total, weight, 1e-6)), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_the_peers_push_made_it_adds_the_peers_row_and_signals_back(dtype, poison):
    rows, width = 6, 48
    partial, peer_partial, weight = _case(rows, width, dtype, 3)
    outputs = {}
    for name, ops in (("kernel", kernels), ("reference", naive)):
        recv, pad = _buffers(rows, width, dtype, capacity=8)
        peer_recv, peer_pad = _buffers(rows, width, dtype, capacity=8)
        recv[0, :rows] = peer_partial  # the peer pushed its row and raised this rank's flags
        pad[:rows] = 1
        outputs[name] = ops.all_reduce_norm(partial, weight, 1e-5, peer_recv[0], recv[0], peer_pad, pad)
        assert torch.equal(peer_recv[0, :rows], partial), name
        assert peer_pad[:rows].tolist() == [1] * rows and int(peer_pad[rows:].abs().sum()) == 0, name
        assert int(pad.abs().sum()) == 0, name
    _check(outputs["kernel"], outputs["reference"], dtype)
    # Either rank's sum: the same bits whichever row is this rank's.
    _assert_sums_equal(outputs["kernel"][0], (peer_partial.float() + partial.float()).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_a_norm_weight_only_the_sum(dtype, poison):
    partial, _, _ = _case(4, 40, dtype, 5)
    for ops in (kernels, naive):
        recv, pad = _buffers(4, 40, dtype, capacity=4)
        total, normed = ops.all_reduce_norm(partial, None, 1e-6, recv[0], recv[0], pad, pad)
        _assert_sums_equal(total, (partial.float() * 2).to(dtype))
        assert normed.shape == (0, 40) and int(pad.abs().sum()) == 0


def test_the_reference_refuses_a_signal_the_peer_did_not_send():
    partial, _, weight = _case(2, 8, torch.float32, 0)
    recv, pad = _buffers(2, 8, torch.float32, capacity=2)
    peer_recv, peer_pad = _buffers(2, 8, torch.float32, capacity=2)
    with pytest.raises(RuntimeError, match="signal is missing"):
        naive.all_reduce_norm(partial, weight, 1e-6, peer_recv[0], recv[0], peer_pad, pad)


@pytest.mark.parametrize("bad,message", [
    ("weight", "weight must be a contiguous \\(16,\\) vector"), ("recv", "recv must be \\(>= 3, 16\\)"),
    ("pad", "pad must hold >= 3 int32 flags"),
])
def test_what_the_kernel_cannot_sum_is_refused(bad, message):
    partial, _, weight = _case(3, 16, torch.float32, 1)
    recv, pad = _buffers(3, 16, torch.float32, capacity=3)
    args = dict(weight=weight, recv=recv[0], pad=pad)
    args[bad] = {"weight": weight[:8], "recv": recv[0, :2], "pad": pad.to(torch.int64)}[bad]
    with pytest.raises(ValueError, match=message):
        kernels.all_reduce_norm(partial, args["weight"], 1e-6, recv[1], args["recv"], pad, args["pad"])


def test_by_name_compiled_it_sums_through_the_registered_buffers_themselves(poison):
    """`exchange_sum_norm` names its exchange: a compiled function (aot_eager, which clones any argument an op says
    it mutates) still sends into and waits on the registered buffers, not on copies."""
    from hf_vegas_kernels import exchanges

    partial, _, weight = _case(3, 32, torch.float32, 9)
    recv, pad = _buffers(3, 32, torch.float32, capacity=4)
    exchanges.register("test-looped-back", recv, recv, pad, pad)
    try:
        eager = kernels.exchange_sum_norm(partial, weight, 1e-6, "test-looped-back", 1)
        recv.fill_(NAN)

        def two_sums(x):
            total, normed = kernels.exchange_sum_norm(x, weight, 1e-6, "test-looped-back", 1)
            return kernels.exchange_sum_norm(normed, None, 0.0, "test-looped-back", 0)[0], total

        compiled = torch.compile(two_sums, backend="aot_eager", fullgraph=True)
        got_sum, got_total = compiled(partial)
        assert torch.equal(got_total, eager[0])
        assert torch.equal(recv[1, :3], partial) and torch.equal(recv[0, :3], eager[1]), "the registered halves"
        assert torch.equal(got_sum, eager[1] * 2) and int(pad.abs().sum()) == 0
    finally:
        exchanges.forget("test-looped-back")
    with pytest.raises(KeyError, match="no two-rank exchange is registered as 'test-looped-back'"):
        kernels.exchange_sum_norm(partial, weight, 1e-6, "test-looped-back", 0)


def test_an_exchange_needs_two_halves_alike_and_a_parity_of_0_or_1():
    from hf_vegas_kernels import exchanges

    recv, pad = _buffers(2, 8, torch.float32, capacity=2)
    with pytest.raises(ValueError, match="two halves"):
        exchanges.register("test-bad", recv[0], recv[0], pad, pad)
    exchanges.register("test-parity", recv, recv, pad, pad)
    try:
        with pytest.raises(ValueError, match="parity must be 0 or 1"):
            exchanges.halves("test-parity", 2)
    finally:
        exchanges.forget("test-parity")
