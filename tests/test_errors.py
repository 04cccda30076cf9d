"""Bad input fails before any forward pass with an error naming the argument; the model is left as it was."""

import sys

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StaticCache
from transformers.generation.utils import GenerationMixin

import hf_vegas
from hf_vegas import VegasConfig
from hf_vegas.assisted import assisted_generate
from hf_vegas._compat.internals import CACHE_KEYWORD
from tiny_models import ragged_batch, tiny_model


@pytest.fixture
def model_and_counter():
    model = tiny_model("llama")
    forwards = []
    handle = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    yield model, forwards
    handle.remove()


IDS, MASK = ragged_batch([20, 12])

BAD = [
    (dict(vegas_gamma=-1), "vegas_gamma"),
    (dict(vegas_gamma=0, vegas_sparsity=0.2), "vegas_sparsity"),
    (dict(vegas_gamma=0, vegas_policy="streaming"), "vegas_policy"),
    (dict(vegas_cuda_graphs="yes"), "vegas_cuda_graphs` must be True or False"),
    (dict(vegas_compile=True, vegas_cuda_graphs=False), "vegas_compile=True` compiles the captured steps"),
    (dict(vegas_gamma=2.5), "vegas_gamma"),
    (dict(vegas_gamma="Auto"), "or 'auto'"),
    (dict(vegas_gamma="6"), "or 'auto'"),
    (dict(vegas_sparsity=0.0), "vegas_sparsity"),
    (dict(vegas_sparsity=1.5), "vegas_sparsity"),
    (dict(vegas_min_tokens=0), "vegas_min_tokens"),
    (dict(vegas_budget_boost=0.5), "vegas_budget_boost"),
    (dict(vegas_budget_boost=float("inf")), "vegas_budget_boost"),
    (dict(vegas_budget_boost=True), "vegas_budget_boost"),
    (dict(vegas_gamma=0, vegas_budget_boost=3.0), "vegas_budget_boost"),
    (dict(vegas_score="softmax"), "vegas_score"),
    (dict(vegas_selection_heads="global"), "vegas_selection_heads"),
    (dict(vegas_gamma=0, vegas_selection_heads="all"), "vegas_selection_heads"),
    (dict(vegas_policy="quest"), "vegas_policy"),
    (dict(vegas_policy="oracle", vegas_score="logits"), "vegas_policy='oracle'"),
    (dict(vegas_backend="cuda"), "vegas_backend"),
    (dict(vegas_config="fast"), "vegas_config"),
    (dict(vegas_config={"gama": 3}), "gama"),
    (dict(num_beams=2), "num_beams"),
    (dict(cache_implementation="offloaded"), "cache_implementation"),
    (dict(use_cache=False), "use_cache"),
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    (dict(output_hidden_states=True, return_dict_in_generate=True), "output_hidden_states"),
    (dict(guidance_scale=1.5), "guidance_scale"),
    (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
    (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
    (dict(dola_layers="high"), "dola_layers"),
    (dict(assistant_early_exit=2), "assistant_early_exit"),
    (dict(force_words_ids=[[3]]), "force_words_ids"),
    (dict(prefill_chunk_size=0), "prefill_chunk_size"),
    (dict(prefill_chunk_size=2.5), "prefill_chunk_size"),
    (dict(synced_gpus=True), "synced_gpus"),
    (dict(token_type_ids=torch.zeros_like(IDS)), "token_type_ids"),
]


@pytest.mark.parametrize("entry", ["callable", "short_name"])
@pytest.mark.parametrize("kwargs,named", BAD, ids=[str(n) + "-" + str(k)[:30] for k, n in BAD])
def test_bad_input_raises_before_any_forward(model_and_counter, entry, kwargs, named):
    model, forwards = model_and_counter
    custom = hf_vegas.generate if entry == "callable" else "vegas"
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=named):
        model.generate(IDS, attention_mask=MASK, max_new_tokens=5, pad_token_id=0, custom_generate=custom, **kwargs)
    assert forwards == []
    assert model.config._attn_implementation == "sdpa"


def test_paged_cache_is_refused_by_the_string_form(model_and_counter):
    """`cache_implementation="paged"` makes transformers switch to continuous batching before any custom_generate
    callable runs (its own routing); the string form sees it first and refuses it."""
    model, forwards = model_and_counter
    with pytest.raises(ValueError, match="paged"):
        model.generate(IDS, attention_mask=MASK, max_new_tokens=5, custom_generate="vegas",
                       cache_implementation="paged")
    assert forwards == []


@pytest.mark.parametrize("entry", ["callable", "short_name"])
def test_misspelt_vegas_key_is_named_with_the_closest_key(model_and_counter, entry):
    """transformers would name the key only as a model input the model does not use (its check runs before a
    callable is called); hf_vegas names it with the closest key and lists the allowed ones."""
    model, forwards = model_and_counter
    custom = hf_vegas.generate if entry == "callable" else "vegas"
    with pytest.raises(ValueError) as raised:
        model.generate(IDS, attention_mask=MASK, max_new_tokens=5, custom_generate=custom, vegas_gama=3)
    message = str(raised.value)
    assert "'vegas_gama' (did you mean 'vegas_gamma'?)" in message
    assert "'vegas_sparsity'" in message and "'vegas_config'" in message and "model_kwargs" not in message
    assert forwards == []


def test_vegas_key_without_hf_vegas_says_which_custom_generate_reads_it(model_and_counter):
    model, forwards = model_and_counter
    with pytest.raises(ValueError, match='take effect only with `custom_generate="vegas"`'):
        model.generate(IDS, attention_mask=MASK, max_new_tokens=5, vegas_gamma=3)
    with pytest.raises(ValueError, match="model_kwargs"):  # other unused inputs keep transformers' message
        model.generate(IDS, attention_mask=MASK, max_new_tokens=5, gamma=3)
    assert forwards == []


SYNCED_FORMS = ["callable", "short_name", "assisted"]


def _generate_in(entry, model, **kwargs):
    if entry == "assisted":  # HF's own loop, batch 1
        return assisted_generate(model, IDS[:1], attention_mask=MASK[:1], max_new_tokens=5, pad_token_id=0, **kwargs)
    custom = hf_vegas.generate if entry == "callable" else "vegas"
    return model.generate(IDS, attention_mask=MASK, max_new_tokens=5, pad_token_id=0, custom_generate=custom, **kwargs)


@pytest.mark.parametrize("entry", SYNCED_FORMS)
def test_synced_gpus_is_refused_in_every_form(model_and_counter, entry):
    model, forwards = model_and_counter
    with pytest.raises(ValueError, match=r"does not support `synced_gpus=True`.*Allowed: `synced_gpus=False`"):
        _generate_in(entry, model, synced_gpus=True)
    assert forwards == []
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("entry", SYNCED_FORMS)
def test_synced_gpus_that_transformers_turns_on_by_itself_is_refused(model_and_counter, monkeypatch, entry):
    """Left unset, `synced_gpus` is turned on by transformers under DeepSpeed ZeRO-3 (or FSDP) with several processes,
    and a custom_generate callable is not told: hf_vegas asks transformers and refuses; `synced_gpus=False` runs."""
    model, forwards = model_and_counter
    utils = sys.modules[GenerationMixin.__module__]
    monkeypatch.setattr(utils, "is_deepspeed_zero3_enabled", lambda: True)  # as under ZeRO-3 ...
    monkeypatch.setattr(utils, "_get_torch_distributed_world_size", lambda: 2)  # ... over two processes
    with pytest.raises(ValueError, match="synced_gpus` \\(transformers turns it on by itself"):
        _generate_in(entry, model)
    assert forwards == []
    _generate_in(entry, model, synced_gpus=False)
    assert forwards


def test_a_prefilled_cache_other_than_dynamic_is_refused(model_and_counter):
    model, forwards = model_and_counter
    cache = StaticCache(config=model.config, max_cache_len=64)
    with torch.no_grad():
        model(IDS[:, :8], attention_mask=MASK[:, :8], **{CACHE_KEYWORD: cache})
    forwards.clear()
    with pytest.raises(ValueError, match=f"{CACHE_KEYWORD}` must be a prefilled DynamicCache"):
        model.generate(IDS, attention_mask=MASK, max_new_tokens=5, custom_generate="vegas", **{CACHE_KEYWORD: cache})
    assert forwards == []


def test_a_prompt_cache_holding_the_whole_prompt_is_refused(model_and_counter):
    model, forwards = model_and_counter
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(IDS, attention_mask=MASK, **{CACHE_KEYWORD: cache})
    forwards.clear()
    with pytest.raises(ValueError, match="at least one position the cache does not hold"):
        model.generate(IDS, attention_mask=MASK, max_new_tokens=5, custom_generate="vegas", **{CACHE_KEYWORD: cache})
    assert forwards == []


def test_right_padding_is_refused(model_and_counter):
    model, forwards = model_and_counter
    with pytest.raises(ValueError, match="left padding"):
        model.generate(IDS, attention_mask=MASK.flip(1), max_new_tokens=5, pad_token_id=0, custom_generate="vegas")
    assert forwards == []


def test_training_mode_is_refused(model_and_counter):
    model, forwards = model_and_counter
    model.train()
    with pytest.raises(ValueError, match="eval"):
        model.generate(IDS, attention_mask=MASK, max_new_tokens=5, pad_token_id=0, custom_generate="vegas")
    assert forwards == []


@pytest.mark.parametrize("device_map", [
    {"model.embed_tokens": "cuda:0", "model.layers": "cuda:0", "model.norm": "cpu", "lm_head": "cpu"},
    {"": 0, "lm_head": "disk"},
])
def test_a_model_offloaded_to_the_cpu_or_disk_is_refused(model_and_counter, device_map):
    """accelerate's `device_map` offloading to the CPU or disk (the map accelerate leaves on the model) is refused
    before any forward, pointing to one device, GPUs or tensor parallelism; layers on several GPUs pass
    (`tests/test_device_map.py`), and so does one device."""
    model, forwards = model_and_counter
    model.hf_device_map = device_map
    with pytest.raises(ValueError, match="spread over .* offloads .* tensor parallelism"):
        hf_vegas.generate(model, IDS, attention_mask=MASK, max_new_tokens=5, pad_token_id=0)
    with pytest.raises(ValueError, match="spread over .* offloads .* tensor parallelism"):
        assisted_generate(model, IDS[1:, -12:], max_new_tokens=5, pad_token_id=0)
    with pytest.raises(ValueError, match="spread over"):
        model.generate(IDS, attention_mask=MASK, max_new_tokens=5, pad_token_id=0, custom_generate="vegas")
    assert forwards == []
    model.hf_device_map = {"": "cpu"}
    model.generate(IDS, attention_mask=MASK, max_new_tokens=3, pad_token_id=0, custom_generate="vegas")
    assert forwards


def test_a_map_over_several_gpus_passes_the_checks(model_and_counter):
    """Layers on two GPUs are supported (`hf_vegas.placement`): the map alone refuses nothing (this tiny model's
    weights are all on the CPU, so it runs on one device)."""
    model, forwards = model_and_counter
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1,
                           "lm_head": 1}
    model.generate(IDS, attention_mask=MASK, max_new_tokens=3, pad_token_id=0, custom_generate="vegas")
    assert forwards


