"""What users expect from `generate` beyond tokens, through all three entry points, against vanilla: per-step scores
and logits, a prompt given as embeddings, and a prompt cache the user prefilled (multi-turn reuse)."""

import copy

import pytest
import torch
from transformers import DynamicCache, TemperatureLogitsWarper, TopKLogitsWarper

import hf_vegas
from hf_vegas._compat.internals import CACHE_KEYWORD
from hub_folder import hub_folder
from tiny_models import BUILDERS, ragged_batch, tiny_model

SPARSE = dict(vegas_gamma=3, vegas_sparsity=0.1, vegas_min_tokens=2)
ENTRIES = {
    "callable": dict(custom_generate=hf_vegas.generate),
    "short_name": dict(custom_generate="vegas"),
    "hub_folder": dict(trust_remote_code=True),  # custom_generate: the exported folder, written at first use
}
IDS, MASK = ragged_batch([40, 25, 33])
COMMON = dict(attention_mask=MASK, max_new_tokens=10, pad_token_id=0)


def _vegas(model, entry, *args, **kwargs):
    return model.generate(*args, **kwargs, **_entry(entry), **SPARSE)


def _entry(entry: str) -> dict:
    return dict(ENTRIES[entry], custom_generate=hub_folder()) if entry == "hub_folder" else ENTRIES[entry]


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("gamma", [0, 3])
def test_scores_and_logits_match_vanilla(entry, gamma):
    model = tiny_model("qwen3")
    kwargs = dict(COMMON, return_dict_in_generate=True, output_scores=True, output_logits=True,
                  repetition_penalty=1.3)
    expected = model.generate(IDS, **kwargs)
    sparse = {"vegas_gamma": 0} if gamma == 0 else SPARSE  # gamma = 0 takes no selection settings
    out = model.generate(IDS, **kwargs, **_entry(entry), **sparse)
    assert torch.equal(out.sequences, expected.sequences)
    for name in ("scores", "logits"):
        got, want = torch.stack(getattr(out, name)), torch.stack(getattr(expected, name))
        assert got.shape == want.shape == (10, 3, 128)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.equal(torch.stack(out.scores), torch.stack(out.logits))  # the penalty was applied to scores


def test_sampled_scores_are_the_processed_scores_of_the_sampled_history():
    """Sampling: each step's scores are what vanilla's processors give for the history Vegas sampled (teacher
    forcing through the model with vanilla attention), and each kept token has a finite score."""
    model = tiny_model("llama")
    torch.manual_seed(0)
    out = model.generate(IDS, **COMMON, do_sample=True, temperature=0.7, top_k=20, return_dict_in_generate=True,
                         output_scores=True, output_logits=True, custom_generate="vegas", **SPARSE)
    active = out.accepted[out.accepted >= 0]
    assert (active > 0).any() and (active < SPARSE["vegas_gamma"]).any(), "accepted drafts and resampled tokens"
    width = IDS.shape[1]
    full_mask = torch.cat([MASK, torch.ones_like(out.sequences[:, width:])], dim=1)
    full_positions = (full_mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(out.sequences, attention_mask=full_mask, position_ids=full_positions).logits.float()
    raw = logits[:, width - 1 : -1]  # the logits that chose each generated token
    torch.testing.assert_close(torch.stack(out.logits, dim=1), raw, rtol=1e-4, atol=1e-4)
    history = out.sequences
    for step, scores in enumerate(out.scores):
        expected = TopKLogitsWarper(20)(history[:, : width + step], TemperatureLogitsWarper(0.7)(None, raw[:, step]))
        torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4)
        chosen = scores.gather(1, out.sequences[:, width + step, None])
        assert torch.isfinite(chosen).all()


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("arch", sorted(BUILDERS))
@pytest.mark.parametrize("with_ids", [False, True], ids=["embeds_only", "ids_and_embeds"])
def test_inputs_embeds_matches_vanilla(arch, with_ids, entry):
    model = tiny_model(arch)
    embeds = model.get_input_embeddings()(IDS)
    args = (IDS,) if with_ids else ()
    if arch == "gemma3_multimodal":  # vanilla refuses embeddings for this class; hf_vegas runs its preparation too
        with pytest.raises(ValueError, match="inputs_embeds") as vanilla_error:
            model.generate(*args, inputs_embeds=embeds, **COMMON)
        with pytest.raises(ValueError, match="inputs_embeds") as error:
            _vegas(model, entry, *args, inputs_embeds=embeds, **COMMON)
        assert str(error.value) == str(vanilla_error.value)
        return
    expected = model.generate(*args, inputs_embeds=embeds, **COMMON)
    assert expected.shape[1] == (IDS.shape[1] if with_ids else 0) + 10
    assert torch.equal(_vegas(model, entry, *args, inputs_embeds=embeds, **COMMON), expected)


def _prefilled(model, length: int) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(IDS[:, :length], attention_mask=MASK[:, :length], **{CACHE_KEYWORD: cache})
    return cache


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("cached", [12, 20])
@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_prefilled_prompt_cache_matches_vanilla(arch, cached, entry):
    """The transformers recipe for prompt reuse: prefill a DynamicCache once, generate from copies of it. With 12
    cached positions row 1's cached part is all padding (15 pads); with 20, gemma3's sliding layers hold only the
    last positions of their 16-token window."""
    model = tiny_model(arch)
    cache = _prefilled(model, cached)
    if arch == "gemma3" and cached == 20:
        assert cache.layers[0].keys.shape[2] < cached
    expected = model.generate(IDS, **COMMON, **{CACHE_KEYWORD: copy.deepcopy(cache)})
    before = [layer.keys.clone() for layer in cache.layers]
    assert torch.equal(_vegas(model, entry, IDS, **COMMON, **{CACHE_KEYWORD: cache}), expected)
    # hf_vegas copies the prompt cache and leaves it as it was (vanilla would extend it in place)
    assert all(torch.equal(layer.keys, old) for layer, old in zip(cache.layers, before))


def test_prompt_cache_with_embeddings_and_scores():
    model = tiny_model("llama")
    embeds = model.get_input_embeddings()(IDS)
    cache = _prefilled(model, 30)
    kwargs = dict(COMMON, inputs_embeds=embeds, return_dict_in_generate=True, output_scores=True)
    expected = model.generate(IDS, **kwargs, **{CACHE_KEYWORD: copy.deepcopy(cache)})
    out = _vegas(model, "short_name", IDS, **kwargs, **{CACHE_KEYWORD: cache})
    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(expected.scores), rtol=1e-4, atol=1e-4)


def test_token_healing_needs_ids_and_a_tokenizer():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        model.generate(IDS, **COMMON, token_healing=True, custom_generate="vegas")
