"""Row-parallel all-reduces through symmetric memory under transformers' tensor parallelism (`vegas_tp_all_reduce`).

transformers sums a row-parallel projection's partial outputs over the ranks with `torch.distributed.all_reduce`
(NCCL), called from its tensor-parallel module (`_compat.internals.tensor_parallel_module`). A draft step's are small
and many: a Qwen3-8B-shaped forward at batch 16 under TP = 2 makes 72 of `(16, 4096)` bf16 (two per layer), each
18.5 us in a CUDA graph on 2 x H200: latency, not bytes. A one-shot all-reduce through symmetric memory
(`torch.ops.symm_mem.one_shot_all_reduce_copy_out`: each rank copies its partial into a buffer every rank maps, a
device-side barrier, then each rank sums every rank's buffer; no NVLink multicast) took 7.6 us, and gave NCCL's sums
bit for bit (`benchmarks/all_reduce.py`, README "Multi-GPU").

With `vegas_tp_all_reduce="symmetric_memory"`, while `generate` runs, that module's `dist` is a stand-in whose
`all_reduce` sends each in-place sum of a tensor that fits the buffer, on the model's tensor-parallel group, through
`symmetric_all_reduce_`. Everything else goes to `torch.distributed` unchanged: other groups and reductions,
asynchronous calls, activations larger than the buffer (a prefill's, but for prompts of at most gamma + 1 tokens),
and every other function of the module. Every rank routes a call alike (the choice reads shapes and dtypes only), so
the ranks' collectives stay in step. The buffer has the model's dtype: under autocast, activations of another dtype
go to NCCL.

A rank that fails inside a forward leaves the other's GPU waiting at the one-shot kernel's barrier, which has no
timeout (NCCL's watchdog does not see it): the process must be stopped from outside.

Two ranks only: with two, each sum is `a + b` on both ranks whichever kernel adds it (the benchmark compared them
bit for bit). With more, the one-shot order would round otherwise than NCCL's ring, and greedy Vegas could leave
vanilla greedy under the same parallelism.

The buffer holds the largest decode, draft or verification activation, `batch * (gamma + 1)` rows of the hidden size
(rounded up to a power of two). It is allocated and rendezvoused once per (group, device, dtype, size) and kept
(graphs captured over it replay with its address): a collective call, which every rank makes at the same point of
`generate`, eagerly (the one-shot op is captured in a CUDA graph only over a buffer rendezvoused before the capture).

Fused draft layers (`hf_vegas.fused_layers`) sum through an `Exchange` of their own instead: receive buffers and
signal flags that `hf_vegas_kernels.exchange_sum_norm` pushes rows and signals through, one launch per sum with
the norm after it. `symmetric_all_reduces` yields it for the generation's draft rows (one flag per row on each
rank's signal pad: 2,304 rows for the default 9 KiB pad; where torch cannot say the pad's size, or the rows need
more, there is none and those layers keep transformers' sums).

`symmetric_all_reduce_` is an op of hf_vegas, with a fake, because torch 2.11 has none for the symmetric op: a
compiled step could not trace it (dynamo refused it in the benchmark). It declares that it writes the buffer too
(it copies its input there first). On 2 x H200 (6bdac13) a generation with it gave vanilla TP greedy (the TP worker,
tiny Llama) and the Qwen3-8B shape at 16 x 32K ran 4.5 % faster; both runs had not exited by their timeouts after
their work was done, hence `release_buffers`, after which (f4a80ab) the worker and the benchmark exited on their own
(README "Multi-GPU").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging

import torch

from ._compat import internals as compat
from . import tensor_parallel

Tensor = torch.Tensor
DTYPES = (torch.bfloat16, torch.float32)  # what the one-shot kernel sums
OPTION = "`vegas_tp_all_reduce='symmetric_memory'`"
_NEEDS_GROUP = f"{OPTION} replaces the all-reduces of the tensor-parallel ranks"  # (a mesh without a "tp" dimension)


@torch.library.custom_op("hf_vegas::symmetric_all_reduce_", mutates_args=("x", "buffer"))
def symmetric_all_reduce_(x: Tensor, buffer: Tensor, group_name: str) -> None:
    """`x` summed over the ranks of `group_name` in place, through the symmetric `buffer` (1-D, at least as long).

    The kernel wants its input as aligned as the buffer's start (16 bytes); a tensor that is not (a view into
    another) is summed by NCCL instead. Told here, from the real address, which a compiled step's trace does not
    have; every rank's tensor sits alike, so every rank takes the same path."""
    if x.data_ptr() % 16:
        torch.distributed.all_reduce(x, group=torch.distributed.distributed_c10d._resolve_process_group(group_name))
        return
    torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer[: x.numel()].view(x.shape), x, "sum", group_name, x)


@symmetric_all_reduce_.register_fake
def _(x, buffer, group_name):
    return None


