"""Every `GenerationConfig` field and every `generate` argument through hf_vegas: the same output as vanilla, the same
sampled distribution, or a clear error before any forward.

The classification is checked against transformers' own `GenerationConfig` and `generate` signature, so a field a
new release adds fails `test_every_generation_config_field_is_classified` until it is placed here.
"""

import inspect

import pytest
import torch
from transformers import (
    CompileConfig,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    WatermarkingConfig,
)
from transformers.generation.utils import GenerationMixin

import hf_vegas
from hf_vegas._compat.internals import CACHE_KEYWORD
import test_entry_points
import test_real_model
from distribution import chi_square_p_value, exact_distribution, vegas_samples
from tiny_models import ragged_batch, tiny_model

IDS, MASK = ragged_batch([20, 12])
# Tiny Llama's greedy rows are [122, 34, ...] and [102, 102, ...]: EOS 34 ends the first row early, so the length
# and EOS fields change the output, and the second row runs on alone.
BASE = dict(attention_mask=MASK, max_new_tokens=10, pad_token_id=0, eos_token_id=34, return_dict_in_generate=True,
            output_scores=True, output_logits=True)
SPARSE = dict(vegas_gamma=3, vegas_sparsity=0.1, vegas_min_tokens=2)
ENTRIES = {"callable": hf_vegas.generate, "short_name": "vegas"}

