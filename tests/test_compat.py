"""Every private transformers name hf_vegas relies on (`hf_vegas._compat`) still does what hf_vegas needs.

One test per name. Each drives transformers itself (a `generate` call, the assisted loop, a model class) and fails
with a message naming the attribute and the installed transformers release, so a release that moves one is found
here rather than as a wrong output. The process-wide patches have their own tests in test_patches.py.
"""

import importlib.util
import inspect
import sys

import pytest
import torch
import transformers
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList
from transformers.generation.utils import GenerationMixin

import hf_vegas
from hf_vegas._compat import internals as compat
from hf_vegas._compat import patches
from hf_vegas._compat.internals import CACHE_KEYWORD
from tiny_models import ragged_batch, tiny_model

VERSION = transformers.__version__
CHECKED = " and ".join(compat.CHECKED_ON)


def changed(name: str, what: str) -> str:
    """The failure message: which private name, what no longer holds, on which release."""
    return f"transformers {VERSION} (hf_vegas checked {CHECKED}): `{name}` {what}"


def transformers_own(name: str):
    """GenerationMixin's own `name`, whether or not hf_vegas's patch wraps it now."""
    return patches._WRAPPED.get(name, GenerationMixin.__dict__[name])


def probe_generate(model, ids, **kwargs) -> dict:
    """Run `model.generate` with a custom_generate callable that records what it sees and decodes nothing."""
    seen = {}

    def probe(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
              **model_kwargs):
        seen.update(generation_config=generation_config, model_kwargs=model_kwargs,
                    streamer=compat.generate_call_argument("streamer"),
                    synced_gpus=compat.generate_call_argument("synced_gpus"))
        return input_ids

    model.generate(ids, custom_generate=probe, max_new_tokens=2, **kwargs)
    assert seen, "transformers did not call the custom_generate callable"
    return seen


IDS, MASK = ragged_batch([9, 6])


def special_token(read, name: str, **token_ids):
    """What `read` (an internals getter) finds on the config a custom_generate callable gets for these token ids."""
    seen = probe_generate(tiny_model("llama"), IDS, attention_mask=MASK, **token_ids)
    try:
        return read(seen["generation_config"])
    except compat.TransformersChanged as error:
        pytest.fail(changed(name, f"is not set on the config a custom_generate callable gets ({error})"))


def test_eos_token_tensor_is_set_before_a_callable_runs():
    name = "GenerationConfig._eos_token_tensor"
    eos = special_token(compat.eos_token_tensor, name, eos_token_id=[5, 7], pad_token_id=3)
    assert isinstance(eos, torch.Tensor) and eos.tolist() == [5, 7], changed(name, f"holds {eos!r}, not [5, 7]")
    assert eos.device == IDS.device, changed(name, "is not on the inputs' device")
    single = probe_generate(tiny_model("llama"), IDS, attention_mask=MASK, eos_token_id=5, pad_token_id=3)
    assert compat.eos_token_tensor(single["generation_config"]).tolist() == [5], changed(name, "is not 1-D for one id")


def test_pad_token_tensor_is_set_before_a_callable_runs():
    name = "GenerationConfig._pad_token_tensor"
    pad = special_token(compat.pad_token_tensor, name, eos_token_id=[5, 7], pad_token_id=3)
    assert isinstance(pad, torch.Tensor) and pad.ndim == 0 and int(pad) == 3, changed(name, f"holds {pad!r}, not 3")
    # Without a pad id, vanilla pads finished rows with the first EOS id; hf_vegas pads with what it reads here.
    fallback = probe_generate(tiny_model("llama"), IDS, attention_mask=MASK, eos_token_id=[5, 7], pad_token_id=None)
    pad = compat.pad_token_tensor(fallback["generation_config"])
    assert pad is not None and int(pad) == 5, changed(name, f"is {pad!r} without a pad id, not the first EOS id")