def test_hf_assisted_loop_refuses_a_chunked_prefill(model_and_counter):
    model, forwards = model_and_counter
    with pytest.raises(ValueError, match="prefill_chunk_size=8"):
        assisted_generate(model, IDS[1:, -12:], max_new_tokens=5, pad_token_id=0, prefill_chunk_size=8)
    assert forwards == []


def test_weights_left_on_another_device_are_refused(model_and_counter):
    """Without a device map: parameters on two devices (here one layer left on "meta", as offloading leaves it)."""
    model, forwards = model_and_counter
    model.model.layers[1].to("meta")
    with pytest.raises(ValueError, match="spread over cpu, meta"):
        model.generate(IDS, attention_mask=MASK, max_new_tokens=5, pad_token_id=0, custom_generate="vegas")
    assert forwards == []


def test_encoder_decoder_is_refused():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(config).eval()
    with pytest.raises(ValueError, match="decoder-only"):
        model.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=3, custom_generate=hf_vegas.generate)


def test_unsupported_attention_type_is_refused():
    """Bloom's attention (ALiBi) does not go through AttentionInterface, so it cannot be switched to drafting."""
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2)).eval()
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    with pytest.raises(ValueError, match="unsupported attention type"):
        model.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=3, custom_generate="vegas")
    assert forwards == [] and model.config._attn_implementation != "vegas"


