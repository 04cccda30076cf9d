"""`python -m hf_vegas.hub export DIR`: the Hub folder runs where hf_vegas cannot be imported, transformers' loader
finds every file of it, and its README and requirements say what the code does."""

import ast
import dataclasses
import importlib.metadata
import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
from transformers.dynamic_module_utils import get_imports, get_relative_import_files

from hf_vegas import VegasConfig, hub

# Run with `python -I -S`: no site-packages processing, so no editable-install finder, and no PYTHONPATH or current
# directory on the path. The script then puts the site directories back as plain paths (torch and transformers come
# from there) and makes any import of hf_vegas or its kernels fail, whatever else the environment holds.
ISOLATED = r"""
import json, sys
sys.modules["hf_vegas"] = None
sys.modules["hf_vegas_kernels"] = None
sys.path[:0] = json.loads(sys.argv[2])
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.utils import GenerationMixin

torch.set_num_threads(1)
load_custom_generate, validate = GenerationMixin.load_custom_generate, GenerationMixin._validate_model_kwargs
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
ids = torch.randint(1, 128, (2, 60), generator=torch.Generator().manual_seed(1))
mask = torch.ones_like(ids)
mask[1, :17] = 0
ids[1, :17] = 0
common = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
vegas = dict(custom_generate=sys.argv[1], trust_remote_code=True, vegas_gamma=4, vegas_sparsity=0.1,
             vegas_min_tokens=8)
expected = model.generate(ids, **common)
out = model.generate(ids, **common, **vegas, return_dict_in_generate=True)
try:
    model.generate(ids, **common, **vegas, vegas_gama=3)
    typo = None
except ValueError as error:
    typo = str(error)
print(json.dumps(dict(
    identical=bool((out.sequences == expected).all()),
    output_class=type(out).__module__ + "." + type(out).__name__,
    accepted=int(out.accepted.clamp(min=0).sum()),
    transformers_untouched=(GenerationMixin.load_custom_generate, GenerationMixin._validate_model_kwargs)
    == (load_custom_generate, validate),
    typo=typo,
)))
"""


def _site_directories() -> list[str]:
    """Where torch and transformers are installed (as plain paths: their `.pth` hooks, the editable install's among
    them, stay unread)."""
    return [d for d in (*site.getsitepackages(), site.getusersitepackages()) if Path(d).is_dir()]