# Honoured: the same tokens, scores and logits as vanilla greedy, and a different output than without the field.
HONOURED = {
    "max_length": dict(max_new_tokens=None, max_length=27),
    "max_new_tokens": dict(max_new_tokens=6),
    "min_length": dict(min_length=27),
    "min_new_tokens": dict(min_new_tokens=5),
    "max_time": dict(max_time=0.0),  # the time is up after the first token, in both
    "eos_token_id": dict(eos_token_id=[34, 102]),
    "pad_token_id": dict(pad_token_id=3),
    "forced_eos_token_id": dict(forced_eos_token_id=7),
    "repetition_penalty": dict(repetition_penalty=1.5),
    "encoder_repetition_penalty": dict(encoder_repetition_penalty=1.5),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "bad_words_ids": dict(bad_words_ids=[[102], [28, 113]]),
    "suppress_tokens": dict(suppress_tokens=[34]),
    "begin_suppress_tokens": dict(begin_suppress_tokens=[122, 102]),
    "sequence_bias": dict(sequence_bias={(102,): -5.0}),
    "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(2, 3.0)),
    "renormalize_logits": dict(renormalize_logits=True),  # changes the scores, not the tokens
    "watermarking_config": dict(watermarking_config=WatermarkingConfig(bias=2.5)),
    "output_scores": dict(output_scores=False),  # the three output switches: what is returned
    "output_logits": dict(output_logits=False),
    "return_dict_in_generate": dict(return_dict_in_generate=False),
}
# Honoured, with no visible effect on this input (the test still compares tokens, scores and logits with vanilla).
HONOURED_QUIETLY = {
    "remove_invalid_values": dict(remove_invalid_values=True),  # no NaN or inf to remove
    "do_sample": dict(do_sample=False),  # greedy, explicitly; sampling is SAME_DISTRIBUTION's
    "use_cache": dict(use_cache=True),
    "cache_implementation": dict(cache_implementation="static"),  # also "dynamic", in test_cache_implementations
    "max_cache_len": dict(cache_implementation="static", max_cache_len=96),
    "num_return_sequences": dict(num_return_sequences=1),  # > 1: vanilla greedy refuses; sampling in test_entry_points
    "bos_token_id": dict(bos_token_id=1),  # used only without a prompt
    "forced_bos_token_id": dict(forced_bos_token_id=7),  # forces the first token of an empty history only
    "disable_compile": dict(disable_compile=True),
    "low_memory": dict(low_memory=True),
    "prefill_chunk_size": dict(prefill_chunk_size=8),  # the prompt in forwards of 8 positions, vanilla's as ours
}
# Read by vanilla only in decoding modes hf_vegas refuses (beams, an assistant model, encoder-decoder models): without
# them vanilla ignores the field, and so does hf_vegas. The test checks both outputs equal the output without it.
IGNORED_BY_VANILLA_TOO = {
    "length_penalty": dict(length_penalty=2.0),
    "early_stopping": dict(early_stopping=True),
    "num_beam_groups": dict(num_beam_groups=2),
    "diversity_penalty": dict(diversity_penalty=0.5),
    "num_assistant_tokens": dict(num_assistant_tokens=3),
    "num_assistant_tokens_schedule": dict(num_assistant_tokens_schedule="heuristic"),
    "assistant_confidence_threshold": dict(assistant_confidence_threshold=0.2),
    "assistant_lookbehind": dict(assistant_lookbehind=5),
    "target_lookbehind": dict(target_lookbehind=5),
    "max_matching_ngram_size": dict(max_matching_ngram_size=3),
    "assistant_ensemble_weight": dict(assistant_ensemble_weight=0.5),
    "speculation_type": dict(speculation_type="dflash"),
    "decoder_start_token_id": dict(decoder_start_token_id=3),
    "encoder_no_repeat_ngram_size": dict(encoder_no_repeat_ngram_size=2),
}
# Sampling fields: the distribution of Vegas samples against vanilla's exact one (chi-square).
SAME_DISTRIBUTION = {  # each on top of `sampling_setup`'s plain sampling (top-k 8 at temperature 0.1)
    "temperature": dict(temperature=0.2),
    "top_k": dict(top_k=4),
    "top_p": dict(top_p=0.7),
    "min_p": dict(min_p=0.3),
    "typical_p": dict(typical_p=0.7),
    "epsilon_cutoff": dict(epsilon_cutoff=0.1),
    "eta_cutoff": dict(eta_cutoff=0.3),
    "top_h": dict(top_h=0.2),
}
# Refused before any forward, with an error naming the field.
REFUSED = {
    "num_beams": dict(num_beams=2),
    "constraints": dict(constraints=[[5]]),  # constrained beam search (its classes left transformers 5)
    "force_words_ids": dict(force_words_ids=[[5]]),
    "penalty_alpha": dict(penalty_alpha=0.6, top_k=4),
    "prompt_lookup_num_tokens": dict(prompt_lookup_num_tokens=3),
    "assistant_early_exit": dict(assistant_early_exit=2),
    "use_mtp": dict(use_mtp=True),
    "dola_layers": dict(dola_layers="high"),
    "guidance_scale": dict(guidance_scale=1.5),
    "output_attentions": dict(output_attentions=True),
    "output_hidden_states": dict(output_hidden_states=True),
    "cache_config": dict(cache_implementation="static", cache_config={"max_batch_size": 2}),
    "compile_config": dict(compile_config=CompileConfig()),
    "continuous_batching_config": dict(continuous_batching_config={}),
}
# Need a tokenizer: tested on the real SmolLM2 (module, test).
WITH_A_TOKENIZER = {
    "stop_strings": (test_real_model, "test_stop_strings_and_text_streamer"),
    "token_healing": (test_real_model, "test_token_healing_matches_vanilla"),
}
# Not options: bookkeeping of the config itself, or a flag transformers sets on an assistant model's config.
NOT_OPTIONS = {"_from_model_config", "transformers_version", "is_assistant"}

CLASSES = (HONOURED, HONOURED_QUIETLY, IGNORED_BY_VANILLA_TOO, SAME_DISTRIBUTION, REFUSED, WITH_A_TOKENIZER,
           NOT_OPTIONS)


def test_every_generation_config_field_is_classified():
    fields = set(GenerationConfig().to_dict())
    classified = [name for group in CLASSES for name in group]
    assert len(classified) == len(set(classified)), "a field is in two classes"
    assert fields - set(classified) == set(), "fields of this transformers release that no test covers"
    # Fields of other releases may be missing here; the ones this release has must be covered.
    unknown = set(classified) - fields - {"use_mtp", "speculation_type", "top_h", "continuous_batching_config"}
    assert unknown == set()


def _generate(model, entry, ids=IDS, **kwargs):
    custom = {} if entry is None else dict(custom_generate=ENTRIES[entry], **SPARSE)
    torch.manual_seed(0)
    return model.generate(ids, **kwargs, **custom)


