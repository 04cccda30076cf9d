"""The two patches `import hf_vegas` makes to transformers' `GenerationMixin` (`hf_vegas._compat.patches`): they
come off and put transformers' own methods back, install once however often they are asked, change nothing for a
call that uses neither the "vegas" name nor a `vegas_*` key, and stay off with HF_VEGAS_PATCH_TRANSFORMERS=0."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.utils import GenerationMixin

import hf_vegas
from hf_vegas._compat import patches
from tiny_models import ragged_batch, tiny_model

PATCHED = ("load_custom_generate", "_validate_model_kwargs")
IDS, MASK = ragged_batch([9, 6])


def transformers_defines(name: str) -> bool:
    """Whether GenerationMixin's `name` now is transformers' own function (not a wrapper from elsewhere)."""
    function = GenerationMixin.__dict__[name]
    return function.__module__ == GenerationMixin.__module__ and function.__qualname__ == f"GenerationMixin.{name}"


@pytest.fixture
def unpatched():
    """No hf_vegas patch for the test's duration; both back afterwards, as `import hf_vegas` left them."""
    hf_vegas.disable_short_name()
    hf_vegas.disable_key_check()
    yield
    hf_vegas.enable_short_name()
    hf_vegas.enable_key_check()


def test_import_patches_both_and_disabling_gives_back_transformers_own(unpatched):
    assert all(transformers_defines(name) for name in PATCHED)
    assert not hf_vegas.disable_short_name() and not hf_vegas.disable_key_check(), "nothing left to remove"
    for _ in range(2):  # idempotent: a second install wraps nothing more
        hf_vegas.enable_short_name()
        hf_vegas.enable_key_check()
    assert not any(transformers_defines(name) for name in PATCHED)
    assert hf_vegas.disable_short_name() and hf_vegas.disable_key_check()
    assert all(transformers_defines(name) for name in PATCHED), "one removal puts transformers' own methods back"


def test_a_patch_wrapped_by_someone_else_is_left_in_place(unpatched, monkeypatch):
    hf_vegas.enable_short_name()
    ours = GenerationMixin.__dict__["load_custom_generate"]

    def theirs(self, *args, **kwargs):
        return ours(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "load_custom_generate", theirs)
    assert not hf_vegas.disable_short_name(), "removing ours would drop their patch too"
    assert GenerationMixin.__dict__["load_custom_generate"] is theirs


def test_the_short_name_passes_every_other_call_through_unchanged(unpatched, monkeypatch):
    calls = []

    def recorder(self, *args, **kwargs):
        calls.append((args, kwargs))
        return lambda **arguments: "loaded"

    monkeypatch.setattr(GenerationMixin, "load_custom_generate", recorder)
    hf_vegas.enable_short_name()  # wraps the recorder as it would wrap transformers' method
    model = tiny_model("llama")
    assert model.generate(IDS, custom_generate="org/repo", trust_remote_code=True, max_new_tokens=2) == "loaded"
    assert calls[-1] == (("org/repo",), dict(trust_remote_code=True, max_new_tokens=2))
    # Not from `generate`: `from_pretrained` asks for a model repository's own custom_generate/ this way.
    model.load_custom_generate("vegas", trust_remote_code=True, revision="main")
    assert calls[-1] == (("vegas",), dict(trust_remote_code=True, revision="main"))
    # From `generate` with the short name: hf_vegas, and the recorder is not asked.
    count = len(calls)
    out = model.generate(IDS, attention_mask=MASK, custom_generate="vegas", max_new_tokens=3, pad_token_id=0)
    assert isinstance(out, torch.Tensor) and len(calls) == count
    assert hf_vegas.disable_short_name()
    assert GenerationMixin.__dict__["load_custom_generate"] is recorder


def test_a_model_folder_named_vegas_keeps_its_own_generate(tmp_path, monkeypatch):
    """`from_pretrained("vegas", trust_remote_code=True)` looks for the folder's custom_generate/ through the same
    method; the short name must not make hf_vegas that model's `generate`."""
    tiny_model("llama").save_pretrained(tmp_path / "vegas")
    monkeypatch.chdir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained("vegas", trust_remote_code=True)
    assert "generate" not in vars(model), "from_pretrained replaced the model's generate"


def test_the_key_check_changes_nothing_without_vegas_keys():
    own = patches._WRAPPED["_validate_model_kwargs"]
    model = tiny_model("llama")
    assert model._validate_model_kwargs({"input_ids": IDS, "attention_mask": MASK}) is None
    for refused in ({"input_ids": IDS, "bogus": 1}, {"input_ids": IDS, "bogus": 1, "vegas_gamma": None}):
        with pytest.raises(ValueError) as vanilla:
            own(model, refused)
        with pytest.raises(ValueError) as patched:
            model._validate_model_kwargs(refused)
        assert str(patched.value) == str(vanilla.value)
    with pytest.raises(ValueError, match="did you mean 'vegas_gamma'"):
        model._validate_model_kwargs({"input_ids": IDS, "vegas_gama": 3})


def test_vanilla_generate_is_the_same_with_and_without_the_patches(unpatched):
    model = tiny_model("llama")
    common = dict(attention_mask=MASK, max_new_tokens=6, pad_token_id=0, do_sample=False)
    bare = model.generate(IDS, **common)
    with pytest.raises(ValueError) as bare_error:
        model.generate(IDS, **common, bogus=1)
    hf_vegas.enable_short_name()
    hf_vegas.enable_key_check()
    assert torch.equal(model.generate(IDS, **common), bare)
    with pytest.raises(ValueError) as patched_error:
        model.generate(IDS, **common, bogus=1)
    assert str(patched_error.value) == str(bare_error.value)


SWITCHED_OFF = r"""
import json, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.utils import GenerationMixin

names = ("load_custom_generate", "_validate_model_kwargs")
before = {name: GenerationMixin.__dict__[name] for name in names}
import hf_vegas
untouched = all(GenerationMixin.__dict__[name] is before[name] for name in names)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1)).eval()
ids = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(0))
common = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
callable_form = torch.equal(model.generate(ids, custom_generate=hf_vegas.generate, **common),
                            model.generate(ids, **common))
try:
    model.generate(ids, custom_generate="vegas", **common)
    short_name_off = False
except OSError:  # transformers takes "vegas" for a Hub repository
    short_name_off = True
hf_vegas.enable_short_name()
hf_vegas.enable_key_check()
short_name_on = torch.equal(model.generate(ids, custom_generate="vegas", **common), model.generate(ids, **common))
hf_vegas.disable_short_name()
hf_vegas.disable_key_check()
restored = all(GenerationMixin.__dict__[name] is before[name] for name in names)
print(json.dumps(dict(untouched=untouched, callable_form=callable_form, short_name_off=short_name_off,
                      short_name_on=short_name_on, restored=restored)))
"""


def test_the_environment_switch_imports_without_patches():
    env = dict(os.environ, HF_VEGAS_PATCH_TRANSFORMERS="0", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(hf_vegas.__file__).resolve().parent.parent),
                                         env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", SWITCHED_OFF], capture_output=True, text=True, env=env, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == dict(untouched=True, callable_form=True, short_name_off=True, short_name_on=True, restored=True)