def test_the_cache_keyword_is_the_one_models_take_and_outputs_hold():
    """`CACHE_KEYWORD` (`past_key_values`, `cache` from 5.24) is what a model's forward takes without a deprecation
    warning and the field its output and `generate`'s hold the cache in (the prompt-cache tests check `generate`)."""
    import warnings

    name = "the cache keyword"
    model = tiny_model("llama")
    ids, mask = ragged_batch([6, 4])
    assert CACHE_KEYWORD in inspect.signature(type(model).forward).parameters, changed(name, f"`{CACHE_KEYWORD}` is "
                                                                                       "not a forward parameter")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the deprecated keyword warns
        out = model(ids, attention_mask=mask, use_cache=True, **{CACHE_KEYWORD: DynamicCache(config=model.config)})
    assert isinstance(getattr(out, CACHE_KEYWORD), DynamicCache), changed(name, "does not name the output's cache")
    assert getattr(out, CACHE_KEYWORD).get_seq_length() == ids.shape[1]


def test_is_user_defined_marks_a_cache_the_user_passed_and_no_other():
    name = "Cache._is_user_defined"
    model = tiny_model("llama")
    ids = IDS[:1, 3:]
    passed = DynamicCache(config=model.config)
    seen = probe_generate(model, ids, **{CACHE_KEYWORD: passed})
    assert seen["model_kwargs"][CACHE_KEYWORD] is passed
    assert compat.is_user_cache(passed), changed(name, f"is not set on a cache passed as `{CACHE_KEYWORD}`")
    built = probe_generate(model, ids)["model_kwargs"].get(CACHE_KEYWORD)
    assert built is not None, changed(name, "no cache built for a call without one: hf_vegas's check has changed")
    assert not compat.is_user_cache(built), changed(name, "is set on the cache generate built itself")


def test_attn_implementation_reads_what_set_attn_implementation_takes():
    name = "PretrainedConfig._attn_implementation"
    model = tiny_model("llama")
    try:
        original = compat.attn_implementation(model)
    except compat.TransformersChanged as error:
        pytest.fail(changed(name, str(error)))
    assert original == "sdpa", changed(name, f"reads {original!r} for a default Llama, not 'sdpa'")
    model.set_attn_implementation("eager")
    assert compat.attn_implementation(model) == "eager", changed(name, "does not follow set_attn_implementation")
    model.set_attn_implementation(original)  # the round trip hf_vegas makes after every generate
    assert compat.attn_implementation(model) == original, changed(name, "is not a value set_attn_implementation takes")


OWN_ATTENTION = '''
import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel


class OwnAttention(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)  # computes attention itself: no AttentionInterface


class OwnModel(PreTrainedModel):
    config_class = LlamaConfig

    def __init__(self, config):
        super().__init__(config)
        self.attention = OwnAttention()
'''


