"""Receive buffers and signal flags of two-rank sums (`two_rank_sum.py`), registered by name.

The op a compiled step traces (`ops.exchange_sum_norm`) names its exchange by a string, as a collective names its
process group, so the compiler never sees these tensors: it could otherwise functionalise the op's writes into
them, and a functionalised copy of the peer's buffer or of a flag would send and wait where the peer never looks
(`torch.compile` with aot_eager does clone mutated arguments). Torch only: hf_vegas registers an exchange where
Triton may be missing.
"""

from __future__ import annotations

import torch

# name -> (peer_recv, recv, peer_pad, pad): the two halves `(2, rows, K)` of the peer's receive buffer (mapped into
# this process) and of this rank's, and one int32 flag per row on the peer's signal pad and on this rank's.
_EXCHANGES: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def register(name: str, peer_recv: torch.Tensor, recv: torch.Tensor, peer_pad: torch.Tensor, pad: torch.Tensor):
    """Make `name` refer to these buffers (replacing what it referred to)."""
    if peer_recv.dim() != 3 or peer_recv.shape[0] != 2 or peer_recv.shape != recv.shape:
        raise ValueError(f"exchange {name!r}: receive buffers must be two halves (2, rows, K) alike, got "
                         f"{tuple(peer_recv.shape)} and {tuple(recv.shape)}")
    _EXCHANGES[name] = (peer_recv, recv, peer_pad, pad)


def forget(name: str) -> None:
    _EXCHANGES.pop(name, None)


def halves(name: str, parity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(peer_recv, recv, peer_pad, pad)` of a sum of this `parity` (0 or 1) through the exchange `name`."""
    if name not in _EXCHANGES:
        raise KeyError(f"no two-rank exchange is registered as {name!r} (released, or never allocated)")
    if parity not in (0, 1):
        raise ValueError(f"parity must be 0 or 1, got {parity}")
    peer_recv, recv, peer_pad, pad = _EXCHANGES[name]
    return peer_recv[parity], recv[parity], peer_pad, pad
