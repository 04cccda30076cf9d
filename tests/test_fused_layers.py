"""Fused layers: which layers fuse, the same draft, verification and dense steps as the model's own layers, the
verification and dense steps fused at every gamma or not at all, and generation that stays vanilla's. Their
kernels' own tests: `kernels/tests/test_kernels_norm_rope.py` and `test_kernels_linear.py`."""

import contextlib
import dataclasses

import pytest
import torch
from transformers import LogitsProcessorList

import hf_vegas
from hf_vegas.attention import active_cache, vegas_attention
from hf_vegas.cache import VegasCache
from hf_vegas.config import VegasConfig
from hf_vegas import fused_layers as fused_module
from hf_vegas.fused_layers import fused_layers, fused_steps
from hf_vegas.fused_layer_parts import layer_parts
from hf_vegas.runner import StepRunner
from kernel_cases import DEVICE, NAN, assert_fp32_close, import_kernels
from tiny_models import ragged_batch, tiny_model

kernels = import_kernels()


def _random_norms(model):
    """Distinct norm weights and epsilons in every layer (a tiny model's norms are all ones with one eps), so a norm
    wired to the wrong layer or the wrong input shows."""
    gen = torch.Generator().manual_seed(5)
    for i, layer in enumerate(model.model.layers):
        for j, norm in enumerate((layer.input_layernorm, layer.post_attention_layernorm)):
            norm.weight.data = (torch.rand(norm.weight.shape, generator=gen) + 0.5).to(norm.weight)
            norm.variance_epsilon = 10.0 ** -(2 + 2 * j + i % 3)
        head_norms = [getattr(layer.self_attn, name, None) for name in ("q_norm", "k_norm")]
        for j, norm in enumerate(n for n in head_norms if n is not None):  # (Qwen3's, one eps for both)
            norm.weight.data = (torch.rand(norm.weight.shape, generator=gen) * 2 + 0.2 * (j + 1)).to(norm.weight)
            norm.variance_epsilon = 10.0 ** -(1 + i % 3)
    return model


def test_llama_and_qwen3_layers_fuse_and_the_others_keep_their_forward():
    for arch in ("llama", "qwen3"):
        model = tiny_model(arch)
        with fused_layers(model, cache=None) as fused:
            assert fused == model.config.num_hidden_layers, arch
            assert all("forward" in vars(layer) for layer in model.model.layers)
        assert not any("forward" in vars(m) for m in model.modules()), "every instance forward must be removed"
    assert layer_parts(tiny_model("llama").model.layers[0]).head_norms is None
    assert layer_parts(tiny_model("qwen3").model.layers[0]).head_norms is not None
    # A sliding-window argument (Mistral), latent attention: other code, their own forward.
    for arch in ("mistral", "deepseek_v3"):
        with fused_layers(tiny_model(arch), cache=None) as fused:
            assert fused == 0, arch
    # Qwen3's head norms must be plain norms with one eps
    qwen3 = tiny_model("qwen3")
    qwen3.model.layers[0].self_attn.k_norm.register_forward_hook(lambda *args: None)
    qwen3.model.layers[1].self_attn.k_norm.variance_epsilon = 1e-3
    assert layer_parts(qwen3.model.layers[0]) is None and layer_parts(qwen3.model.layers[1]) is None
    assert layer_parts(qwen3.model.layers[2]) is not None
    # ... without a forward of their own, but for the one transformers' tensor parallelism installs (the class's
    # inside: tests/test_tensor_parallel.py fuses Qwen3's layers under it); any other instance forward is refused
    qwen3.model.layers[2].self_attn.q_norm.forward = lambda x: x
    assert layer_parts(qwen3.model.layers[2]) is None
    hooked = tiny_model("llama")
    hooked.model.layers[1].post_attention_layernorm.register_forward_hook(lambda *args: None)
    assert layer_parts(hooked.model.layers[1]) is None and layer_parts(hooked.model.layers[0]) is not None
    hooked.model.layers[0].self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(64))
    assert layer_parts(hooked.model.layers[0]) is None, "an output bias is not in the fused layer"


