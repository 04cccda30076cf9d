"""`hf_vegas.tune`: the paper's three steps on the user's prompts, its report, its errors and its CLI."""

import json

import pytest
import torch

import hf_vegas
from hf_vegas import traffic
from hf_vegas.tune import TuneReport, dense_config, tune
from hf_vegas.tune.cli import main
from tiny_models import ragged_batch, tiny_model

IDS, MASK = ragged_batch([80, 61])
COMMON = dict(attention_mask=MASK, max_new_tokens=16, pad_token_id=0, progress=False,
              base_config=hf_vegas.VegasConfig(min_tokens=4))


def _modelled_speedup(monkeypatch):
    """A traffic model whose optimum is inside the grid: tokens per iteration, less a cost per draft step."""
    monkeypatch.setattr(traffic, "predicted_speedup", lambda model, batch, context, config, tpi, rejection=0.0:
                        tpi / (1 + 0.15 * config.gamma + config.sparsity))


def test_the_three_steps_choose_what_their_rules_say(monkeypatch):
    from hf_vegas.tune import search

    _modelled_speedup(monkeypatch)
    calls = []
    generate = search._Runner._generate
    monkeypatch.setattr(search._Runner, "_generate", lambda self, config, new: calls.append(config) or generate(
        self, config, new))
    report = tune(tiny_model("llama"), IDS, gammas=[4, 2, 6], sparsities=[0.3, 0.1, 0.6], plateau=0.05, **COMMON)
    distinct = {(r["gamma"], r["sparsity"]) for r in report.grid}
    assert len(calls) == len(distinct) < len(report.grid), "a configuration two steps share runs once"
    steps = [[r for r in report.grid if r["step"].startswith(n)] for n in "123"]
    assert [len(s) for s in steps] == [3, 3, 3] and report.timing == "traffic"
    assert {r["gamma"] for r in steps[0]} == {6}, "step 1 runs at the largest gamma"
    best_tpi = max(r["tokens_per_iteration"] for r in steps[0])
    plateau = min(r["sparsity"] for r in steps[0] if r["tokens_per_iteration"] >= 0.95 * best_tpi)
    assert report.plateau_sparsity == plateau and {r["sparsity"] for r in steps[1]} == {plateau}
    gamma = max(steps[1], key=lambda r: r["speedup"])["gamma"]
    assert {r["gamma"] for r in steps[2]} == {gamma}, "step 3 re-adjusts the ratio at step 2's gamma"
    best = max(steps[2], key=lambda r: r["speedup"])
    assert report.chosen is best and best["speedup"] > 1 and report.note is None
    assert (report.config.gamma, report.config.sparsity, report.config.min_tokens) == (gamma, best["sparsity"], 4)
    assert all(r["speedup"] == r["predicted_speedup"] for r in report.grid), "traffic timing: speedup = prediction"
    assert report.measured_speedup is None and report.predicted_speedup == best["predicted_speedup"]


def test_the_chosen_config_is_lossless_and_keeps_the_flat_keys(monkeypatch):
    """A `vegas_<field>` keyword joins the base config: every run and the report's config use it."""
    _modelled_speedup(monkeypatch)
    model = tiny_model("llama", seed=1)
    common = {**COMMON, "base_config": hf_vegas.VegasConfig()}
    report = tune(model, IDS, gammas=[2, 3], sparsities=[0.1, 0.5], vegas_min_tokens=4, **common)
    assert report.config.gamma > 0 and report.config.min_tokens == 4
    expected = model.generate(IDS, attention_mask=MASK, max_new_tokens=12, do_sample=False, pad_token_id=0)
    out = model.generate(IDS, attention_mask=MASK, max_new_tokens=12, do_sample=False, pad_token_id=0,
                         custom_generate="vegas", vegas_config=report.config)
    assert torch.equal(out, expected)


def test_no_gain_means_the_dense_path_and_says_so():
    """A tiny model at 80 tokens reads mostly weights: no configuration beats the dense path by the bytes."""
    report = tune(tiny_model("llama"), IDS, gammas=[2, 4], sparsities=[0.1, 0.3], **COMMON)
    assert max(r["speedup"] for r in report.grid) < 1
    assert report.config == dense_config(COMMON["base_config"]) and report.config.gamma == 0
    assert "dense path" in report.note and "traffic" in report.note


def test_measured_timing_times_the_dense_path_and_every_configuration():
    report = tune(tiny_model("llama"), IDS, gammas=[2], sparsities=[0.2], timing="measured", **COMMON)
    assert report.timing == "measured" and report.dense["tokens_per_s"] > 0
    for r in report.grid:
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / report.dense["tokens_per_s"])
    assert report.measured_speedup == report.chosen["speedup"]