def test_can_set_attn_implementation_tells_interface_models_from_others(tmp_path):
    name = "PreTrainedModel._can_set_attn_implementation"
    assert compat.can_set_attn_implementation(tiny_model("llama")), changed(name, "is False for Llama")
    path = tmp_path / "own_attention_model.py"
    path.write_text(OWN_ATTENTION)
    spec = importlib.util.spec_from_file_location("own_attention_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # transformers reads the class's module source through sys.modules
    try:
        spec.loader.exec_module(module)
        own = module.OwnModel(transformers.LlamaConfig(vocab_size=8, hidden_size=8, num_hidden_layers=1,
                                                       num_attention_heads=1, intermediate_size=8))
        assert not compat.can_set_attn_implementation(own), changed(
            name, "is True for a model whose attention does not go through AttentionInterface: hf_vegas would switch "
            "it to 'vegas' and leave its layers attending densely")
    finally:
        del sys.modules[spec.name]


class _Streamer:
    def put(self, value):
        pass

    def end(self):
        pass


def test_generate_locals_hold_streamer_and_synced_gpus_for_a_callable():
    """A callable does not receive `streamer` or `synced_gpus`; hf_vegas reads them from the `generate` frame."""
    name = "GenerationMixin.generate (its locals `self`, `streamer`, `synced_gpus`)"
    streamer = _Streamer()
    seen = probe_generate(tiny_model("llama"), IDS[:1], streamer=streamer, synced_gpus=False)
    assert seen["streamer"] is streamer, changed(name, "no longer hold the `streamer` the user passed")
    assert seen["synced_gpus"] is False, changed(name, "no longer hold the `synced_gpus` the user passed")
    assert {"streamer", "synced_gpus"} <= set(inspect.signature(GenerationMixin.generate).parameters), changed(
        name, "no longer takes `streamer` and `synced_gpus`")
    assert compat.generate_call_argument("streamer") is None  # outside a generate call


def test_extract_generation_mode_kwargs_decides_synced_gpus(monkeypatch):
    name = "GenerationMixin._extract_generation_mode_kwargs"
    model = tiny_model("llama")
    try:
        decided = [compat.synced_gpus(model, value) for value in (True, False, None)]
    except compat.TransformersChanged as error:
        pytest.fail(changed(name, str(error)))
    assert decided == [True, False, False], changed(name, f"decides {decided} for True, False, unset (one process)")
    # transformers turns it on by itself under DeepSpeed ZeRO-3 with several processes: hf_vegas must see that.
    utils = sys.modules[GenerationMixin.__module__]
    for helper in ("is_deepspeed_zero3_enabled", "_get_torch_distributed_world_size"):
        assert hasattr(utils, helper), changed(name, f"no longer reads `{helper}` (update this test's stand-ins)")
    monkeypatch.setattr(utils, "is_deepspeed_zero3_enabled", lambda: True)
    monkeypatch.setattr(utils, "_get_torch_distributed_world_size", lambda: 2)
    assert compat.synced_gpus(model, None), changed(name, "no longer turns synced_gpus on under ZeRO-3 by itself")
    assert not compat.synced_gpus(model, False), changed(name, "overrides an explicit synced_gpus=False")


def test_get_candidate_generator_is_what_the_assisted_loop_asks():
    name = "GenerationMixin._get_candidate_generator"
    parameters = set(inspect.signature(transformers_own("_get_candidate_generator")).parameters)
    assert {"generation_config", "logits_processor"} <= parameters, changed(name, f"takes {sorted(parameters)}")
    model = tiny_model("llama")
    seen = {}

    class Asked(Exception):
        pass

    def build(generation_config, logits_processor):
        seen.update(generation_config=generation_config, logits_processor=logits_processor)
        raise Asked

    with compat.candidate_generator(model, build):
        try:
            model.generate(IDS[:1], max_new_tokens=3, do_sample=False, prompt_lookup_num_tokens=2)
        except Asked:
            pass
        except TypeError as error:
            pytest.fail(changed(name, f"is called with other arguments ({error})"))
    assert seen, changed(name, "is not asked, on the instance, by generate(prompt_lookup_num_tokens=...)")
    assert isinstance(seen["generation_config"], GenerationConfig)
    assert isinstance(seen["logits_processor"], LogitsProcessorList)
    assert "_get_candidate_generator" not in vars(model)


def test_validate_model_kwargs_refuses_unused_keys_before_a_callable_runs():
    name = "GenerationMixin._validate_model_kwargs"
    own = transformers_own("_validate_model_kwargs")
    assert list(inspect.signature(own).parameters)[:2] == ["self", "model_kwargs"], changed(name, "takes other args")
    model = tiny_model("llama")
    assert own(model, {"input_ids": IDS, "attention_mask": MASK}) is None, changed(name, "refuses model inputs")
    with pytest.raises(ValueError, match="vegas_gama"):
        own(model, {"input_ids": IDS, "vegas_gama": 3})
    called = []
    with pytest.raises(ValueError, match="vegas_gama"):  # the check runs before the callable, so hf_vegas's patch
        model.generate(IDS, attention_mask=MASK, vegas_gama=3,  # is where a misspelt key can be named
                       custom_generate=lambda model, input_ids, **kwargs: called.append(1))
    assert not called, changed(name, "no longer runs before a custom_generate callable")


def test_load_custom_generate_is_how_generate_resolves_a_string(monkeypatch):
    """The short name's contract: for a string `custom_generate`, `generate` itself calls
    `self.load_custom_generate(string, trust_remote_code=..., ...)` and calls its result with `model=` and the
    arguments of the call."""
    name = "GenerationMixin.load_custom_generate"
    parameters = list(inspect.signature(transformers_own("load_custom_generate")).parameters)
    assert parameters[:3] == ["self", "pretrained_model_name_or_path", "trust_remote_code"], changed(name, parameters)
    calls = []

    def loader(self, *args, **kwargs):
        calls.append((sys._getframe(1).f_code.co_name, args, kwargs))
        return lambda **arguments: ("loaded", arguments)

    monkeypatch.setattr(GenerationMixin, "load_custom_generate", loader)
    model = tiny_model("llama")
    result = model.generate(IDS, attention_mask=MASK, custom_generate="org/repo", trust_remote_code=True,
                            max_new_tokens=3)
    assert calls and calls[0][0] == "generate", changed(name, f"is not called from `generate` ({calls})")
    assert calls[0][1] == ("org/repo",) and calls[0][2].get("trust_remote_code") is True, changed(name, calls[0])
    assert result[0] == "loaded", changed(name, "'s result is not what generate returns")
    arguments = result[1]
    assert arguments["model"] is model and arguments["max_new_tokens"] == 3, changed(name, sorted(arguments))
    assert torch.equal(arguments["inputs"], IDS) and arguments["attention_mask"] is MASK


def test_installed_transformers_is_a_checked_release():
    """Below the lowest checked release hf_vegas is unsupported: fail. A newer release than the checked ones is what a
    fresh install gets (hf_vegas supports up to the newest release): the per-name tests above are what guard it, so
    this one only says so (a skip with its reason) until the release is added to CHECKED_ON (and README,
    pyproject.toml) after those tests pass on it."""
    def minor(version):
        return tuple(int(part) for part in version.split(".")[:2])

    low, high = minor(compat.CHECKED_ON[0]), minor(compat.CHECKED_ON[-1])
    assert minor(VERSION) >= low, f"transformers {VERSION} is older than the lowest checked release {CHECKED}"
    if minor(VERSION) > high:
        pytest.skip(f"transformers {VERSION} is newer than the checked {CHECKED}: the per-name tests in this file "
                    "decide whether it works; add it to hf_vegas/_compat/internals.py CHECKED_ON once they pass")


def test_readme_and_pyproject_declare_the_checked_range():
    from pathlib import Path

    root = Path(hf_vegas.__file__).resolve().parent.parent
    low, high = compat.CHECKED_ON[0], compat.CHECKED_ON[-1]
    for document in ("README.md", "pyproject.toml"):
        text = (root / document).read_text()
        assert low in text and high in text, f"{document} does not name the checked transformers {CHECKED}"


@pytest.fixture
def one_rank_mesh(tmp_path):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this torch build has no torch.distributed gloo backend")
    from torch.distributed.device_mesh import init_device_mesh

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        torch.distributed.destroy_process_group()


def _parallel_linear(style, mesh, bias=True):
    """An `nn.Linear` sharded and given its forward by one of transformers' tensor-parallel styles, as
    `from_pretrained(..., tp_plan="auto")` does (`shard_param`, then `install_forward`)."""
    linear = torch.nn.Linear(8, 4, bias=bias)
    for name in ("weight", "bias") if bias else ("weight",):
        style.shard_param(linear, name, mesh)
    style.install_forward(linear, mesh)
    return linear


def test_column_parallel_shard_is_the_shard_transformers_column_parallel_forward_computes_with(one_rank_mesh):
    name = "TensorParallelLayer.install_forward (tp_forward's closure) and ColwiseParallel"
    from torch.distributed.tensor import Replicate
    from transformers.distributed.tensor_parallel import ColwiseParallel, RowwiseParallel

    linear = _parallel_linear(ColwiseParallel(), one_rank_mesh)
    shard = compat.column_parallel_shard(linear)
    assert shard is not None, changed(name, "no longer gives a column-parallel linear's shard")
    weight, bias = shard
    assert type(weight) is not type(linear.weight) and weight.shape == (4, 8) and bias.shape == (4,)
    x = torch.randn(2, 3, 8)
    with torch.no_grad():  # the forward's inference path is F.linear with the shard: the product the kernels compute
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight, bias))
    assert compat.column_parallel_shard(_parallel_linear(ColwiseParallel(), one_rank_mesh, bias=False))[1] is None
    # Styles whose output is not this rank's columns as a plain tensor: no shard.
    for style in (RowwiseParallel(), ColwiseParallel(output_layouts=Replicate()),
                  ColwiseParallel(use_local_output=False)):
        assert compat.column_parallel_shard(_parallel_linear(style, one_rank_mesh)) is None, type(style).__name__
    # The forward must wrap nn.Linear's own: one installed before transformers' is code the kernel would skip.
    wrapped = torch.nn.Linear(8, 4)
    wrapped.forward = lambda x, _wrapped=wrapped: torch.nn.functional.linear(x, _wrapped.weight) * 2
    ColwiseParallel().shard_param(wrapped, "weight", one_rank_mesh)
    ColwiseParallel().shard_param(wrapped, "bias", one_rank_mesh)
    ColwiseParallel().install_forward(wrapped, one_rank_mesh)
    assert compat.column_parallel_shard(wrapped) is None