def test_llama4_chunked_attention_is_refused_before_any_forward():
    """Llama 4's chunked attention (a window that restarts at each chunk boundary) is not supported: a clear error
    that names it and the chunk size, before any forward and with the model's attention untouched."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                              num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                              attention_chunk_size=8, num_local_experts=1, pad_token_id=0)
    model = Llama4ForCausalLM(config).eval()
    assert "chunked_attention" in config.layer_types
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    implementation = model.config._attn_implementation
    with pytest.raises(ValueError, match=r"'chunked_attention' \(Llama 4.*chunk of 8 positions.*vanilla generate"):
        model.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=3, custom_generate="vegas")
    assert forwards == [] and model.config._attn_implementation == implementation


def test_streamer_needs_batch_one(model_and_counter):
    from transformers.generation.streamers import BaseStreamer

    class Quiet(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            pass

    model, forwards = model_and_counter
    with pytest.raises(ValueError, match="streamer"):
        model.generate(IDS, attention_mask=MASK, max_new_tokens=5, pad_token_id=0, custom_generate=hf_vegas.generate,
                       streamer=Quiet())
    assert forwards == []


class Boom(LogitsProcessor):
    """Raises on its third call: in the middle of Vegas' first draft."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("boom")
        return scores


def test_model_is_restored_after_an_error_mid_way():
    model = tiny_model("llama")
    expected = model.generate(IDS, attention_mask=MASK, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with pytest.raises(RuntimeError, match="boom"):
        model.generate(IDS, attention_mask=MASK, max_new_tokens=8, pad_token_id=0, custom_generate="vegas",
                       logits_processor=LogitsProcessorList([Boom()]))
    assert model.config._attn_implementation == "sdpa"
    again = model.generate(IDS, attention_mask=MASK, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(again, expected)


def test_vegas_attention_outside_generation_is_a_clear_error():
    model = tiny_model("llama")
    model.set_attn_implementation("vegas")
    with pytest.raises(RuntimeError, match="only runs inside hf_vegas generation"):
        model(IDS)


def test_config_repr_and_dict():
    config = VegasConfig(gamma=3, policy="streaming")
    assert repr(config) == "VegasConfig(gamma=3, policy='streaming')"
    assert VegasConfig(**config.to_dict()) == config


def test_windows_too_short_to_draft_sparsely_on_every_layer_are_refused():
    """Mistral-v0.1/StarCoder2-style configs window every layer. A window shorter than the positions a generation
    reaches drafts sparsely only where its budget is under a quarter of it (tests/test_sliding_windows.py); at the
    default floor of 256 tokens a 24-slot window is not, so drafts would be the model itself."""
    from transformers import MistralConfig, MistralForCausalLM

    model = MistralForCausalLM(MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             sliding_window=24)).eval()
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    with pytest.raises(ValueError, match="sliding window of 24 positions, shorter than this generation's 37"):
        model.generate(IDS[:1], max_new_tokens=4, custom_generate="vegas")  # 20 + 4 + 2 * 6 + 1
    with pytest.raises(ValueError, match="vegas_min_tokens=256, vegas_sparsity=0.07: 24 slots"):
        model.generate(IDS[:1], max_new_tokens=4, custom_generate="vegas")
    assert forwards == []


def test_images_on_a_multimodal_class_are_refused_before_any_forward():
    """Text prompts on Gemma3ForConditionalGeneration run (tests/test_greedy_equivalence.py); images do not yet."""
    model = tiny_model("gemma3_multimodal")
    forwards = []
    handle = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    pixels = torch.zeros(2, 3, 28, 28)
    try:
        with pytest.raises(ValueError, match="image, audio and video inputs"):
            model.generate(IDS, attention_mask=MASK, pixel_values=pixels, max_new_tokens=5, pad_token_id=0,
                           custom_generate="vegas")
    finally:
        handle.remove()
    assert forwards == []


def test_an_empty_cache_the_user_passes_is_refused(model_and_counter):
    """Vanilla fills a cache the caller passes; hf_vegas decodes in its own and would leave it empty."""
    model, forwards = model_and_counter
    with pytest.raises(ValueError, match="empty DynamicCache"):
        model.generate(IDS, attention_mask=MASK, max_new_tokens=5, custom_generate="vegas",
                       **{CACHE_KEYWORD: DynamicCache(config=model.config)})
    assert forwards == []


def test_a_prompt_cache_of_another_batch_or_shape_is_refused(model_and_counter):
    model, forwards = model_and_counter
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(IDS[:1, :8], **{CACHE_KEYWORD: cache})
    forwards.clear()
    with pytest.raises(ValueError, match="holds a batch of 1 rows; the prompt has 2"):
        model.generate(IDS, attention_mask=MASK, max_new_tokens=5, custom_generate="vegas", **{CACHE_KEYWORD: cache})
    assert forwards == []
    # A cache already laid out (as a pooled one is) refuses a prompt cache of other heads.
    from hf_vegas import prompt_cache
    from hf_vegas.cache import VegasCache

    vegas = VegasCache(model.config, 1, 64, VegasConfig())
    for layer in vegas.layers:
        layer.lazy_initialization(torch.zeros(1, 2, 0, 16), torch.zeros(1, 2, 0, 16))
    other = DynamicCache(config=model.config)
    other.update(torch.zeros(1, 4, 8, 16), torch.zeros(1, 4, 8, 16), 0)
    for layer_idx in range(1, len(vegas.layers)):
        other.update(torch.zeros(1, 4, 8, 16), torch.zeros(1, 4, 8, 16), layer_idx)
    with pytest.raises(ValueError, match="has \\(heads, key dim, value dim\\) \\(4, 16, 16\\)"):
        prompt_cache.load(vegas, other, torch.zeros(1, dtype=torch.long))


def test_custom_position_ids_are_refused_and_standard_ones_accepted(model_and_counter):
    model, forwards = model_and_counter
    standard = (MASK.cumsum(-1) - 1).clamp_min(0)
    common = dict(attention_mask=MASK, max_new_tokens=5, pad_token_id=0)
    assert torch.equal(model.generate(IDS, **common, position_ids=standard, custom_generate="vegas"),
                       model.generate(IDS, **common, position_ids=standard))
    forwards.clear()
    with pytest.raises(ValueError, match="Custom `position_ids`"):
        model.generate(IDS, **common, position_ids=standard * 3, custom_generate="vegas")
    assert forwards == []


WITHOUT_TRITON = r"""
import sys
sys.modules["triton"] = None  # any import of Triton fails, as on a machine without it
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import hf_vegas
from hf_vegas.ops.backend import resolve_backend

assert resolve_backend("auto", torch.device("cuda")) == "torch"
try:
    resolve_backend("triton", torch.device("cuda"))
except ValueError as error:
    print("refused:", error)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
ids = torch.randint(1, 64, (1, 40))
out = model.generate(ids, max_new_tokens=6, do_sample=False, custom_generate="vegas", vegas_gamma=2)
print("identical:", bool((out == model.generate(ids, max_new_tokens=6, do_sample=False)).all()))
"""


def test_without_triton_the_plain_ops_run_and_asking_for_the_kernels_names_why():
    """On a machine without Triton hf_vegas imports, `"auto"` runs the plain-PyTorch ops (vanilla's tokens), and
    `vegas_backend="triton"` is refused with Triton's own import error in the message."""
    import subprocess

    run = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    refusal = "`vegas_backend='triton'` needs Triton and hf_vegas_kernels (ModuleNotFoundError: import of triton"
    assert refusal in run.stdout
    assert "identical: True" in run.stdout