def test_qwen3_sliding_window_layers_keep_their_forward_and_generation_stays_vanilla(monkeypatch):
    """A Qwen3 whose later layers slide (`max_window_layers`): only its full-attention layer runs the fused launches,
    and the generation accepts what the model's own layers accept and gives vanilla's tokens."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tiny_models import COMMON

    torch.manual_seed(0)
    config = Qwen3Config(**COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                         use_sliding_window=True, sliding_window=8, max_window_layers=1)
    model = _random_norms(Qwen3ForCausalLM(config).eval()).to(DEVICE)
    assert model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    caches = []
    original = kernels.qkv_rope_write
    monkeypatch.setattr(kernels, "qkv_rope_write", lambda *args: caches.append(args[9].data_ptr()) or original(*args))
    ids, mask = (t.to(DEVICE) for t in ragged_batch([30, 21]))
    vanilla = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    common = dict(**vanilla, return_dict_in_generate=True, custom_generate="vegas", vegas_backend="triton",
                  vegas_cuda_graphs=False, vegas_gamma=3, vegas_sparsity=0.3, vegas_min_tokens=4)
    fused = model.generate(ids, **common)
    assert caches and len(set(caches)) == 1, "only the full-attention layer's keys are written by the launch"
    plain = model.generate(ids, **common, vegas_fuse_projections=False)
    assert torch.equal(fused.sequences, plain.sequences) and torch.equal(fused.accepted, plain.accepted)
    assert torch.equal(fused.sequences, model.generate(ids, **vanilla))


def test_layers_with_large_weights_fuse_only_the_fewest_rows(monkeypatch):
    from hf_vegas import fused_projections as projections

    llama = tiny_model("llama")
    assert layer_parts(llama.model.layers[0]).max_rows == projections.MAX_ROWS
    monkeypatch.setattr(projections, "MAX_WEIGHT_BYTES", 0)  # every weight counts as large (cuBLAS' bandwidth)
    assert layer_parts(llama.model.layers[0]).max_rows == projections.LARGE_WEIGHT_MAX_ROWS
    assert layer_parts(llama.model.layers[0]).split_qkv, "large q/k/v: their own projection, then the rotation"
    from transformers import LlamaConfig, LlamaForCausalLM

    odd = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=20))
    odd_parts = layer_parts(odd.model.layers[0])  # (k/v of 40 outputs: no block of 16 for `qkv_linear`)
    assert odd_parts is not None and not odd_parts.split_qkv, "sizes no block divides keep the one launch"
    # A draft of more rows than that runs the model's own layers, and generation stays vanilla's.
    monkeypatch.setattr(projections, "LARGE_WEIGHT_MAX_ROWS", 1)
    calls = []  # (large weights: their projection, then `rope_write_kv`)
    original = kernels.rope_write_kv
    monkeypatch.setattr(kernels, "rope_write_kv",  # (rows: batch x tokens)
                        lambda *args: calls.append(args[0].shape[0] * args[0].shape[1]) or original(*args))
    model = tiny_model("llama").to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in ragged_batch([30, 21]))
    common = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, custom_generate="vegas", vegas_backend="triton",
                  vegas_cuda_graphs=False, vegas_gamma=2, vegas_sparsity=0.3, vegas_min_tokens=4)
    two_rows = model.generate(ids, attention_mask=mask, **common)
    assert calls == [], "two rows exceed the large weights' limit of one"
    assert torch.equal(two_rows, model.generate(ids, attention_mask=mask, **common, vegas_fuse_projections=False))
    model.generate(ids[:1], attention_mask=mask[:1], **common)
    assert calls and set(calls) == {1}, "a one-row draft runs the fused layers"


def test_the_model_is_restored_after_an_exception():
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match="inside"):
        with fused_layers(model, cache=None):
            raise RuntimeError("inside")
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("large", [False, True])
def test_a_fused_draft_step_computes_what_the_model_s_layers_compute(monkeypatch, arch, large):
    """One draft step over the same cache and selection, through the model's own layers and through the fused ones:
    the same logits (fp32, up to summation order) and the same keys and values written; with Qwen3's head norms, and
    with weights counted large (the projection in a launch of its own, then `rope_write_kv`)."""
    from hf_vegas import fused_projections as projections

    if large:
        monkeypatch.setattr(projections, "MAX_WEIGHT_BYTES", 0)
    launches = []
    for name in ("qkv_rope_write", "rope_write_kv"):
        original = getattr(kernels, name)
        monkeypatch.setattr(kernels, name,
                            lambda *args, _name=name, _op=original: launches.append(_name) or _op(*args))
    model = _random_norms(tiny_model(arch)).to(DEVICE)
    assert layer_parts(model.model.layers[0]).split_qkv == large
    ids, mask = (t.to(DEVICE) for t in ragged_batch([23, 17]))
    config = VegasConfig(gamma=2, sparsity=0.3, min_tokens=4, backend="triton", cuda_graphs=False)
    cache = VegasCache(model.config, 2, 40, config, device=DEVICE, backend="triton")
    runner = StepRunner(model, cache, LogitsProcessorList(), do_sample=False)
    token = torch.tensor([5, 9], device=DEVICE)
    with torch.no_grad(), vegas_attention(model), active_cache(cache):
        runner.prefill(ids, left_pad=(mask == 0).sum(dim=1))
        committed = cache.plan.lengths.clone()
        cache.begin("draft")
        want = runner.call_model(token[:, None], 1)
        written = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        cache.plan.rollback(committed)
        for layer in cache.layers:  # the fused step must write the slot itself
            rows = torch.arange(2, device=DEVICE)
            layer.keys[rows, committed] = NAN
            layer.values[rows, committed] = NAN
        with fused_layers(model, cache) as fused:
            assert fused == model.config.num_hidden_layers
            cache.begin("draft")
            got = runner.call_model(token[:, None], 1)
    assert launches == [("rope_write_kv" if large else "qkv_rope_write")] * model.config.num_hidden_layers
    assert_fp32_close(got, want)
    for layer, (keys, values) in zip(cache.layers, written):
        assert_fp32_close(layer.keys, keys)
        assert_fp32_close(layer.values, values)


@pytest.mark.parametrize("arch,compiled", [("llama", False), ("qwen3", False), ("llama", True)])
@pytest.mark.parametrize("mode", ["verify", "decode"])
def test_a_fused_verification_or_dense_step_computes_what_the_model_s_layers_compute(monkeypatch, arch, compiled,
                                                                                     mode):
    """A verification of 3 tokens per row (with the selection it yields) and a dense step, over the same cache,
    through the model's own layers and through the fused ones (eager, or traced whole by `torch.compile`): the same
    logits (fp32, up to summation order), the same keys and values written, and (verification) the same next
    selection; the fused launches do run."""
    monkeypatch.setattr(fused_module, "FULL_STEP_MIN_BATCH", 1)  # (a batch of 2 rows)
    launches = []
    original = kernels.qkv_rope_write
    monkeypatch.setattr(kernels, "qkv_rope_write", lambda *args: launches.append(args[0].shape[1]) or original(*args))
    model = _random_norms(tiny_model(arch)).to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in ragged_batch([23, 17]))
    config = VegasConfig(gamma=2, sparsity=0.3, min_tokens=4, backend="triton", cuda_graphs=False)
    cache = VegasCache(model.config, 2, 40, config, device=DEVICE, backend="triton")
    runner = StepRunner(model, cache, LogitsProcessorList(), do_sample=False)
    tokens = torch.tensor([[5, 9, 2], [7, 1, 3]], device=DEVICE)[:, :3 if mode == "verify" else 1]
    sel = cache.selection

    def step(traced=False):
        if mode == "verify":
            runner.arm_verification()
        else:
            cache.begin("decode")
        if traced:
            torch._dynamo.reset()
            logits = torch.compile(runner._run_model, fullgraph=True, backend="eager", dynamic=False)(
                tokens, tokens.shape[1], None)
        else:
            logits = runner.call_model(tokens, tokens.shape[1])
        return logits, sel.sel_idx.clone(), sel.sel_count.clone()

    with torch.no_grad(), vegas_attention(model), active_cache(cache):
        runner.prefill(ids, left_pad=(mask == 0).sum(dim=1))
        committed = cache.plan.lengths.clone()
        sel.sel_idx.fill_(-1)  # (each verification writes the next selection over it)
        want, want_idx, want_count = step()
        written = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        cache.plan.rollback(committed)
        sel.sel_idx.fill_(-1)
        rows = torch.arange(2, device=DEVICE)[:, None]
        slots = committed[:, None] + torch.arange(tokens.shape[1], device=DEVICE)
        for layer in cache.layers:  # the fused step must write the slots itself
            layer.keys[rows, slots] = NAN
            layer.values[rows, slots] = NAN
        with fused_layers(model, cache) as fused:
            assert fused == model.config.num_hidden_layers
            got, got_idx, got_count = step(traced=compiled)
    assert launches == [tokens.shape[1]] * model.config.num_hidden_layers
    assert_fp32_close(got, want)
    for layer, (keys, values) in zip(cache.layers, written):
        assert_fp32_close(layer.keys, keys)
        assert_fp32_close(layer.values, values)
    assert torch.equal(got_count, want_count)
    # (a dense step selects nothing: both leave the -1s; a verification chooses the same slots)
    assert torch.equal(got_idx, want_idx) and (mode == "decode") == bool((got_idx == -1).all())


@pytest.mark.parametrize("gamma", [0, 2, 9])
@pytest.mark.parametrize("limit", [None, "draft_rows", "batch", "large", "fp16"])
def test_verification_and_dense_steps_fuse_at_every_gamma_or_not_at_all(monkeypatch, limit, gamma):
    """Whether a layer's verification and dense steps run fused depends on the layer and the batch, never on gamma:
    the dense path and every gamma round alike. Below `FULL_STEP_MIN_BATCH` rows, with weights counted large, or with
    norms that do not fold (fp16), both keep the model's own layers while drafts stay fused; prefills never fuse.
    The drafts' row limit (`fused_projections.MAX_ROWS`, here below a verification's rows) does not apply to them."""
    from hf_vegas import fused_projections

    if limit != "batch":
        monkeypatch.setattr(fused_module, "FULL_STEP_MIN_BATCH", 2)  # (the test's batch)
    if limit == "large":
        monkeypatch.setattr(fused_projections, "MAX_WEIGHT_BYTES", 0)
    if limit == "draft_rows":
        monkeypatch.setattr(fused_projections, "MAX_ROWS", 5)
    launches = []
    for name in ("qkv_rope_write", "rope_write_kv"):
        original = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *args, _op=original: launches.append(args[0].shape[1]) or _op(*args))
    dtype = torch.float16 if limit == "fp16" else torch.float32
    model = tiny_model("llama").to(DEVICE, dtype)
    ids, mask = (t.to(DEVICE) for t in ragged_batch([23, 17]))
    selection = dict(sparsity=0.3, min_tokens=4) if gamma else {}  # (gamma 0 selects nothing)
    config = VegasConfig(gamma=gamma, **selection, backend="triton", cuda_graphs=False)
    cache = VegasCache(model.config, 2, 40, config, device=DEVICE, backend="triton")
    runner = StepRunner(model, cache, LogitsProcessorList(), do_sample=False)
    layers = model.config.num_hidden_layers
    with torch.no_grad(), vegas_attention(model), active_cache(cache), fused_layers(model, cache):
        runner.prefill(ids, left_pad=(mask == 0).sum(dim=1))
        assert launches == []
        cache.begin("decode")
        runner.call_model(torch.tensor([[4], [6]], device=DEVICE), 1)
        if gamma:
            runner.arm_verification()
            runner.call_model(torch.randint(1, 50, (2, gamma + 1), device=DEVICE), gamma + 1)
            cache.begin("draft")
            runner.call_model(torch.tensor([[8], [3]], device=DEVICE), 1)
    full = ([1] + ([gamma + 1] if gamma else [])) if limit in (None, "draft_rows") else []
    drafts = [1] if gamma else []
    assert launches == [t for t in full for _ in range(layers)] + drafts * layers


def _draft_step(model, ids, mask, fused: bool, compile_with=None):
    """Prefill, then one draft step's logits through the model's own layers or the fused ones (`compile_with`: a
    `torch.compile` backend that runs the step)."""
    config = VegasConfig(gamma=2, sparsity=0.3, min_tokens=4, backend="triton", cuda_graphs=False)
    cache = VegasCache(model.config, ids.shape[0], 40, config, device=DEVICE, backend="triton")
    runner = StepRunner(model, cache, LogitsProcessorList(), do_sample=False)
    token = torch.arange(5, 5 + ids.shape[0], device=DEVICE)
    with torch.no_grad(), vegas_attention(model), active_cache(cache):
        runner.prefill(ids, left_pad=(mask == 0).sum(dim=1))
        with fused_layers(model, cache) if fused else contextlib.nullcontext():
            cache.begin("draft")
            if compile_with is None:
                return runner.call_model(token[:, None], 1)
            step = torch.compile(runner._run_model, fullgraph=True, backend=compile_with, dynamic=False)
            return step(token[:, None], 1, None)


def test_each_layer_hands_the_next_its_norm_input(monkeypatch):
    """The input norm runs as a launch of its own in the first layer only, in eager and compiled steps (each later
    norm rides in the projections), and so do the rotary tables' one copy; a decoder that changes the hidden states
    between layers gets its norms (and tables) back."""
    model = _random_norms(tiny_model("llama")).to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in ragged_batch([23, 17]))
    want = _draft_step(model, ids, mask, fused=False)
    norms, tables = [], []
    original, original_tables = kernels.rms_norm, fused_module._rope_tables
    monkeypatch.setattr(kernels, "rms_norm", lambda *args: norms.append(1) or original(*args))
    monkeypatch.setattr(fused_module, "_rope_tables", lambda *args: tables.append(1) or original_tables(*args))
    assert_fp32_close(_draft_step(model, ids, mask, fused=True), want)
    assert len(norms) == 1, "the first layer's input norm only"
    assert len(tables) == 1, "the first layer's tables only"
    monkeypatch.setattr(kernels, "rms_norm", original)

    graphs = []

    def count_launches(gm, example_inputs):  # the compiled step's graph: its norm launches and table copies
        # (by name: loading the Hub folder, as another test of the process may have, registers the ops once more)
        graphs.append(tuple(sum(str(node.target) == name for node in gm.graph.nodes) for name in (
            "hf_vegas.rms_norm.default", "hf_vegas.rotary_tables.default")))
        return gm.forward

    torch._dynamo.reset()
    assert_fp32_close(_draft_step(model, ids, mask, fused=True, compile_with=count_launches), want)
    assert graphs == [(1, 1)], graphs

    # Hidden states that are not the tensor the layer before returned (as a decoder that changes them between layers
    # would pass): every layer normalises its own input again, and the step still computes the model's.
    fused_forward = fused_module._fused_forward
    monkeypatch.setattr(fused_module, "_fused_forward", lambda *args: fused_forward(*args).clone())
    norms.clear()
    tables.clear()
    monkeypatch.setattr(kernels, "rms_norm", lambda *args: norms.append(1) or original(*args))
    assert_fp32_close(_draft_step(model, ids, mask, fused=True), want)
    assert len(norms) == model.config.num_hidden_layers
    assert len(tables) == model.config.num_hidden_layers - 1  # (the last layer hands nothing on: it reads them)


def test_a_layer_given_other_rotary_tables_than_its_predecessor_uses_its_own(monkeypatch):
    """The tables ride with the norm input only while the next layer gets the same `position_embeddings`: a layer
    given others (a decoder that changes them between layers) writes and reads its own."""
    model = _random_norms(tiny_model("llama")).to(DEVICE)
    assert model.config.num_hidden_layers >= 2
    ids, mask = (t.to(DEVICE) for t in ragged_batch([23, 17]))
    fused_forward = fused_module._fused_forward

    def with_tables(shift: bool, handed: bool):
        def forward(parts, cache, hidden_states, position_embeddings, carry, exchange):
            if parts.layer_idx == 1:
                if shift:
                    position_embeddings = tuple(t.roll(1, dims=-1) for t in position_embeddings)
                if not handed:  # (another tensor: no norm input, nor tables, is taken from layer 0)
                    hidden_states = hidden_states.clone()
            return fused_forward(parts, cache, hidden_states, position_embeddings, carry, exchange)

        monkeypatch.setattr(fused_module, "_fused_forward", forward)
        return _draft_step(model, ids, mask, fused=True)

    unshifted, shifted = with_tables(shift=False, handed=True), with_tables(shift=True, handed=True)
    assert not torch.allclose(shifted, unshifted), "the shifted tables must change the step"
    assert_fp32_close(shifted, with_tables(shift=True, handed=False))


def test_a_chain_whose_layers_fold_their_norms_or_not_hands_each_what_it_can_take(monkeypatch):
    """A layer that folds its norms before one that does not hands it the tables but no norm input (nor the norm
    factors of its own last norm): the step is still the model's."""
    model = _random_norms(tiny_model("llama")).to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in ragged_batch([23, 17]))
    standard = fused_module.layer_parts

    def second_keeps_its_norms(layer):
        parts = standard(layer)
        if parts is not None and parts.layer_idx == 1:
            parts = dataclasses.replace(parts, fold_norms=False)
        return parts

    monkeypatch.setattr(fused_module, "layer_parts", second_keeps_its_norms)
    norms = []
    original = kernels.rms_norm
    monkeypatch.setattr(kernels, "rms_norm", lambda *args: norms.append(1) or original(*args))
    assert_fp32_close(_draft_step(model, ids, mask, fused=True), _draft_step(model, ids, mask, fused=False))
    # layer 0's input norm, layer 1's two, and layer 2's input norm (layer 1 writes none for it)
    assert model.config.num_hidden_layers == 3 and len(norms) == 4


