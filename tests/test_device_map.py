"""A model whose layers sit on several devices (accelerate's `device_map="auto"` over GPUs, `hf_vegas.placement`).

The cache keeps a copy of the step plan and selection per device, which follows the first device's at that
device's first layer of each forward. Two CPU "devices" cannot run a `device_map`, so these tests place the tiny
models' layers on distinct CPU device indices ("cpu:1", "cpu:2": tensors on them are ordinary CPU tensors, but the
cache keys its copies by them and really copies). Generation must then be exactly what it is on one device: the
same tokens, the same acceptances (so the same selections, made and read on each layer's copy), and vanilla's
greedy tokens. (On the CPU the copies cannot catch a tensor left on the wrong device: `cpu:1` tensors are CPU tensors.
The two-GPU test at the end, which skips here, is the same check across real devices.)
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import generation_cache, ragged_batch, tiny_model

import hf_vegas
from hf_vegas.assisted import assisted_generate
from hf_vegas import placement

# Layer 0 away from the prompt's device (the main state then holds a middle layer), the last layers away, or every
# layer on one device that is not the prompt's (the main state then holds no layer).
SPREAD = {"llama": ["cpu:1", "cpu", "cpu:2"], "gemma3": ["cpu"] * 3 + ["cpu:1"] * 3,
          "mistral_short_window": ["cpu", "cpu:1"], "llama, every layer away": ["cpu:1"] * 3}


def _spread(monkeypatch, placing):
    devices = [torch.device(d) for d in SPREAD[placing]]
    monkeypatch.setattr(placement, "layer_devices", lambda model: devices)
    return devices


@pytest.mark.parametrize("policy", ["vegas", "last_token", "streaming"])
@pytest.mark.parametrize("placing", list(SPREAD))
def test_layers_on_several_devices_generate_as_on_one(placing, policy, monkeypatch, short_windows_draft):
    arch = placing.split(",")[0]
    model = tiny_model(arch)
    ids, mask = ragged_batch([30, 21, 26])
    common = dict(attention_mask=mask, max_new_tokens=12, pad_token_id=0, custom_generate="vegas", vegas_gamma=3,
                  vegas_sparsity=0.2, vegas_min_tokens=8, vegas_policy=policy, return_dict_in_generate=True)
    vanilla = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)

    def run():
        greedy = model.generate(ids, **common, do_sample=False)
        torch.manual_seed(3)
        sampled = model.generate(ids, **common, do_sample=True, temperature=0.8)
        return greedy, sampled

    one, one_sampled = run()
    devices = _spread(monkeypatch, placing)
    spread, spread_sampled = run()

    assert torch.equal(spread.sequences, vanilla), "greedy stays vanilla's"
    assert torch.equal(spread.accepted, one.accepted), "the copies select as the one-device state does"
    assert torch.equal(spread_sampled.sequences, one_sampled.sequences)
    assert torch.equal(spread_sampled.accepted, one_sampled.accepted)
    assert (one.accepted[one.accepted >= 0] < 3).any(), "some drafts rejected: the drafts ran sparse"

    cache, alone = generation_cache(model, spread), generation_cache(model, one)
    assert cache.spread and len(cache.states()) == len(set(devices) | {torch.device("cpu")})
    main = cache.selection
    for layer in alone.selection.sparse_layers:
        plan, own = cache.state(layer)
        assert own.device == devices[layer] and plan.device == devices[layer]
        assert layer in own.sparse_layers
        # the layer's next selection was made on its device's copy, and equals the one-device cache's
        assert torch.equal(own.sel_idx[layer], alone.selection.sel_idx[layer])
        if own is not main:
            assert layer not in main.sparse_layers and not main.sel_idx[layer].any(), "the main state is untouched"


def test_a_copy_that_does_not_follow_changes_the_acceptances(monkeypatch):
    """The check above can fail: copies whose selection never follows the main state's budgets draft from an
    empty selection (still lossless, but accepting less)."""
    model = tiny_model("llama")
    ids, mask = ragged_batch([30, 21, 26])
    common = dict(attention_mask=mask, max_new_tokens=12, pad_token_id=0, custom_generate="vegas", vegas_gamma=3,
                  vegas_sparsity=0.2, vegas_min_tokens=8, do_sample=False, return_dict_in_generate=True)
    one = model.generate(ids, **common)
    _spread(monkeypatch, "llama")
    monkeypatch.setattr(hf_vegas.selection_state.SelectionState, "follow", lambda self, main: None)
    stale = model.generate(ids, **common)
    assert not torch.equal(stale.accepted, one.accepted)


def test_a_device_whose_first_layer_skips_the_cache_still_follows(monkeypatch):
    """Mllama's cross-attention layers write no keys without images: the copy on the next device must catch up at
    whichever of its layers a forward reaches first, not at a fixed layer."""
    from transformers import AutoConfig, MllamaForCausalLM

    config = AutoConfig.for_model("mllama").text_config
    for key, value in dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2, cross_attention_layers=[2]).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = MllamaForCausalLM(config).eval()
    ids, mask = ragged_batch([30, 21, 26])
    common = dict(attention_mask=mask, max_new_tokens=12, pad_token_id=0, do_sample=False)
    vanilla = model.generate(ids, **common)
    vegas = dict(custom_generate="vegas", vegas_gamma=3, vegas_sparsity=0.2, vegas_min_tokens=8,
                 return_dict_in_generate=True)
    one = model.generate(ids, **common, **vegas)
    monkeypatch.setattr(placement, "layer_devices", lambda m: [torch.device(d) for d in ["cpu", "cpu", "cpu:1",
                                                                                         "cpu:1"]])
    spread = model.generate(ids, **common, **vegas)
    assert torch.equal(one.sequences, vanilla) and torch.equal(spread.sequences, vanilla)
    assert torch.equal(spread.accepted, one.accepted)


def test_hf_assisted_loop_with_layers_on_several_devices(monkeypatch):
    model = tiny_model("llama")
    ids, _ = ragged_batch([28])
    vanilla = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    _spread(monkeypatch, "llama")
    out = assisted_generate(model, ids, max_new_tokens=10, pad_token_id=0, vegas_gamma=3,
                                     vegas_sparsity=0.2, vegas_min_tokens=8)
    assert torch.equal(out, vanilla)


def test_layer_devices_reads_each_layer_from_its_weights():
    """One device: None (whatever `hf_device_map` says of a single device); a map over several: each layer's
    attention weights' device, layer by layer."""
    model = tiny_model("llama")
    assert placement.layer_devices(model) is None
    model.hf_device_map = {"": "cpu"}
    assert placement.layer_devices(model) is None
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.layers.2": 1,
                           "model.norm": 1, "lm_head": 1}
    model.model.layers[2].to("meta")  # (where the weights really are decides, not the map)
    assert placement.layer_devices(model) == [torch.device("cpu")] * 2 + [torch.device("meta")]
    cuda = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert placement.spread_reason(cuda, cuda[0]).startswith("the model's layers are on cuda:0, cuda:1 and its "
                                                             "inputs on cuda:0")
    assert placement.spread_reason(cuda[1:] * 3, cuda[0]) is not None, "every layer away from the inputs"
    assert placement.spread_reason([torch.device("cpu")] * 3, torch.device("cpu")) is None


