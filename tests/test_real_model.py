"""The proof on a real trained model: SmolLM2-135M-Instruct (GGUF from PyPI), CPU, fp32."""

import pytest
import torch
from transformers import TextStreamer

import hf_vegas
from hf_vegas.real_models import long_prompt
from hf_vegas._compat.internals import CACHE_KEYWORD
from hub_folder import hub_folder

pytestmark = pytest.mark.slow


def test_long_prompt_greedy_identical_to_vanilla(smollm2):
    model, tokenizer = smollm2
    ids = long_prompt(tokenizer, 2048)
    assert ids.shape[1] >= 2000
    expected = model.generate(ids, max_new_tokens=48, do_sample=False)
    out = model.generate(ids, max_new_tokens=48, do_sample=False, custom_generate="vegas",
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    cache = getattr(out, CACHE_KEYWORD)
    sel = cache.selection
    assert bool((sel.sel_count < sel.sel_end).all())  # 7% / 256 of ~2K: the draft really is sparse
    assert out.tokens_per_iteration > 2.0  # a trained model accepts most sparse drafts
    assert model.config._attn_implementation == "sdpa"


def test_ragged_batch_greedy_identical_to_vanilla(smollm2):
    model, tokenizer = smollm2
    prompts = [tokenizer.decode(long_prompt(tokenizer, n, topic_offset=5 * i)[0]) for i, n in enumerate([700, 420])]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    expected = model.generate(**enc, max_new_tokens=32, do_sample=False)
    out = model.generate(**enc, max_new_tokens=32, do_sample=False, custom_generate=hf_vegas.generate,
                         vegas_min_tokens=64)
    assert torch.equal(out, expected)


def test_stop_strings_and_text_streamer(smollm2, capsys):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "List three colours, one per line."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    common = dict(max_new_tokens=40, do_sample=False, stop_strings=["\n"], tokenizer=tokenizer)
    expected = model.generate(**ids, **common, streamer=TextStreamer(tokenizer, skip_prompt=True))
    vanilla_text = capsys.readouterr().out
    out = model.generate(**ids, **common, custom_generate="vegas", vegas_min_tokens=8,
                         streamer=TextStreamer(tokenizer, skip_prompt=True))
    assert torch.equal(out, expected)
    assert capsys.readouterr().out == vanilla_text
    assert out.shape[1] < ids["input_ids"].shape[1] + 40  # it did stop on the string


def test_token_healing_matches_vanilla(smollm2):
    """Token healing re-tokenizes the prompt's tail ("@gma" -> "@gmail"); the string form heals as vanilla does. The
    callable form cannot: transformers heals before calling it and never hands it `tokenizer` (its own error)."""
    model, tokenizer = smollm2
    ids = tokenizer(["My email is john.smith@gma"], return_tensors="pt")
    common = dict(max_new_tokens=10, do_sample=False, tokenizer=tokenizer)
    expected = model.generate(**ids, **common, token_healing=True)
    assert not torch.equal(expected, model.generate(**ids, **common)), "healing must change this prompt's output"
    out = model.generate(**ids, **common, token_healing=True, custom_generate="vegas", vegas_min_tokens=8)
    assert torch.equal(out, expected)
    hub = model.generate(**ids, **common, token_healing=True, custom_generate=hub_folder(), trust_remote_code=True,
                         vegas_min_tokens=8)
    assert torch.equal(hub, expected)
    with pytest.raises(ValueError, match="token healing"):
        model.generate(**ids, **common, token_healing=True, custom_generate=hf_vegas.generate)


def test_sampling_runs_and_stays_in_the_top_p_set(smollm2):
    model, tokenizer = smollm2
    ids = long_prompt(tokenizer, 600)
    torch.manual_seed(0)
    batch = ids.repeat(2, 1)  # top_k=0: SmolLM2's generation config keeps the default top-k of 50, a second cut
    out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=24, do_sample=True,
                         temperature=0.6, top_p=0.95, top_k=0, custom_generate="vegas", vegas_min_tokens=64,
                         return_dict_in_generate=True, output_scores=True, output_logits=True, eos_token_id=None)
    assert out.sequences.shape[0] == 2 and out.tokens_per_iteration > 1.0
    scores = torch.stack(out.scores, dim=1)  # (2, 24, V): the processed scores each token was drawn from
    chosen = scores.gather(-1, out.sequences[:, ids.shape[1]:, None]).squeeze(-1)
    assert bool(torch.isfinite(chosen).all()), "every token lies in its step's kept set"
    # The kept set is top-p's: the smallest set of most likely tokens whose probability (temperature 0.6) reaches 0.95.
    probs = torch.softmax(torch.stack(out.logits, dim=1) / 0.6, dim=-1)
    kept = torch.isfinite(scores)
    mass = (probs * kept).sum(dim=-1)
    least = torch.where(kept, probs, torch.ones_like(probs)).min(dim=-1).values
    assert bool((mass >= 0.95 - 1e-4).all()) and bool((mass - least < 0.95 + 1e-4).all())
    assert bool((kept.sum(dim=-1) < scores.shape[-1]).all()), "top-p removed tokens at every step"