def test_compiled_steps_are_measured_for_the_choice_only(monkeypatch, tmp_path):
    """With `compile=True` each configuration would compile its own steps: the grid runs uncompiled (with graphs on
    CUDA), then the chosen gamma and sparsity and the dense path run compiled, and the report keeps both."""
    from hf_vegas.tune import search

    calls = []
    generate = search._Runner._generate

    def timed(self, config, new):  # fake clocks: drafting decodes faster than the dense path, so a choice is made
        calls.append(config)
        out, _ = generate(self, config, new)
        return out, 1.0 + (0.02 if config.gamma else 0.1) * (new - 1)

    monkeypatch.setattr(search._Runner, "_generate", timed)
    common = {**COMMON, "base_config": hf_vegas.VegasConfig(min_tokens=4, compile=True)}
    report = tune(tiny_model("llama"), IDS, gammas=[2, 3], sparsities=[0.2, 0.5], timing="measured", **common)
    assert report.chosen["speedup"] > 1 and report.config.gamma > 0
    uncompiled = [c for c in calls if not c.compile]
    assert {(c.gamma, c.sparsity) for c in uncompiled if c.gamma} == {(r["gamma"], r["sparsity"]) for r in report.grid}
    compiled = [c for c in calls if c.compile]
    assert calls[-len(compiled):] == compiled, "compiled runs come after the whole grid"
    assert {(c.gamma, c.sparsity) for c in compiled} == {(0, hf_vegas.VegasConfig.sparsity),
                                                         (report.chosen["gamma"], report.chosen["sparsity"])}
    assert report.config.compile and report.config.gamma == report.chosen["gamma"]
    numbers = report.compiled
    assert (numbers["gamma"], numbers["sparsity"]) == (report.chosen["gamma"], report.chosen["sparsity"])
    assert numbers["speedup"] == pytest.approx(numbers["tokens_per_s"] / numbers["dense_tokens_per_s"])
    assert "compiled (the grid ran uncompiled)" in str(report)
    # On the CPU nothing is captured: the compiled numbers say they ran eagerly, and the report repeats it.
    assert numbers["eager_reason"] and numbers["dense_eager_reason"] and "its steps ran eagerly" in str(report)
    assert TuneReport.load(report.save(tmp_path / "r.json")).compiled == numbers
    calls.clear()
    tune(tiny_model("llama"), IDS, gammas=[2], sparsities=[0.2], **common)  # traffic timing: nothing to confirm
    assert calls and all(c.compile for c in calls)


def test_a_choice_that_loses_once_compiled_is_the_dense_path(monkeypatch):
    """The compiled confirmation decides: a choice slower than the compiled dense path gives the dense path (with
    why), and a grid that never beat the dense path is not confirmed at all."""
    from hf_vegas.tune import search

    measured = {}  # speedup of the uncompiled grid and of the compiled confirmation

    def fake(self, config, dense):
        speedup = measured["compiled" if config.compile else "grid"]
        return dict(gamma=config.gamma, sparsity=config.sparsity, tokens_per_iteration=2.0, iterations=4,
                    predicted_speedup=1.0, tokens_per_s=speedup * dense["tokens_per_s"], speedup=speedup)

    monkeypatch.setattr(search._Runner, "_vegas", fake)
    common = {**COMMON, "base_config": hf_vegas.VegasConfig(min_tokens=4, compile=True)}
    measured.update(grid=1.3, compiled=0.9)
    report = tune(tiny_model("llama"), IDS, gammas=[2], sparsities=[0.2], timing="measured", **common)
    assert report.config.gamma == 0 and report.config.compile and "compiled" in report.note
    assert report.compiled["speedup"] == pytest.approx(0.9)
    measured.update(grid=0.8, compiled=2.0)
    report = tune(tiny_model("llama"), IDS, gammas=[2], sparsities=[0.2], timing="measured", **common)
    assert report.config.gamma == 0 and report.compiled is None and "no configuration" in report.note


def test_measured_time_is_the_decode_less_the_prefill(monkeypatch):
    """Fake clocks: a full generation takes 1 s + 0.1 s per new token, a prefill-only call 1 s (plus 0.5 s with
    drafting, whose prefill also selects); each rate is its tokens over what the decode alone took."""
    from hf_vegas.tune import search

    real = search._Runner._generate

    def timed(self, config, max_new_tokens):
        out, _ = real(self, config, max_new_tokens)
        prefill = 1.0 + (0.5 if config.gamma else 0.0)
        return out, prefill + (0.1 * max_new_tokens if max_new_tokens > 1 else 0.0)

    monkeypatch.setattr(search._Runner, "_generate", timed)
    report = tune(tiny_model("llama"), IDS, gammas=[2], sparsities=[0.2], timing="measured", eos_token_id=None,
                  **COMMON)
    made = 2 * (16 - 1)  # rows x tokens after the prefill's
    assert report.dense["decode_seconds"] == pytest.approx(1.6)
    assert report.dense["tokens_per_s"] == pytest.approx(made / 1.6)
    assert all(r["decode_seconds"] == pytest.approx(1.6) for r in report.grid)