def test_replicated_norm_is_transformers_replicated_norm_and_nothing_else(one_rank_mesh):
    """A norm between a column- and a row-parallel layer (Qwen3's q/k norms), as transformers' tensor parallelism
    leaves it: where the release gives it an instance forward (5.24) or a forward pre-hook (5.25), `replicated_norm`
    knows it and, without gradients, its forward is the class's own (what the fused layers run); 5.17 gives it a
    backward hook only, which the fused layers' other checks take. Any other hook is refused."""
    name = "ReplicatedWithGradAllReduce.install_forward (Qwen3's q/k norms under tensor parallelism)"
    from transformers.distributed import tensor_parallel

    norm = torch.nn.LayerNorm(4)
    tensor_parallel.ReplicatedWithGradAllReduce().install_forward(norm, one_rank_mesh)
    if "forward" in vars(norm) or norm._forward_pre_hooks:
        assert compat.replicated_norm(norm), changed(name, "no longer gives the forward or pre-hook hf_vegas knows")
        x = torch.randn(2, 4)
        with torch.no_grad():
            torch.testing.assert_close(norm(x), torch.nn.LayerNorm.forward(norm, x))
    other = torch.nn.LayerNorm(4)
    assert not compat.replicated_norm(other), "a plain norm is not transformers' replicated one"
    other.register_forward_pre_hook(lambda module, args: None)
    assert not compat.replicated_norm(other), "another pre-hook is code the fused layers would skip"
    norm.register_forward_hook(lambda module, args, output: output)
    assert not compat.replicated_norm(norm), "a forward hook beside it is code the fused layers would skip"