class _Distributed:
    """What transformers' tensor-parallel module calls `dist` during a generation: `torch.distributed`, but for the
    all-reduces that `routes` sends through symmetric memory."""

    def __init__(self, group, buffer: Tensor):
        self._group, self._buffer, self._group_name = group, buffer, group.group_name

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    def routes(self, tensor: Tensor, op, group, async_op: bool) -> bool:
        """Whether this all-reduce goes through symmetric memory: an in-place sum on the tensor-parallel group of a
        contiguous tensor of the buffer's device and dtype that fits it, in whole 4-byte words (the kernel's). Only
        what a compiled step's trace knows is read (no address, no storage offset: dynamo would break the graph)."""
        return (group is self._group and (op is None or op == torch.distributed.ReduceOp.SUM) and not async_op
                and tensor.device == self._buffer.device and tensor.dtype == self._buffer.dtype
                and tensor.is_contiguous() and tensor.numel() <= self._buffer.numel()
                and tensor.numel() * tensor.element_size() % 4 == 0)

    def all_reduce(self, tensor: Tensor, op=None, group=None, async_op: bool = False):
        if self.routes(tensor, op, group, async_op):
            symmetric_all_reduce_(tensor, self._buffer, self._group_name)
            return None
        kwargs = {} if op is None else dict(op=op)
        return torch.distributed.all_reduce(tensor, group=group, async_op=async_op, **kwargs)


# Kept while any CUDA graph may replay over them (the graphs kept per shape bucket, `hf_vegas.graphs`, replay with
# their addresses, whatever generation runs next): dropped only by `release_buffers`, which `hf_vegas.release_graphs()`
# calls once it has dropped every model's graphs.
_buffers: dict[tuple[str, torch.device, torch.dtype, int], Tensor] = {}


def release_buffers() -> None:
    """Drop every symmetric buffer. Only once no captured graph that reads one remains; on every
    rank at the same point, while the process group is alive (freeing symmetric memory may be collective), e.g.
    before `destroy_process_group`."""
    _buffers.clear()
    for exchange in _exchanges.values():
        _registry().forget(exchange.name)
    _exchanges.clear()


