"""The three ways in (callable, "vegas", Hub-style folder), HF's own assisted loop, streaming and outputs."""

import pytest
import torch
from transformers import StoppingCriteria
from transformers.generation.streamers import BaseStreamer

import hf_vegas
from hf_vegas.assisted import assisted_generate
from hf_vegas._compat.internals import CACHE_KEYWORD
from hub_folder import hub_folder
from tiny_models import ragged_batch, tiny_model

SPARSE = dict(vegas_gamma=4, vegas_sparsity=0.1, vegas_min_tokens=8)


def test_three_entry_points_agree_with_vanilla():
    model = tiny_model("qwen3")
    ids, mask = ragged_batch([70, 52])
    common = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **common)
    assert torch.equal(model.generate(ids, **common, custom_generate=hf_vegas.generate, **SPARSE), expected)
    assert torch.equal(model.generate(ids, **common, custom_generate="vegas", **SPARSE), expected)
    hub = model.generate(ids, **common, custom_generate=hub_folder(), trust_remote_code=True, **SPARSE)
    assert torch.equal(hub, expected)
    config = hf_vegas.VegasConfig(gamma=4, sparsity=0.1, min_tokens=8)
    assert torch.equal(model.generate(ids, **common, custom_generate="vegas", vegas_config=config), expected)


def test_other_custom_generate_strings_keep_transformers_behaviour(tmp_path):
    import pytest

    model = tiny_model("llama")
    with pytest.raises(OSError):
        model.generate(torch.ones(1, 3, dtype=torch.long), custom_generate=str(tmp_path), trust_remote_code=True)


def test_hf_assisted_decoding_loop_with_vegas_drafter():
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 60), generator=torch.Generator().manual_seed(5))
    expected = model.generate(ids, max_new_tokens=20, do_sample=False)
    for policy in ("vegas", "last_token"):
        out = assisted_generate(model, ids, max_new_tokens=20, do_sample=False, vegas_policy=policy, **SPARSE)
        assert torch.equal(out, expected)
    assert model.config._attn_implementation == "sdpa"
    assert "_get_candidate_generator" not in vars(model)


def test_hf_assisted_loop_feeds_the_budget_boost(monkeypatch):
    """HF's loop reports each verification's matches to the drafter, which folds them into the boost's average."""
    from hf_vegas.selection_state import SelectionState

    seen = []
    original = SelectionState.note_acceptance

    def noted(self, accepted, active):
        seen.append((int(accepted[0]), float(self.rejection[0])))
        return original(self, accepted, active)

    monkeypatch.setattr(SelectionState, "note_acceptance", noted)
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 60), generator=torch.Generator().manual_seed(5))
    expected = model.generate(ids, max_new_tokens=20, do_sample=False)
    out = assisted_generate(model, ids, max_new_tokens=20, do_sample=False, vegas_budget_boost=3.0, **SPARSE)
    assert torch.equal(out, expected)
    assert seen and any(matches < 4 for matches, _ in seen[:-1]), "a rejection was noted"
    rejected_before = [r for _, r in seen[1:]]
    assert max(rejected_before) > 0, "the average rose after a rejection"


class Recorder(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_prompt_then_every_token_in_order():
    model = tiny_model("gemma3")
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(6))
    for custom in (hf_vegas.generate, "vegas"):
        streamer = Recorder()
        out = model.generate(ids, max_new_tokens=15, do_sample=False, custom_generate=custom, streamer=streamer,
                             **SPARSE)
        streamed = [t for chunk in streamer.chunks for t in chunk]
        assert streamed == out[0].tolist() and streamer.ended


