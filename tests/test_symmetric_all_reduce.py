"""`vegas_tp_all_reduce="symmetric_memory"` (`hf_vegas.symmetric_all_reduce`): which all-reduces the stand-in for
transformers' `dist` takes, that it is installed for the block only, and the errors before any forward. The op itself
needs two GPUs: `tests/test_tensor_parallel.py` runs a generation with it there (and checks the CPU refusal with two
gloo ranks); here a recorder stands in for it."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ragged_batch, tiny_model

from hf_vegas import symmetric_all_reduce
from hf_vegas._compat import internals as compat


class _Group:
    group_name = "tp"


@pytest.fixture
def calls(monkeypatch):
    """What reached the symmetric op and what reached torch.distributed.all_reduce."""
    seen = {"symmetric": [], "nccl": []}
    monkeypatch.setattr(symmetric_all_reduce, "symmetric_all_reduce_",
                        lambda x, buffer, name: seen["symmetric"].append((tuple(x.shape), buffer, name)))
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda tensor, **kwargs: seen["nccl"].append((tuple(tensor.shape), kwargs)))
    return seen


def test_the_stand_in_takes_in_place_sums_on_the_group_that_fit(calls):
    group, other = _Group(), _Group()
    buffer = torch.empty(64 * 8, dtype=torch.bfloat16)
    dist = symmetric_all_reduce._Distributed(group, buffer)
    x = torch.ones(4, 16, dtype=torch.bfloat16)
    assert dist.all_reduce(x, group=group) is None  # transformers' call: default op, its group
    assert calls["symmetric"] == [((4, 16), buffer, "tp")] and not calls["nccl"]
    dist.all_reduce(torch.ones(32, 16, dtype=torch.bfloat16), group=group, op=torch.distributed.ReduceOp.SUM)
    assert len(calls["symmetric"]) == 2  # exactly the buffer's size fits
    calls["symmetric"].clear()
    declined = [
        dict(tensor=torch.ones(33, 16, dtype=torch.bfloat16), group=group),  # larger than the buffer (a prefill's)
        dict(tensor=x, group=other),  # another group
        dict(tensor=x, group=group, op=torch.distributed.ReduceOp.MAX),  # another reduction
        dict(tensor=x, group=group, async_op=True),
        dict(tensor=x.float(), group=group),  # another dtype
        dict(tensor=torch.ones(16, 4, dtype=torch.bfloat16).t(), group=group),  # not contiguous
        dict(tensor=torch.ones(3, dtype=torch.bfloat16), group=group),  # 6 bytes: not whole 4-byte words
    ]
    for kwargs in declined:
        dist.all_reduce(**kwargs)
    assert not calls["symmetric"] and len(calls["nccl"]) == len(declined)
    assert calls["nccl"][2][1]["op"] == torch.distributed.ReduceOp.MAX and calls["nccl"][3][1]["async_op"]
    assert "op" not in calls["nccl"][0][1], "a call without an op reaches torch.distributed without one"
    assert dist.get_world_size is torch.distributed.get_world_size  # everything else is torch.distributed's


def test_installed_for_the_block_only_also_when_it_raises(monkeypatch):
    module = compat.tensor_parallel_module()
    group, made = _Group(), []
    monkeypatch.setattr(symmetric_all_reduce.tensor_parallel, "tp_group", lambda model, needed_by: group)
    monkeypatch.setattr(symmetric_all_reduce, "buffer_for",
                        lambda group, numel, device, dtype: made.append(numel) or torch.empty(numel, dtype=dtype))
    monkeypatch.setattr(symmetric_all_reduce, "exchange_for",
                        lambda group, rows, hidden, device, dtype: made.append((rows, hidden)) or "exchange")
    model = tiny_model("llama")
    with symmetric_all_reduce.symmetric_all_reduces(model, 12, torch.device("cpu"), enabled=False,
                                                    draft_rows=3) as exchange:
        assert module.dist is torch.distributed and not made and exchange is None
    with symmetric_all_reduce.symmetric_all_reduces(model, 12, torch.device("cpu")) as exchange:
        assert exchange is None and made == [16 * model.config.hidden_size], "no draft rows: no exchange"
    made.clear()
    with pytest.raises(RuntimeError, match="inside"):
        with symmetric_all_reduce.symmetric_all_reduces(model, 12, torch.device("cpu"), draft_rows=3) as exchange:
            assert isinstance(module.dist, symmetric_all_reduce._Distributed)
            hidden = model.config.hidden_size
            assert made == [16 * hidden, (3, hidden)], "the largest step's rows (to a power of two) of hidden"
            assert exchange == "exchange", "the block yields the fused layers' exchange for the draft rows"
            with pytest.raises(RuntimeError, match="already sums through symmetric memory"):
                with symmetric_all_reduce.symmetric_all_reduces(model, 12, torch.device("cpu")):
                    pass
            assert isinstance(module.dist, symmetric_all_reduce._Distributed), "the refused block changed nothing"
            raise RuntimeError("inside")
    assert module.dist is torch.distributed


def test_a_model_without_tensor_parallelism_is_refused_before_any_forward():
    model = tiny_model("llama")
    ids, mask = ragged_batch([12, 9])
    forwards = []
    model.register_forward_pre_hook(lambda *args: forwards.append(1))
    with pytest.raises(ValueError, match="vegas_tp_all_reduce='symmetric_memory'.*not sharded.*Use 'nccl'"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, custom_generate="vegas",
                       vegas_tp_all_reduce="symmetric_memory")
    with pytest.raises(ValueError, match="vegas_tp_all_reduce` must be one of \\['nccl', 'symmetric_memory'\\]"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, custom_generate="vegas", vegas_tp_all_reduce="nvls")
    assert forwards == []


@pytest.mark.parametrize("world,device,dtype,has_op,message", [
    (4, "cuda", torch.bfloat16, True, "runs on 2 tensor-parallel ranks"),
    (2, "cpu", torch.bfloat16, True, "needs CUDA devices"),
    (2, "cuda", torch.float16, True, "sums \\['torch.bfloat16', 'torch.float32'\\] tensors"),
    (2, "cuda", torch.bfloat16, False, "needs torch.ops.symm_mem.one_shot_all_reduce_copy_out"),
])
def test_what_the_one_shot_kernel_cannot_sum_is_refused(monkeypatch, world, device, dtype, has_op, message):
    monkeypatch.setattr(symmetric_all_reduce.tensor_parallel, "tp_group", lambda model, needed_by: _Group())
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(symmetric_all_reduce, "_has_one_shot_op", lambda: has_op)
    model = tiny_model("llama").to(dtype)
    with pytest.raises(ValueError, match=message):
        symmetric_all_reduce.check(model, torch.device(device))


def test_a_tensor_less_aligned_than_the_buffer_is_summed_by_nccl(monkeypatch):
    """The kernel wants its input as aligned as the buffer's start: the op tells from the real address (a compiled
    trace has none) and hands such a tensor to NCCL on the group of that name."""
    seen = []
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_resolve_process_group", lambda name: f"group {name}")
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group: seen.append((tensor.numel(), group)))
    storage = torch.zeros(16, dtype=torch.bfloat16)
    x = storage[1:9]  # 2 bytes past a 16-byte boundary
    assert x.data_ptr() % 16 and storage.data_ptr() % 16 == 0
    symmetric_all_reduce.symmetric_all_reduce_(x, torch.empty(64, dtype=torch.bfloat16), "tp")
    assert seen == [(8, "group tp")]


def test_a_compiled_forward_traces_the_stand_in_whole(monkeypatch):
    """A compiled step reaches the stand-in inside the traced forward (transformers' module global): `routes` and
    the op trace without a graph break (`fullgraph=True`), with transformers' call and with an explicit SUM. (The
    tensor sits 2 bytes past 16-byte alignment, so at run time the op hands it to a stand-in NCCL.)"""
    group = _Group()
    dist = symmetric_all_reduce._Distributed(group, torch.empty(64, dtype=torch.bfloat16))
    seen = []
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_resolve_process_group", lambda name: name)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group: seen.append(group) or tensor.mul_(2))

    def forward(x):
        y = x.new_zeros(9)[1:]
        y.copy_(x * 3)
        dist.all_reduce(y, group=group)
        dist.all_reduce(y, op=torch.distributed.ReduceOp.SUM, group=group)
        return y + 1

    out = torch.compile(forward, fullgraph=True, backend="aot_eager")(torch.ones(8, dtype=torch.bfloat16))
    assert seen == ["tp", "tp"] and torch.equal(out, torch.full((8,), 13.0, dtype=torch.bfloat16))


def test_release_graphs_for_every_model_also_drops_the_buffers(monkeypatch):
    """The symmetric buffers outlive generations (graphs kept per bucket replay with their addresses); releasing
    every model's graphs drops them too, releasing one model's does not (another's graphs may read them)."""
    import hf_vegas

    kept = {("group", torch.device("cpu"), torch.bfloat16, 64): torch.empty(64)}
    monkeypatch.setattr(symmetric_all_reduce, "_buffers", dict(kept))
    hf_vegas.release_graphs(torch.nn.Linear(2, 2))  # a model with nothing pooled
    assert symmetric_all_reduce._buffers == kept
    hf_vegas.release_graphs()
    assert symmetric_all_reduce._buffers == {}


@pytest.mark.parametrize("limit", ["unknown pad", "small pad", "no kernels"])
def test_no_exchange_where_signal_pads_are_too_small_or_unknown_or_no_kernels(monkeypatch, caplog, limit):
    """The fused layers' exchange needs one 4-byte flag per row on a signal pad, and the kernel package's registry:
    where torch cannot say the pads' size (older releases), they hold too few flags, or hf_vegas_kernels is not
    importable, there is none (said once); those layers sum through transformers."""
    import logging

    import torch.distributed._symmetric_memory as symm_mem

    if limit == "unknown pad":
        monkeypatch.delattr(symm_mem, "get_signal_pad_size", raising=False)
    else:
        monkeypatch.setattr(symm_mem, "get_signal_pad_size", lambda: 64 if limit == "small pad" else 9216)
    if limit == "no kernels":
        monkeypatch.setattr(symmetric_all_reduce, "_registry", lambda: None)
    monkeypatch.setattr(symmetric_all_reduce.Exchange, "allocate", lambda *args: pytest.fail("allocated"))
    with caplog.at_level(logging.INFO, logger="hf_vegas"):
        assert symmetric_all_reduce.exchange_for(_Group(), 17, 64, torch.device("cpu"), torch.bfloat16) is None
    assert "through transformers" in caplog.text
    assert {"unknown pad": "does not say", "small pad": "32 rows need 128 bytes",
            "no kernels": "hf_vegas_kernels is not importable"}[limit] in caplog.text
