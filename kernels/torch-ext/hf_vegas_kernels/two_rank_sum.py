"""A two-rank all-reduce with the RMSNorm after it, in one launch: the sum of a row-parallel projection's partial
products over two tensor-parallel ranks, and that sum's norm (`hf_vegas.fused_layers` under TP, draft steps).

Under TP = 2 a fused draft layer sums two partial products per layer over the ranks and normalises each sum: with
`torch.ops.symm_mem.one_shot_all_reduce_copy_out` and a norm launch, two launches and two device-wide barriers per
sum (its barrier before the reads, and one after them before the buffer may be written again). Here each row's
program pushes its partial row into the peer's receive buffer (stores over NVLink, which do not wait for a reply as
loads from the peer's memory would), signals the peer's program of the same row, waits for the peer's signal, adds
the peer's row from its own memory and normalises it. One barrier per sum: the receive buffers alternate between
two halves (`parity`), so a rank writes a half again only two sums later, after the peer's signal in the sum
between has told it the peer finished reading that half (the peer's sums run in order on its stream).

The signals are flags on the peers' symmetric signal pads, one per row program: a program sets the peer's flag from
0 to 1 (waiting while a previous signal is unread) with release semantics at system scope, after its block's stores,
then clears its own flag from 1 to 0 with acquire semantics. Called in a loop back to itself (the peer's buffer and
pad being the rank's own) the op sums a row with itself: how the CPU tests run it under the interpreter.

Each rank adds `mine + theirs` in fp32 and rounds once, so both ranks hold the same bits (an fp32 sum of two terms
does not depend on their order), as NCCL's sum of two ranks gives. The norm is `norm.py`'s. Semantics:
`naive.all_reduce_norm` (one rank's partial and the peer's). A compiled step calls it by the exchange's name
(`ops.exchange_sum_norm`, `exchanges.py`).

The reuse argument leans on stream order: a rank's sum starts only after its previous sum's grid completed. Under
programmatic dependent launch that holds because every kernel of the chain waits for its predecessor
(`gdc_wait`) before anything it stores, and this one before its first load. Every program must be able to run: a
program waits only for the peer's program of its own row, so a GPU that ran its programs in another order than the
other's cannot deadlock as long as all rows' programs are eventually scheduled (at most a few hundred rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch


@triton.jit
def _all_reduce_norm(Partial, PeerRecv, Recv, PeerPad, Pad, W, Sum, Normed, K, eps,
                     stride_p, stride_r, stride_s, stride_n, NORM: tl.constexpr, BLOCK_K: tl.constexpr,
                     USE_GDC: tl.constexpr):
    if USE_GDC:  # programmatic dependent launch (`_launch.pdl`): the partial is the previous kernel's output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    k = tl.arange(0, BLOCK_K)
    ok = k < K
    mine = tl.load(Partial + row.to(tl.int64) * stride_p + k, mask=ok, other=0.0)
    tl.store(PeerRecv + row.to(tl.int64) * stride_r + k, mine, mask=ok)
    tl.debug_barrier()  # every thread's store issued before the release below
    while tl.atomic_cas(PeerPad + row, 0, 1, sem="release", scope="sys") != 0:
        pass
    while tl.atomic_cas(Pad + row, 1, 0, sem="acquire", scope="sys") != 1:
        pass
    tl.debug_barrier()
    # `.cg` (from L2, where the peer's stores land): the acquire above already orders this load; `.cg` only keeps L1
    # out of a line no other load of this kernel reads.
    theirs = tl.load(Recv + row.to(tl.int64) * stride_r + k, mask=ok, other=0.0, cache_modifier=".cg")
    total = (mine.to(tl.float32) + theirs.to(tl.float32)).to(Sum.dtype.element_ty)
    tl.store(Sum + row.to(tl.int64) * stride_s + k, total, mask=ok)
    if not NORM:
        return
    x = total.to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
    w = tl.load(W + k, mask=ok, other=0.0).to(tl.float32)
    tl.store(Normed + row.to(tl.int64) * stride_n + k, (x * scale * w).to(Normed.dtype.element_ty), mask=ok)


def all_reduce_norm(partial: torch.Tensor, weight: torch.Tensor | None, eps: float, peer_recv: torch.Tensor,
                    recv: torch.Tensor, peer_pad: torch.Tensor, pad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`(total, rms_norm(total, weight, eps))` with `total = partial + the peer's partial`, both `(rows, K)`; without
    a `weight` only the sum (the norm's place an empty `(0, K)` tensor).

    `peer_recv` / `recv`: this sum's half of the peer's receive buffer and of this rank's, `(>= rows, K)` in
    `partial`'s dtype (the peer's mapped into this process); `peer_pad` / `pad`: int32 signal flags, one per row, on
    the peer's pad and this rank's, 0 between sums. Every rank must call it with the same shapes at the same point
    of its stream, as any collective."""
    rows, width = partial.shape
    if weight is not None and (weight.shape != (width,) or weight.stride(-1) != 1):
        raise ValueError(f"all_reduce_norm: weight must be a contiguous ({width},) vector, got {tuple(weight.shape)}")
    for name, buf in (("peer_recv", peer_recv), ("recv", recv)):
        if buf.dim() != 2 or buf.shape[0] < rows or buf.shape[1] != width or buf.dtype != partial.dtype:
            raise ValueError(f"all_reduce_norm: {name} must be (>= {rows}, {width}) {partial.dtype}, got "
                             f"{tuple(buf.shape)} {buf.dtype}")
    if peer_recv.stride() != recv.stride() or recv.stride(1) != 1 or partial.stride(1) != 1:
        raise ValueError("all_reduce_norm: the partial and both receive buffers need contiguous rows, alike")
    for name, flags in (("peer_pad", peer_pad), ("pad", pad)):
        if flags.dtype != torch.int32 or flags.numel() < rows:
            raise ValueError(f"all_reduce_norm: {name} must hold >= {rows} int32 flags, got {flags.numel()} "
                             f"{flags.dtype}")
    total = _launch.empty(rows, width, dtype=partial.dtype, device=partial.device)
    normed = _launch.empty(rows if weight is not None else 0, width, dtype=partial.dtype, device=partial.device)
    if rows:
        _all_reduce_norm[(rows,)](
            partial, peer_recv, recv, peer_pad, pad, weight if weight is not None else partial, total, normed, width,
            float(eps), partial.stride(0), recv.stride(0), total.stride(0), max(normed.stride(0), 1),
            NORM=weight is not None, BLOCK_K=triton.next_power_of_2(width), USE_GDC=_launch.pdl(partial.device),
            num_warps=8, **_launch.pdl_launch(partial.device),
        )
    return total, normed