def test_norms_stay_launches_in_fp16_and_at_widths_no_block_divides(monkeypatch):
    """A hidden size of 72 (no block of 16) and fp16 (whose range `h * norm_weight` could exceed) keep each norm a
    launch of its own (the rotary tables are still written once and handed on): the draft step is still the model's,
    and generation vanilla's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=72, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    wide = _random_norms(LlamaForCausalLM(config).eval()).to(DEVICE)
    assert not layer_parts(wide.model.layers[0]).fold_norms
    assert not layer_parts(tiny_model("llama").half().model.layers[0]).fold_norms
    assert layer_parts(tiny_model("llama").bfloat16().model.layers[0]).fold_norms
    ids, mask = (t.to(DEVICE) for t in ragged_batch([23, 17]))
    norms, tables = [], []
    original, original_tables = kernels.rms_norm, fused_module._rope_tables
    monkeypatch.setattr(kernels, "rms_norm", lambda *args: norms.append(1) or original(*args))
    monkeypatch.setattr(fused_module, "_rope_tables", lambda *args: tables.append(1) or original_tables(*args))
    assert_fp32_close(_draft_step(wide, ids, mask, fused=True), _draft_step(wide, ids, mask, fused=False))
    assert len(norms) == 2 * config.num_hidden_layers
    assert len(tables) == 1, "the rotary tables are handed on all the same"
    common = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    vegas = wide.generate(ids, **common, custom_generate="vegas", vegas_backend="triton", vegas_cuda_graphs=False,
                          vegas_gamma=2, vegas_sparsity=0.3, vegas_min_tokens=4)
    assert torch.equal(vegas, wide.generate(ids, **common))


@pytest.mark.parametrize("arch,do_sample", [("llama", False), ("llama", True), ("qwen3", False), ("qwen3", True)])
def test_generation_with_fused_layers_gives_what_the_model_s_layers_give(monkeypatch, arch, do_sample):
    """In fp32 the fused drafts, verifications and dense steps differ from the model's own by rounding only: greedy
    accepts the same drafts and gives the same tokens, and sampling with one seed draws the same tokens (the draft
    probabilities it uses are the fused drafts' own). Greedy tokens against vanilla, through the fused layers:
    `test_triton_backend.py` (llama, qwen3)."""
    monkeypatch.setattr(fused_module, "FULL_STEP_MIN_BATCH", 2)  # (the test's batch: verifications fuse too)
    calls = []
    original = kernels.qkv_rope_write
    monkeypatch.setattr(kernels, "qkv_rope_write", lambda *args: calls.append(args[0].shape[1]) or original(*args))
    model = _random_norms(tiny_model(arch)).to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in ragged_batch([30, 21]))
    common = dict(attention_mask=mask, max_new_tokens=8, do_sample=do_sample, pad_token_id=0, top_k=0,
                  custom_generate="vegas", vegas_backend="triton", vegas_cuda_graphs=False, vegas_gamma=3,
                  vegas_sparsity=0.3, vegas_min_tokens=4, return_dict_in_generate=True)
    torch.manual_seed(3)
    fused = model.generate(ids, **common)
    assert {1, 4} <= set(calls), "the draft steps and the verifications (4 tokens) ran the fused layers"
    calls.clear()
    torch.manual_seed(3)
    plain = model.generate(ids, **common, vegas_fuse_projections=False)
    assert not calls
    assert torch.equal(fused.sequences, plain.sequences)
    assert torch.equal(fused.accepted, plain.accepted)
    assert not any("forward" in vars(m) for m in model.modules())


def test_the_oracle_policy_keeps_the_models_own_layers():
    """A fused layer calls the sparse kernel itself, past the attention function where the oracle chooses each draft
    step's slots: with that policy the layers keep their forward (the projections may still fuse)."""
    model = tiny_model("llama")
    for policy, patched in (("vegas", True), ("oracle", False)):
        cache = VegasCache(model.config, 1, 40, VegasConfig(policy=policy), device="cpu")
        with fused_steps(model, cache, enabled=True):
            layers = model.model.layers
            assert all(("forward" in layer.__dict__) == patched for layer in layers), policy
        assert not any("forward" in layer.__dict__ for layer in model.model.layers)


def test_programmatic_dependent_launch_is_off_where_the_gpu_cannot_take_it():
    """The CPU interpreter gets no launch option and kernels that never wait (the counterpart of the GPU test
    below, which runs the same generation with the launches overlapped)."""
    from hf_vegas_kernels import _launch

    assert not _launch.pdl(torch.device("cpu")) and _launch.pdl_launch(torch.device("cpu")) == {}


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a CUDA GPU of compute capability 9.0 or later")
@pytest.mark.parametrize("do_sample", [False, True])
def test_overlapped_launches_in_graphs_change_nothing(monkeypatch, do_sample):
    """Fused draft layers, verification and dense steps replayed as CUDA graphs whose kernels launch as programmatic
    dependents give the same tokens and acceptance as the same graphs without (fp32, one seed): with the next kernel
    released after the main loop or right after the wait, with and without L2 prefetches before the wait (the CPU
    counterpart: `kernels/tests/test_kernels_pdl.py` reads the compiled variants)."""
    from hf_vegas_kernels import _launch

    model = tiny_model("llama").to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in ragged_batch([30, 21]))
    common = dict(attention_mask=mask, max_new_tokens=12, do_sample=do_sample, pad_token_id=0, top_k=0,
                  custom_generate="vegas", vegas_backend="triton", vegas_cuda_graphs=True, vegas_gamma=3,
                  vegas_sparsity=0.3, vegas_min_tokens=4, return_dict_in_generate=True)
    runs = {}
    for options in ((1, 1, 1), (1, 0, 0), (1, 1, 0), (1, 0, 1), (0, 1, 1)):
        for option, value in zip(("enabled", "early_trigger", "prefetch_weights"), options):
            monkeypatch.setitem(_launch.PDL, option, value)
        assert _launch.pdl(torch.device(DEVICE)) == bool(options[0])
        tiny_weight = [model.model.layers[0].mlp.down_proj.weight]
        assert _launch.prefetch_weights(torch.device(DEVICE), tiny_weight) == bool(options[0] and options[2])
        torch.manual_seed(3)
        runs[options] = model.generate(ids, **common)
        hf_vegas.release_graphs(model)  # the next run captures its own graphs
    for options, run in runs.items():
        assert torch.equal(run.sequences, runs[0, 1, 1].sequences), options
        assert torch.equal(run.accepted, runs[0, 1, 1].accepted), options
