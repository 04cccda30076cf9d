"""A fused layer's sums over two tensor-parallel ranks through an `Exchange` (`hf_vegas_kernels.all_reduce_norm`: the
sum and the norm after it in one launch) against transformers' sums and separate norm launches, on one process: the
exchange looped back to the rank itself, so that each "sum" adds a partial to itself, and the sums it replaces doubled
alike. The two-GPU generations: `tests/test_tensor_parallel.py` on two GPUs (`tensor_parallel_worker`)."""

import dataclasses

import torch

from hf_vegas import fused_layers as fused_module
from hf_vegas.fused_layer_parts import layer_parts, link_norms
from hf_vegas.symmetric_all_reduce import Exchange
from kernel_cases import DEVICE, NAN, assert_fp32_close, import_kernels
from tiny_models import tiny_model

kernels = import_kernels()


def _looped_back(rows: int, hidden: int) -> Exchange:
    halves = torch.full((2, rows, hidden), NAN, device=DEVICE)
    flags = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
    return Exchange.of(f"test-looped-back-{rows}x{hidden}", halves, halves, flags, flags)


def _tensor_parallel_parts(model, doubled: list):
    """Each layer's parts as a first rank's under TP: its "sums over the ranks" double their partial products (what
    a looped-back exchange sums) and record them."""
    def doubling(partial):
        doubled.append(partial)
        return partial * 2

    decoder = model.model
    parts = {layer: layer_parts(layer) for layer in decoder.layers}
    link_norms(decoder, parts)
    return [dataclasses.replace(p, tp_sums=(doubling, doubling), adds_residual=True) for p in parts.values()]


@torch.no_grad()
def test_through_an_exchange_a_layer_sums_and_normalises_as_with_separate_launches():
    model = tiny_model("llama").to(DEVICE)
    hidden = model.config.hidden_size
    doubled = []
    first, last = (_tensor_parallel_parts(model, doubled)[i] for i in (0, -1))
    assert first.next_norm is not None and last.next_norm is None
    gen = torch.Generator().manual_seed(0)
    rows = 5
    attn = torch.randn(rows, first.o_weight.shape[1], generator=gen).to(DEVICE)
    x = torch.randn(rows, hidden, generator=gen).to(DEVICE)
    for parts in (first, last):
        doubled.clear()
        want_out, none, _ = fused_module._tensor_parallel_rest(kernels, parts, attn, x, None)
        assert none is None and len(doubled) == 2
        exchange = _looped_back(rows + 3, hidden)
        out, next_normed, sums = fused_module._tensor_parallel_rest(kernels, parts, attn, x, exchange)
        assert_fp32_close(out, want_out)
        assert sums is None and int(exchange.pad.abs().sum()) == 0, "every signal consumed"
        # The output projection's partial in half 0, the down projection's in half 1, nothing past the rows.
        assert_fp32_close(exchange.recv[0, :rows], doubled[0])
        assert_fp32_close(exchange.recv[1, :rows], doubled[1])
        assert exchange.recv[:, rows:].isnan().all()
        if parts.next_norm is None:  # the last layer: the model's final norm follows, not a fused layer's
            assert next_normed is None
        else:
            norm, eps = parts.next_norm
            assert_fp32_close(next_normed, kernels.rms_norm(out, norm, eps))


@torch.no_grad()
def test_an_exchange_of_another_dtype_or_too_few_rows_is_passed_over():
    model = tiny_model("llama").to(DEVICE)
    parts = _tensor_parallel_parts(model, [])[0]
    hidden = model.config.hidden_size
    attn = torch.randn(4, parts.o_weight.shape[1], device=DEVICE)
    x = torch.randn(4, hidden, device=DEVICE)
    want, _, _ = fused_module._tensor_parallel_rest(kernels, parts, attn, x, None)
    fits = _looped_back(4, hidden)
    for exchange in (_looped_back(3, hidden), dataclasses.replace(fits, dtype=torch.half),
                     dataclasses.replace(fits, hidden=hidden + 1)):
        out, normed, _ = fused_module._tensor_parallel_rest(kernels, parts, attn, x, exchange)
        assert normed is None and torch.equal(out, want), "transformers' sums, as without an exchange"
    out, normed, _ = fused_module._tensor_parallel_rest(kernels, parts, attn, x, fits)
    assert normed is not None, "the exchange that fits is taken"


@torch.no_grad()
def test_a_draft_step_through_an_exchange_hands_each_layer_its_input_norm(monkeypatch):
    """A whole draft step of first-rank layers (the sums doubled, as a looped-back exchange sums): through the
    exchange, only the first layer's input norm is a launch of its own (each sum writes the norm after it, the down
    projection's the next layer's input norm), and the logits are those of the same layers summing through
    transformers with both norms of every layer as launches."""
    from transformers import LogitsProcessorList

    from hf_vegas.attention import active_cache, vegas_attention
    from hf_vegas.cache import VegasCache
    from hf_vegas.config import VegasConfig
    from hf_vegas.runner import StepRunner
    from tiny_models import ragged_batch

    model = tiny_model("llama").to(DEVICE)
    gen = torch.Generator().manual_seed(3)
    for layer in model.model.layers:  # distinct norms: a norm written with another layer's weight would show
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data = (torch.rand(norm.weight.shape, generator=gen) + 0.5).to(norm.weight)
    original = fused_module.layer_parts
    monkeypatch.setattr(fused_module, "layer_parts", lambda layer: None if (parts := original(layer)) is None else
                        dataclasses.replace(parts, tp_sums=(lambda p: p * 2, lambda p: p * 2), adds_residual=True))
    norms = []
    monkeypatch.setattr(kernels, "rms_norm", lambda *args, _op=kernels.rms_norm: norms.append(1) or _op(*args))
    ids, mask = (t.to(DEVICE) for t in ragged_batch([23, 17]))
    config = VegasConfig(gamma=2, sparsity=0.3, min_tokens=4, backend="triton", cuda_graphs=False)
    cache = VegasCache(model.config, 2, 40, config, device=DEVICE, backend="triton")
    runner = StepRunner(model, cache, LogitsProcessorList(), do_sample=False)
    token = torch.tensor([[5], [9]], device=DEVICE)
    layers = model.config.num_hidden_layers
    logits = {}
    with vegas_attention(model), active_cache(cache):
        runner.prefill(ids, left_pad=(mask == 0).sum(dim=1))
        committed = cache.plan.lengths.clone()
        for name, exchange in (("transformers", None), ("exchange", _looped_back(2, model.config.hidden_size))):
            norms.clear()
            with fused_module.fused_layers(model, cache, exchange) as fused:
                assert fused == layers
                cache.begin("draft")
                logits[name] = runner.call_model(token, 1)
            cache.plan.rollback(committed)
            assert len(norms) == (1 if exchange is not None else 2 * layers), (name, len(norms))
    assert_fp32_close(logits["exchange"], logits["transformers"])