def test_each_layer_runs_with_its_device_current(monkeypatch):
    """Triton launches on the current device: every layer's cache write and attention run under its own device."""
    from hf_vegas import attention, cache as cache_module

    model = tiny_model("llama")
    ids, mask = ragged_batch([20, 14])
    devices = _spread(monkeypatch, "llama")
    current = [torch.device("cpu")]
    seen = []  # (what ran, layer, the device current then)

    class Guard:
        def __init__(self, device):
            self.device = torch.device(device)

        def __enter__(self):
            current.append(self.device)

        def __exit__(self, *exc):
            current.pop()
            return False

    monkeypatch.setattr(placement, "device_guard", Guard)
    update, attend = cache_module.VegasLayer.update, attention.attend
    monkeypatch.setattr(cache_module.VegasLayer, "update", lambda self, *a, **k: seen.append(
        ("write", self.keys.device if self.is_initialized else None, current[-1])) or update(self, *a, **k))
    monkeypatch.setattr(attention, "attend", lambda cache, module, *a: seen.append(
        ("attend", module.layer_idx, current[-1])) or attend(cache, module, *a))
    model.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, custom_generate="vegas",
                   vegas_gamma=2, vegas_sparsity=0.2, vegas_min_tokens=8)
    attends = [(layer, device) for what, layer, device in seen if what == "attend"]
    assert attends and all(device == devices[layer] for layer, device in attends)
    writes = [device for what, _, device in seen if what == "write"]
    assert writes.count(torch.device("cpu:1")) == writes.count(torch.device("cpu:2")) == writes.count(
        torch.device("cpu")) > 0, "each of the three layers writes under its own device"