def test_column_parallel_shard_takes_only_transformers_column_parallel_forward():
    """What it must refuse without any process group."""
    linear = torch.nn.Linear(8, 4)
    assert compat.column_parallel_shard(linear) is None, "a plain linear has no shard"

    def tp_forward(x):  # the name alone, with no tensor-parallel style in its closure
        return x

    linear.forward = tp_forward
    assert compat.column_parallel_shard(linear) is None


def test_row_parallel_shard_is_the_partial_product_transformers_row_parallel_forward_sums(one_rank_mesh):
    """The kernels hand `row_parallel_shard`'s weight times the input to the style's own output method, which sums the
    ranks' products and adds the bias: on one rank that is the forward's result. Other styles, a layer wrapped before
    transformers' forward, and a plain linear have no row-parallel shard."""
    name = "TensorParallelLayer.install_forward (tp_forward's closure) and RowwiseParallel"
    from torch.distributed.tensor import Replicate, Shard
    from transformers.distributed.tensor_parallel import ColwiseParallel, RowwiseParallel

    linear = _parallel_linear(RowwiseParallel(), one_rank_mesh)
    found = compat.row_parallel_shard(linear)
    assert found is not None, changed(name, "no longer gives a row-parallel linear's shard, style and mesh")
    weight, style, mesh = found
    assert type(weight) is not type(linear.weight) and weight.shape == (4, 8) and mesh is one_rank_mesh
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        partial = torch.nn.functional.linear(x, weight)
        torch.testing.assert_close(style.transform_output_post_forward(linear, partial, mesh), linear(x))
    assert compat.row_parallel_shard(_parallel_linear(RowwiseParallel(), one_rank_mesh, bias=False)) is not None
    for style in (ColwiseParallel(), RowwiseParallel(output_layouts=Shard(-1)),
                  RowwiseParallel(input_layouts=Replicate())):
        assert compat.row_parallel_shard(_parallel_linear(style, one_rank_mesh)) is None, type(style).__name__
    wrapped = torch.nn.Linear(8, 4)
    wrapped.forward = lambda x, _wrapped=wrapped: torch.nn.functional.linear(x, _wrapped.weight) * 2
    RowwiseParallel().shard_param(wrapped, "weight", one_rank_mesh)
    RowwiseParallel().install_forward(wrapped, one_rank_mesh)
    assert compat.row_parallel_shard(wrapped) is None
    assert compat.row_parallel_shard(torch.nn.Linear(8, 4)) is None