def _assert_same(out, expected, eos=(34,), pad=0, filler=True):
    """Tokens equal; scores and logits close wherever the row still decoded. After a row's EOS, vanilla scores the
    pad tokens it feeds and hf_vegas returns the pad-certain filler (`hf_vegas.output.StepRecorder`)."""
    if isinstance(expected, torch.Tensor):
        assert torch.equal(out, expected)
        return
    assert torch.equal(out.sequences, expected.sequences)
    for name in ("scores", "logits"):
        got, want = getattr(out, name), getattr(expected, name)
        assert (got is None) == (want is None), name
        if want is None:
            continue
        assert len(got) == len(want), name
        got, want = torch.stack(got, dim=1), torch.stack(want, dim=1)  # (B, steps, V)
        generated = expected.sequences[:, expected.sequences.shape[1] - want.shape[1]:]
        ended = torch.isin(generated, torch.tensor(list(eos))).long().cumsum(dim=1)
        live = torch.cat([torch.ones_like(ended[:, :1]), ended[:, :-1] == 0], dim=1).bool()
        torch.testing.assert_close(got[live], want[live], rtol=1e-4, atol=1e-4)
        if filler:
            certain_pad = torch.full_like(got[0, 0], float("-inf"))
            certain_pad[pad] = 0.0
            assert torch.equal(got[~live], certain_pad.expand_as(got[~live]))


def _differs(a, b, eos, pad) -> bool:
    """Whether two generate results differ in kind, tokens, scores or logits."""
    if type(a) is not type(b):
        return True
    try:
        _assert_same(a, b, eos, pad, filler=False)
    except AssertionError:
        return True
    return False


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("field", list(HONOURED) + list(HONOURED_QUIETLY))
def test_honoured_field_gives_vanilla_output(model, field, entry):
    kwargs = dict(BASE, **{**HONOURED, **HONOURED_QUIETLY}[field])
    ids = IDS
    if field == "forced_bos_token_id":  # vanilla forces it where the history is one token long
        ids, kwargs["attention_mask"] = IDS[:, -1:], MASK[:, -1:]
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    eos = kwargs["eos_token_id"] if isinstance(kwargs["eos_token_id"], list) else [kwargs["eos_token_id"]]
    expected = _generate(model, None, ids, **kwargs)
    _assert_same(_generate(model, entry, ids, **kwargs), expected, eos, kwargs["pad_token_id"])
    if field in HONOURED and entry == "callable":  # the field must matter, or the comparison proves nothing
        without = _generate(model, None, ids, **BASE)
        assert _differs(expected, without, eos, kwargs["pad_token_id"])


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("field", list(IGNORED_BY_VANILLA_TOO))
def test_field_vanilla_ignores_here_is_ignored_alike(model, field, entry):
    expected = _generate(model, None, **BASE)
    _assert_same(_generate(model, None, **BASE, **IGNORED_BY_VANILLA_TOO[field]), expected, filler=False)
    _assert_same(_generate(model, entry, **BASE, **IGNORED_BY_VANILLA_TOO[field]), expected)


@pytest.mark.parametrize("cache_implementation", [None, "dynamic", "static"])
def test_cache_implementations_that_only_choose_vanilla_storage(model, cache_implementation):
    kwargs = dict(BASE, cache_implementation=cache_implementation)
    expected = _generate(model, None, **kwargs)
    for entry in ENTRIES:
        _assert_same(_generate(model, entry, **kwargs), expected)


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("field", list(REFUSED))
def test_refused_field_raises_before_any_forward(model, field, entry):
    forwards = []
    handle = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=field):
            _generate(model, entry, **dict(BASE, **REFUSED[field]))
    finally:
        handle.remove()
    assert forwards == []


@pytest.fixture(scope="module")
def sampling_setup():
    model = tiny_model("llama", seed=3)
    prompt = torch.randint(1, 128, (1, 48), generator=torch.Generator().manual_seed(3))
    # The tiny model's logits are flat: a low temperature makes each field cut visibly, and top-k keeps the number
    # of 3-token paths the exact distribution enumerates small.
    plain = dict(do_sample=True, top_k=8, temperature=0.1)
    return model, prompt, plain, exact_distribution(model, prompt, plain)