def _two_gpu_map(model) -> dict:
    """Half the layers on GPU 0 (with the embeddings), half on GPU 1 (with the final norm, and the LM head unless
    it is the embedding: then the logits come from GPU 0)."""
    layers = len(model.model.layers)
    placed = {f"model.{name}": (1 if name == "norm" else 0) for name, _ in model.model.named_children()
              if name != "layers"}
    placed.update({f"model.layers.{i}": int(i >= layers // 2) for i in range(layers)})
    return {**placed, "lm_head": 0 if model.config.get_text_config(decoder=True).tie_word_embeddings else 1}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_device_map_over_two_gpus_is_vanilla_and_selects_as_one_gpu(arch, tmp_path):
    """The GPU counterpart of the tests above: accelerate places the layers on two GPUs, the Triton kernels run on
    each layer's device, and the tokens and acceptances are those of the same model on one GPU."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (CPU counterpart: test_layers_on_several_devices_generate_as_on_one)")
    from transformers import AutoModelForCausalLM

    tiny_model(arch).save_pretrained(tmp_path)
    one = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).to("cuda:0").eval()
    spread = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                  device_map=_two_gpu_map(one)).eval()
    assert placement.layer_devices(spread)[0] != placement.layer_devices(spread)[-1]
    ids, mask = (t.to("cuda:0") for t in ragged_batch([40, 27, 33]))
    common = dict(attention_mask=mask, max_new_tokens=16, pad_token_id=0, custom_generate="vegas", vegas_gamma=3,
                  vegas_sparsity=0.2, vegas_min_tokens=8, return_dict_in_generate=True)
    vanilla = spread.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    outs = {}
    for name, model in (("one", one), ("spread", spread)):
        greedy = model.generate(ids, **common, do_sample=False)
        torch.manual_seed(3)
        sampled = model.generate(ids, **common, do_sample=True, temperature=0.8)
        outs[name] = greedy, sampled
    (greedy, sampled), (one_greedy, one_sampled) = outs["spread"], outs["one"]
    assert torch.equal(greedy.sequences, vanilla)
    assert torch.equal(greedy.accepted, one_greedy.accepted)
    assert torch.equal(sampled.sequences, one_sampled.sequences)
    cache = generation_cache(spread, greedy)
    assert cache.backend == "triton" and cache.spread
    assert {layer.keys.device for layer in cache.layers} == {torch.device("cuda", 0), torch.device("cuda", 1)}


def test_a_model_with_any_layer_away_from_its_inputs_runs_eagerly():
    """Graphs are captured on one device: a layer on another device than the inputs (even all of them on one other
    device) means eager steps with the reason; layers all on the inputs' device keep the graphs."""
    from hf_vegas import graphs

    config, here, away = hf_vegas.VegasConfig(), torch.device("cuda", 0), torch.device("cuda", 1)
    for devices in ([away] * 3, [here, away, away]):
        assert "device_map" in graphs.no_graph_reason(config, here, devices)
    assert graphs.no_graph_reason(config, here, [here] * 3) is None
    assert graphs.no_graph_reason(config, here, None) is None