def test_prompts_as_strings_or_token_lists_batch_like_generate():
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(1, 100)} | {"[PAD]": 0}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]")
    texts = [" ".join(f"w{(7 * i) % 99 + 1}" for i in range(n)) for n in (70, 45)]
    model = tiny_model("llama")
    kwargs = {**COMMON}
    kwargs.pop("attention_mask")
    by_text = tune(model, texts, tokenizer, gammas=[2], sparsities=[0.2], **kwargs)
    rows = [torch.tensor(tokenizer(t).input_ids) for t in texts]
    by_ids = tune(model, rows, gammas=[2], sparsities=[0.2], **kwargs)
    assert by_text.prompt_tokens == by_ids.prompt_tokens == 70 and by_text.batch == 2
    assert by_text.grid == by_ids.grid, "the same left-padded batch either way"


@pytest.mark.parametrize("kwargs,message", [
    (dict(gammas=[0, 2]), "gammas"), (dict(gammas=[]), "gammas"), (dict(sparsities=[0.0]), "sparsities"),
    (dict(sparsities=[1.5]), "sparsities"), (dict(timing="cuda"), "timing"),
    (dict(max_new_tokens=4), "max_new_tokens"), (dict(plateau=1.0), "plateau"), (dict(vegas_gamma=3), "vegas_gamma"),
    (dict(base_config={"gamma": 3}), "base_config"),
])
def test_bad_arguments_are_refused_before_any_forward(kwargs, message):
    model = tiny_model("llama")
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    arguments = {**COMMON, **kwargs}
    with pytest.raises(ValueError, match=message):
        tune(model, IDS, **arguments)
    with pytest.raises(ValueError, match="tokenizer"):
        tune(model, ["some text"], progress=False)
    with pytest.raises(ValueError, match="tokenizer"):
        tune(model, IDS, tokenizer=object(), progress=False)
    with pytest.raises(ValueError, match="attention_mask"):
        tune(model, [IDS[0]], attention_mask=MASK[:1], progress=False)
    assert not calls


def test_prompts_that_end_at_once_are_refused_clearly():
    model = tiny_model("llama")
    first = model.generate(IDS, attention_mask=MASK, max_new_tokens=1, do_sample=False, pad_token_id=0)[:, -1]
    with pytest.raises(ValueError, match="nothing to tune"):
        tune(model, IDS, gammas=[2], sparsities=[0.2], eos_token_id=first.tolist(), **COMMON)


def test_the_report_round_trips_through_json_and_draws(tmp_path, monkeypatch):
    _modelled_speedup(monkeypatch)
    report = tune(tiny_model("llama"), IDS, gammas=[2, 4], sparsities=[0.1, 0.4], **COMMON)
    saved = report.save(tmp_path / "tune.json")
    assert json.loads(saved.read_text())["config"]["gamma"] == report.config.gamma
    again = TuneReport.load(saved)
    assert again == report and isinstance(again.config, hf_vegas.VegasConfig)
    png = report.plot(tmp_path / "tune.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "chosen: VegasConfig(" in str(report)


@pytest.mark.slow
def test_the_cli_tunes_the_embedded_smollm2(tmp_path):
    report = main(["--prompt-tokens", "300", "--batch", "2", "--max-new-tokens", "8", "--gammas", "2", "4",
                   "--sparsities", "0.1", "0.3", "--out", str(tmp_path / "tune.json"), "--plot",
                   str(tmp_path / "tune.png"), "--no-progress"])
    assert (tmp_path / "tune.json").exists() and (tmp_path / "tune.png").exists()
    assert report.timing == "traffic" and report.batch == 2 and len(report.grid) == 6
    assert all(r["tokens_per_iteration"] > 1 for r in report.grid), "a trained model accepts drafts"


def test_a_compiled_measurement_says_how_its_own_steps_ran(monkeypatch):
    """`eager_reason` is read right after each timed call: the prefill-only calls that follow may land in another
    capacity bucket, whose fresh pooled graphs would report no failure for a timed call whose capture failed."""
    import types

    from hf_vegas import graphs
    from hf_vegas.tune import search

    generate = search._Runner._generate
    state = {"reason": None}

    def timed(self, config, new):  # each timed call's capture fails; each prefill-only call's "bucket" is fresh
        out, _ = generate(self, config, new)
        state["reason"] = "capturing the draft step failed (test)" if new > 1 else None
        return out, 1.0 + (0.02 if config.gamma else 0.1) * (new - 1)

    monkeypatch.setattr(search._Runner, "_generate", timed)
    monkeypatch.setattr(graphs, "pooled_graphs", lambda model: types.SimpleNamespace(
        captures=0, disabled_reason=state["reason"]))
    common = {**COMMON, "base_config": hf_vegas.VegasConfig(min_tokens=4, compile=True)}
    report = tune(tiny_model("llama"), IDS, gammas=[2], sparsities=[0.2], timing="measured", **common)
    assert report.compiled is not None
    assert report.compiled["eager_reason"] == "capturing the draft step failed (test)"
    assert report.compiled["dense_eager_reason"] == "capturing the draft step failed (test)"
    assert all(r["eager_reason"] == "capturing the draft step failed (test)" for r in report.grid)
    assert "its steps ran eagerly: capturing the draft step failed (test)" in str(report)