@pytest.mark.parametrize("field", list(SAME_DISTRIBUTION))
def test_sampling_field_keeps_vanilla_distribution(sampling_setup, field):
    model, prompt, plain, without = sampling_setup
    sampling = dict(plain, **SAME_DISTRIBUTION[field])
    expected = exact_distribution(model, prompt, sampling)
    tv = 0.5 * sum(abs(expected.get(k, 0.0) - without.get(k, 0.0)) for k in set(expected) | set(without))
    assert tv > 0.05, f"{field} must change the distribution for the test to see it applied (TV {tv:.3f})"
    counts, out = vegas_samples(model, prompt, sampling, vegas_gamma=2, vegas_sparsity=0.05, vegas_min_tokens=2)
    p_value = chi_square_p_value(counts, expected, sum(counts.values()))
    print(f"{field}: p={p_value:.3g} TV to plain sampling {tv:.3f} tokens/iteration={out.tokens_per_iteration:.2f}")
    assert p_value > 1e-3


@pytest.mark.parametrize("field", list(WITH_A_TOKENIZER))
def test_fields_needing_a_tokenizer_have_their_real_model_test(field):
    module, name = WITH_A_TOKENIZER[field]
    assert callable(getattr(module, name, None)), f"{field}: {module.__name__}.{name} is missing"


# `generate`'s own parameters and the keyword arguments it takes besides GenerationConfig fields.
GENERATE_ARGUMENTS = {
    "inputs": "test_generate_arguments_identical[inputs]",
    "generation_config": "test_generate_arguments_identical[generation_config]",
    "logits_processor": "test_generate_arguments_identical[logits_processor]",
    "stopping_criteria": "test_generate_arguments_identical[stopping_criteria]",
    "prefix_allowed_tokens_fn": "test_generate_arguments_identical[prefix_allowed_tokens_fn]",
    "negative_prompt_ids": "test_generate_arguments_identical[negative_prompt_ids] (read with guidance_scale only)",
    "negative_prompt_attention_mask": "as negative_prompt_ids",
    "synced_gpus": "test_errors.py (True is refused); False: test_generate_arguments_identical[synced_gpus]",
    "assistant_model": "test_errors.py, test_entry_points.py (refused: hf_vegas drafts with the model itself)",
    "streamer": "test_entry_points.py::test_streamer_receives_prompt_then_every_token_in_order",
    "custom_generate": "every test here",
    "attention_mask": "every test here",
    "inputs_embeds": "test_generate_features.py",
    CACHE_KEYWORD: "test_generate_features.py",
    "tokenizer": "WITH_A_TOKENIZER",
}


class _Boost(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores + (input_ids.shape[1] % 5 == 0) * torch.arange(scores.shape[-1], dtype=scores.dtype)


class _StopAtLength(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 26, dtype=torch.bool)


ARGUMENT_CASES = {
    "inputs": dict(),  # positional, as everywhere here
    "generation_config": dict(generation_config=GenerationConfig(max_new_tokens=7, repetition_penalty=1.3,
                                                                 pad_token_id=0, eos_token_id=34)),
    "logits_processor": dict(logits_processor=LogitsProcessorList([_Boost()])),
    "stopping_criteria": dict(stopping_criteria=StoppingCriteriaList([_StopAtLength()])),
    "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=lambda row, ids: [5, 7, int(ids[-1]) % 128]),
    "negative_prompt_ids": dict(negative_prompt_ids=IDS[:, :3]),
    "synced_gpus": dict(synced_gpus=False),
}


def test_every_generate_argument_is_classified():
    parameters = set(inspect.signature(GenerationMixin.generate).parameters) - {"self", "kwargs"}
    assert parameters - set(GENERATE_ARGUMENTS) == set()
    assert callable(test_entry_points.test_streamer_receives_prompt_then_every_token_in_order)


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("argument", list(ARGUMENT_CASES))
def test_generate_arguments_identical(model, argument, entry):
    kwargs = dict(BASE, **ARGUMENT_CASES[argument])
    if argument == "generation_config":  # the config carries what BASE would set as keyword arguments
        kwargs = dict(attention_mask=MASK, generation_config=kwargs["generation_config"])
    expected = _generate(model, None, **kwargs)
    _assert_same(_generate(model, entry, **kwargs), expected)