def test_return_dict_reports_acceptance():
    model = tiny_model("mistral")
    ids, mask = ragged_batch([50, 30, 44])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                         eos_token_id=None, custom_generate="vegas", return_dict_in_generate=True, **SPARSE)
    assert isinstance(out, hf_vegas.VegasGenerateOutput)
    assert isinstance(getattr(out, CACHE_KEYWORD), hf_vegas.VegasCache)
    assert out.accepted.shape[0] == 3 and int(out.accepted.max()) <= 4
    # The statistics account for the output: the prefill's token plus each active iteration's accepted drafts and
    # bonus make each row's 12 tokens, and the row's last iteration was needed for them.
    for row in out.accepted:
        made = [int(a) + 1 for a in row if a >= 0]
        assert 1 + sum(made) >= 12 > 1 + sum(made[:-1])
    assert 1.0 <= out.tokens_per_iteration <= 5.0 and out.tokens_per_iteration > 1.0, "some drafts were accepted"


def test_a_returned_cache_is_freed_as_soon_as_it_is_dropped():
    """The cache's layers share its step plan, not the cache: no reference cycle, so dropping the output frees its
    gigabytes at once, without waiting for the garbage collector."""
    import gc
    import weakref

    model = tiny_model("llama")
    ids, mask = ragged_batch([30, 20])
    gc.disable()
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0, custom_generate="vegas",
                             return_dict_in_generate=True, **SPARSE)
        cache = weakref.ref(getattr(out, CACHE_KEYWORD))
        assert cache() is not None
        del out
        assert cache() is None, "the cache outlived its last reference"
    finally:
        gc.enable()


def test_num_return_sequences_with_sampling():
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(7))
    out = model.generate(ids, max_new_tokens=6, do_sample=True, num_return_sequences=3, custom_generate="vegas",
                         **SPARSE)
    assert out.shape == (6, 36)
    assert torch.equal(out[:3, :30], ids[:1].repeat(3, 1))


def test_assisted_loop_refuses_what_it_cannot_do():
    model = tiny_model("llama")
    ids, _ = ragged_batch([20])
    for kwargs, named in ((dict(vegas_gamma=0), "vegas_gamma=0"), (dict(vegas_compile=True), "vegas_compile=True")):
        with pytest.raises(ValueError, match=named):
            assisted_generate(model, ids, max_new_tokens=4, **kwargs)


def _spy_on_generate(monkeypatch, model) -> dict:
    """The keyword arguments of the `model.generate` calls made from here on (the string form's inner call)."""
    seen = {}
    original = type(model).generate

    def spy(self, *args, **kwargs):
        seen.update(kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "generate", spy)
    return seen


def test_string_form_passes_explicit_none_and_falsy_arguments_unchanged(monkeypatch):
    """An explicit `None` overrides the model's generation config in vanilla `generate` (`eos_token_id=None` turns
    EOS off, `top_k=None` turns the default top-k of 50 off): the string form must hand every such value on."""
    from hf_vegas import names

    model = tiny_model("llama")
    ids, mask = ragged_batch([40, 25])
    explicit = dict(eos_token_id=None, top_k=None, top_p=None, temperature=None, repetition_penalty=None,
                    no_repeat_ngram_size=0, min_new_tokens=0, do_sample=False, output_scores=False,
                    stop_strings=None, pad_token_id=0)
    seen = _spy_on_generate(monkeypatch, model)
    names.generate_from_name(model, input_ids=ids, attention_mask=mask, max_new_tokens=3, **explicit)
    for key, value in explicit.items():
        assert key in seen and seen[key] == value, key


def test_string_form_with_eos_none_matches_vanilla():
    model = tiny_model("llama", seed=4)
    ids, mask = ragged_batch([50, 31], seed=4)
    common = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    free = model.generate(ids, **common, eos_token_id=None)
    # An EOS that row 0 emits early: with the generation config's EOS the rows would stop and pad.
    model.generation_config.eos_token_id = int(free[0, ids.shape[1] + 2])
    assert not torch.equal(model.generate(ids, **common), free)
    expected = model.generate(ids, **common, eos_token_id=None)
    assert torch.equal(expected, free)
    for custom in ("vegas", hf_vegas.generate):
        assert torch.equal(model.generate(ids, **common, eos_token_id=None, custom_generate=custom, **SPARSE), free)