def test_a_draft_row_parallel_projection_is_the_kernel_product_summed_and_biased_once(one_rank_mesh, monkeypatch):
    """`fused_projections._fuse_single` on a row-parallel projection with a bias (weights counted as large): in a draft
    it is one `linear_op` of the rank's shard, then transformers' sum and bias (a bias added in the kernel too would
    show twice here, on one rank); with gradients, on a `DTensor` input, on an input of another width or outside
    drafts it is transformers' forward; the forward it had comes back (the very object)."""
    import hf_vegas_kernels
    from torch.distributed.tensor import DTensor, Shard
    from transformers.distributed.tensor_parallel import RowwiseParallel

    from hf_vegas import fused_projections as fused_module

    monkeypatch.setattr(fused_module, "MAX_WEIGHT_BYTES", 0)
    calls = []
    real = hf_vegas_kernels.linear_op
    monkeypatch.setattr(hf_vegas_kernels, "linear_op", lambda *args: calls.append(args[2]) or real(*args))
    torch.manual_seed(0)
    parent = torch.nn.Module()
    parent.o_proj = torch.nn.Linear(48, 32)
    with torch.no_grad():
        parent.o_proj.bias.uniform_(1.0, 2.0)
    for name in ("weight", "bias"):
        RowwiseParallel().shard_param(parent.o_proj, name, one_rank_mesh)
    RowwiseParallel().install_forward(parent.o_proj, one_rank_mesh)
    own, drafting = parent.o_proj.forward, [True]
    patched = fused_module._fuse_single(parent, "o_proj", hf_vegas_kernels, lambda: drafting[0])
    assert patched == [(parent.o_proj, own)]
    x = torch.randn(3, 1, 48)
    with torch.no_grad():
        expected = own(x)
        torch.testing.assert_close(parent.o_proj(x), expected, atol=1e-5, rtol=1e-5)
        assert calls == [None], "one kernel launch, without the bias (added once, after the sum)"
        drafting[0] = False
        torch.testing.assert_close(parent.o_proj(x), expected)
        drafting[0] = True
        parent.o_proj(DTensor.from_local(x, one_rank_mesh, [Shard(-1)]))
        assert len(calls) == 1, "a DTensor input takes transformers' forward"
    parent.o_proj(x)  # gradients on
    assert len(calls) == 1, "with gradients the forward is transformers'"
    with torch.no_grad(), pytest.raises(RuntimeError):
        parent.o_proj(torch.randn(3, 1, 40))  # another width: transformers' forward refuses it, not the kernel
    assert len(calls) == 1
    for module, forward in patched:  # as `fused_projections` restores
        module.forward = forward
    assert vars(parent.o_proj)["forward"] is own