def test_exported_folder_runs_without_hf_vegas_and_matches_vanilla_greedy(tmp_path):
    folder = hub.export_hub_folder(tmp_path / "vegas")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    run = subprocess.run(
        [sys.executable, "-I", "-S", "-c", ISOLATED, str(folder), json.dumps(_site_directories())],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["identical"], "the folder's greedy tokens differ from vanilla greedy"
    # The folder's own code ran (transformers' module cache), with drafts accepted, and patched nothing.
    assert result["output_class"].startswith("transformers_modules.vegas.")
    assert result["output_class"].endswith(".custom_generate.output.VegasGenerateOutput")
    assert result["accepted"] > 0
    assert result["transformers_untouched"]
    assert "'vegas_gama' (did you mean 'vegas_gamma'?)" in result["typo"]


def test_the_loader_fetches_every_file_and_needs_only_the_requirements(tmp_path):
    """transformers fetches (from the Hub) or copies (from a folder) the files `from .<file> import` lines name; every
    copied module must be among them, and every package they import must be in requirements.txt or the standard
    library, as the loader refuses the folder otherwise."""
    code = hub.export_hub_folder(tmp_path / "vegas") / "custom_generate"
    shipped = {p.name for p in code.glob("*.py")} - {"generate.py"}
    assert {"names.py", "decoding.py", "ops_backend.py", "hf_vegas_kernels_naive.py"} <= shipped
    assert not {"__init__.py", "hub.py", "real_models.py", "assisted.py", "_compat_patches.py"} & shipped, (
        "only what generate needs (never the patches of transformers)")
    assert "_compat_internals.py" in shipped
    fetched = {Path(f).name for f in get_relative_import_files(str(code / "generate.py"))}
    assert fetched == shipped
    required = {line.split(">=")[0] for line in (code / "requirements.txt").read_text().splitlines()
                if line and not line.startswith("#")}
    assert required == {"torch", "transformers"}
    for path in code.glob("*.py"):
        assert set(get_imports(str(path))) <= required | set(sys.stdlib_module_names), path.name


def test_requirements_have_the_package_bounds():
    """requirements.txt holds one bound per line (transformers' check reads one): pyproject.toml's lower bounds."""
    declared = {r.split(";")[0].replace(" ", "") for r in importlib.metadata.requires("hf_vegas") if ";" not in r}
    for requirement in hub.REQUIREMENTS:
        name, bound = requirement.split(">=")
        assert any(d.startswith(name) and f">={bound}" in d for d in declared), (requirement, declared)


def test_readme_lists_every_argument_with_its_default_and_loading_example(tmp_path):
    readme = (hub.export_hub_folder(tmp_path / "vegas") / "README.md").read_text()
    for field in dataclasses.fields(VegasConfig):
        default = f'`"{field.default}"`' if isinstance(field.default, str) else (
            f"`{field.default}`" if isinstance(field.default, bool) else str(field.default))
        assert f"- `vegas_{field.name}` (`{field.type}`, *optional*, defaults to {default})" in readme, field.name
    assert 'defaults to `"weights"`' in readme and "`vegas_cuda_graphs`" in readme and "`vegas_compile`" in readme
    for needed in ("AutoModelForCausalLM", "AutoTokenizer", 'padding_side="left"', "trust_remote_code=True",
                   'custom_generate="<org>/vegas"', "tags:\n  - custom_generate"):
        assert needed in readme, needed


def test_command_line_export_refuses_to_overwrite_unless_forced(tmp_path, capsys):
    target = tmp_path / "vegas"
    assert hub.main(["export", str(target)]) == 0
    assert str(target) in capsys.readouterr().out
    stale = target / "custom_generate" / "removed_module.py"
    stale.write_text("x = 1\n")
    with pytest.raises(FileExistsError, match="--force"):
        hub.main(["export", str(target)])
    assert hub.main(["export", str(target), "--force"]) == 0
    assert not stale.exists(), "a forced export replaces custom_generate/ whole"
    assert (target / "custom_generate" / "generate.py").is_file() and (target / "README.md").is_file()


def test_the_kernel_package_s_naive_ops_are_copied_and_its_triton_modules_refused(tmp_path):
    """hf_vegas imports the plain-PyTorch ops from the kernel package (`from hf_vegas_kernels import naive`): the
    folder holds a copy bound under the same name; a top-level import of a Triton module cannot be exported."""
    code = hub.export_hub_folder(tmp_path / "vegas") / "custom_generate"
    cache = (code / "cache.py").read_text()
    assert "from . import hf_vegas_kernels_naive as naive" in cache and "hf_vegas_kernels import" not in cache
    naive = (code / "hf_vegas_kernels_naive.py").read_text()
    assert naive.startswith("# hf_vegas_kernels/naive.py, copied by")
    assert naive.split("\n", 1)[1] == (hub.KERNELS_SOURCE / "naive.py").read_text(), "copied unchanged"
    assert max(len(line) for line in naive.splitlines()) <= 119
    statement = ast.parse("from hf_vegas_kernels import naive, ops").body[0]
    with pytest.raises(hub.ExportError, match=r"\['naive', 'ops'\] from hf_vegas_kernels.*\['naive'\]"):
        hub._kernel_modules(("cache",), statement)


@pytest.mark.parametrize("statement", ["import hf_vegas_kernels", "from hf_vegas_kernels.naive import write_kv",
                                       "import hf_vegas_kernels.naive as naive"])
def test_a_kernel_import_the_export_cannot_rewrite_is_refused(statement, tmp_path, monkeypatch):
    """Only `from hf_vegas_kernels import <module>` is rewritten; another form would reach the folder unchanged and
    need the package where the folder runs."""
    source = tmp_path / "module.py"
    source.write_text(f"def load():\n    {statement}\n", encoding="utf-8")
    monkeypatch.setattr(hub, "_file", lambda module: source)
    with pytest.raises(hub.ExportError, match="in a form the flat export cannot rewrite"):
        hub._parse(("module",))