class NeverStop(StoppingCriteria):
    """Stands in for `StopStringCriteria` (which needs a real tokenizer): records the stop strings, never stops."""

    def __init__(self, tokenizer, stop_strings):
        self.stop_strings = stop_strings

    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("where", ["keyword", "generation_config", "model_config"])
def test_string_form_builds_the_stop_string_criterion_wherever_stop_strings_were_set(monkeypatch, where):
    """The string form builds the stop-string criterion itself (a callable never gets `tokenizer`) from the stop
    strings `generate` would use (a keyword, else the passed config, else the model's config, which transformers
    fills into a passed config's None) and turns them off for the inner call: in a copy of the passed config, or
    with a keyword where the user gave one or where only a keyword can (the model's config sets them)."""
    from transformers import GenerationConfig

    from hf_vegas import names

    monkeypatch.setattr(names, "StopStringCriteria", NeverStop)
    model = tiny_model("llama")
    ids, mask = ragged_batch([20, 12])
    seen = _spy_on_generate(monkeypatch, model)
    given = {"keyword": dict(stop_strings=["x"], max_new_tokens=3),
             "generation_config": dict(generation_config=GenerationConfig(stop_strings=["x"], max_new_tokens=3)),
             "model_config": dict(generation_config=GenerationConfig(max_new_tokens=3))}[where]
    if where == "model_config":
        monkeypatch.setattr(model.generation_config, "stop_strings", ["x"])
    names.generate_from_name(model, input_ids=ids, attention_mask=mask, tokenizer=object(), pad_token_id=0, **given)
    criteria = [c for c in seen["stopping_criteria"] if isinstance(c, NeverStop)]
    assert len(criteria) == 1 and criteria[0].stop_strings == ["x"]
    if where == "generation_config":
        assert "stop_strings" not in seen and seen["generation_config"].stop_strings is None
        assert given["generation_config"].stop_strings == ["x"], "the user's config is left as it was"
    else:
        assert seen["stop_strings"] is None


def test_string_form_adds_no_generation_keyword_beside_a_passed_generation_config(monkeypatch):
    """Turning the stop strings off for the inner call with a keyword, beside the user's `generation_config`, made
    transformers warn that mixing a config and generation keywords is deprecated: on a call that mixed nothing."""
    from transformers import GenerationConfig
    from transformers.generation import utils as generation_utils

    from hf_vegas import names

    monkeypatch.setattr(names, "StopStringCriteria", NeverStop)
    warned = []  # every call, where transformers' `warning_once` would hide a repeat of an earlier test's warning
    monkeypatch.setattr(generation_utils.logger, "warning_once", lambda message, *a, **k: warned.append(message))
    model = tiny_model("llama")
    ids, mask = ragged_batch([20, 12])
    config = GenerationConfig(stop_strings=["x"], max_new_tokens=3, pad_token_id=0)
    out = model.generate(ids, attention_mask=mask, tokenizer=object(), custom_generate="vegas",
                         generation_config=config)
    assert out.shape == (2, 23)
    assert [m for m in warned if "generation_config" in m] == []
    assert config.stop_strings == ["x"]


def test_token_healing_checks_the_call_before_healing_runs_its_forwards():
    """Healing runs a vanilla generate; a call hf_vegas refuses must fail before it (here the tokenizer is never even
    used)."""
    model = tiny_model("llama")
    ids, mask = ragged_batch([20, 12])
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    for bad, named in ((dict(num_beams=2), "num_beams"), (dict(vegas_gamma=-1), "vegas_gamma"),
                       (dict(guidance_scale=2.0), "guidance_scale")):
        with pytest.raises(ValueError, match=named):
            model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, token_healing=True,
                           tokenizer=object(), custom_generate="vegas", **bad)
    assert forwards == []