@dataclasses.dataclass(frozen=True, eq=False)
class Exchange:
    """What fused draft layers sum two ranks' rows through (`hf_vegas_kernels.exchange_sum_norm`, by `name`): this
    rank's receive buffer `(2, rows, hidden)` (two halves that consecutive sums alternate) and the peer's, mapped into
    this process, and one int32 signal flag per row on each rank's signal pad (which starts zeroed and which every
    sum leaves zeroed). `rows`, `hidden` and `dtype` are plain values, so that a compiled step's trace, which decides
    by them whether a forward sums through it, never reads the buffers."""

    name: str
    recv: Tensor
    peer_recv: Tensor
    pad: Tensor
    peer_pad: Tensor
    rows: int
    hidden: int
    dtype: torch.dtype

    @classmethod
    def of(cls, name: str, recv: Tensor, peer_recv: Tensor, pad: Tensor, peer_pad: Tensor) -> "Exchange":
        """An exchange over these buffers, registered under `name` for the op (`release_buffers` forgets it)."""
        if (registry := _registry()) is None:
            raise RuntimeError("an exchange is registered with hf_vegas_kernels, which is not importable here")
        registry.register(name, peer_recv, recv, peer_pad, pad)
        return cls(name, recv, peer_recv, pad, peer_pad, rows=recv.shape[1], hidden=recv.shape[2], dtype=recv.dtype)

    @classmethod
    def allocate(cls, rows: int, hidden: int, dtype: torch.dtype, device: torch.device, group_name: str) -> "Exchange":
        """A new exchange (a collective: every rank of the two-rank group at the same point)."""
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(2 * rows * hidden, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(buffer, group=group_name)
        if handle.world_size != 2:
            raise ValueError(f"{OPTION}: the fused sum and norm run on 2 ranks, this group has {handle.world_size}")
        peer = 1 - handle.rank
        name = f"{group_name}/{torch.device(device)}/{dtype}/{rows}x{hidden}"
        return cls.of(name, buffer.view(2, rows, hidden), handle.get_buffer(peer, (2, rows, hidden), dtype),
                      handle.get_signal_pad(handle.rank, (rows,), dtype=torch.int32),
                      handle.get_signal_pad(peer, (rows,), dtype=torch.int32))


_exchanges: dict[tuple[str, torch.device, torch.dtype, int, int], Exchange] = {}


def buffer_for(group, numel: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """The group's symmetric buffer of `numel` elements (a collective, the first time a size is asked for)."""
    import torch.distributed._symmetric_memory as symm_mem

    key = (group.group_name, torch.device(device), dtype, numel)
    if key not in _buffers:
        buffer = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, group=group.group_name)
        _buffers[key] = buffer
    return _buffers[key]


def check(model, device: torch.device) -> None:
    """Raise before any GPU work if `model` on `device` cannot sum its all-reduces through symmetric memory."""
    group = tensor_parallel.tp_group(model, _NEEDS_GROUP)
    if group is None:
        raise ValueError(f"{OPTION} replaces the all-reduces of transformers' tensor parallelism, but this model is "
                         "not sharded (load it with DistributedConfig(tp_plan='auto') under torchrun). Use 'nccl'.")
    if torch.distributed.get_world_size(group) != 2:
        raise ValueError(f"{OPTION} runs on 2 tensor-parallel ranks (where its sums equal NCCL's bit for bit); this "
                         f"model has {torch.distributed.get_world_size(group)}. Use 'nccl'.")
    if torch.device(device).type != "cuda":
        raise ValueError(f"{OPTION} needs CUDA devices; this model is on {device}. Use 'nccl'.")
    if model.dtype not in DTYPES:
        raise ValueError(f"{OPTION} sums {[str(d) for d in DTYPES]} tensors; this model is {model.dtype}. Use 'nccl'.")
    if not _has_one_shot_op():
        raise ValueError(f"{OPTION} needs torch.ops.symm_mem.one_shot_all_reduce_copy_out, which torch "
                         f"{torch.__version__} lacks. Use 'nccl'.")
    compat.tensor_parallel_module()


def buffer_numel(model, rows: int) -> int:
    """The buffer's size for forwards of at most `rows` rows: rows rounded up to a power of two (fewer sizes, each a
    collective to make) of the hidden size."""
    return (1 << max(rows - 1, 0).bit_length()) * model.config.get_text_config(decoder=True).hidden_size


def _has_one_shot_op() -> bool:
    return hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")


@contextlib.contextmanager
def symmetric_all_reduces(model, rows: int, device: torch.device, enabled: bool = True, draft_rows: int = 0):
    """Inside the block, transformers' tensor-parallel all-reduces of `model` that fit `rows` rows of its hidden size
    run through symmetric memory (see the module docstring); a no-op block when not `enabled`. `check` first.

    Yields the `Exchange` through which fused draft layers of up to `draft_rows` rows sum over the ranks with the
    norm after each sum (`hf_vegas_kernels.exchange_sum_norm`), or None: when not `enabled`, for no draft rows, or
    where the exchange cannot be made (`exchange_for`; those layers then sum through transformers)."""
    if not enabled:
        yield None
        return
    group = tensor_parallel.tp_group(model, _NEEDS_GROUP)
    module = compat.tensor_parallel_module()
    if isinstance(module.dist, _Distributed):  # two blocks would put `dist` back out of order
        raise RuntimeError(f"{OPTION}: another generation in this process already sums through symmetric memory; "
                           "run them one after the other.")
    buffer = buffer_for(group, buffer_numel(model, rows), device, model.dtype)
    hidden = model.config.get_text_config(decoder=True).hidden_size
    exchange = exchange_for(group, draft_rows, hidden, device, model.dtype) if draft_rows else None
    previous = module.dist
    module.dist = _Distributed(group, buffer)
    try:
        yield exchange
    finally:
        module.dist = previous


def exchange_for(group, rows: int, hidden: int, device: torch.device, dtype: torch.dtype) -> Exchange | None:
    """The group's exchange for sums of up to `rows` rows (rounded up to a power of two) of `hidden` values (a
    collective, the first time a size is asked for); kept as the buffers are, for the graphs captured over it. None
    (said once, at INFO) where torch has no signal pads to ask, or more rows than a signal pad has flags."""
    import torch.distributed._symmetric_memory as symm_mem

    rows = 1 << max(rows - 1, 0).bit_length()
    pad_bytes = getattr(symm_mem, "get_signal_pad_size", lambda: 0)()
    if rows * 4 > pad_bytes or _registry() is None:
        reason = ("hf_vegas_kernels is not importable" if _registry() is None else
                  f"torch {torch.__version__} does not say its signal pads' size" if not pad_bytes else
                  f"{rows} rows need {rows * 4} bytes of signal flags, a signal pad has {pad_bytes}")
        _log_once(f"hf_vegas sums fused draft layers over the ranks through transformers, then a norm: {reason}.")
        return None
    key = (group.group_name, torch.device(device), dtype, rows, hidden)
    if key not in _exchanges:
        _exchanges[key] = Exchange.allocate(rows, hidden, dtype, device, group.group_name)
    return _exchanges[key]


def _registry():
    """`hf_vegas_kernels.exchanges`, the exchanges by name that the op looks up (torch only), or None where the kernel
    package is not importable (then no layer fuses, and no exchange is needed). Imported by name, so that the Hub
    folder's copy of this module registers where the installed kernels look."""
    try:
        return importlib.import_module("hf_vegas_kernels.exchanges")
    except ImportError:
        return None


@functools.cache
def _log_once(message: str) -> None:
    logging.getLogger("hf_vegas").info(message)
