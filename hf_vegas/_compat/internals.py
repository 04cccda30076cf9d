"""Private transformers names hf_vegas uses while it generates, one function each.

Each function names the attribute it reads and the transformers versions it was checked on. When a release moves
one of them, the function raises `TransformersChanged` naming the attribute (rather than an `AttributeError` from
deep inside a generation), and `tests/test_compat.py` fails with the same name.
"""

from __future__ import annotations

import contextlib
import sys
import types

import transformers
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

# The releases every function here was checked on (pyproject.toml allows the 5.x releases from the first).
CHECKED_ON = ("5.17.0", "5.23.0", "5.24.0", "5.25.0")

# The keyword a model's forward and `generate` take the cache by, which is also the field of their outputs that holds
# it: transformers 5.24 renamed `past_key_values` to `cache` (the old keyword still works, with a deprecation warning,
# until 5.40). Told by the output class's fields, so a development release is read right too.
CACHE_KEYWORD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


class TransformersChanged(RuntimeError):
    """A private transformers name hf_vegas relies on is missing or changed in the installed release."""


def changed(name: str, detail: str = "") -> TransformersChanged:
    """The error for a private name `name` that the installed transformers no longer provides as hf_vegas uses it."""
    return TransformersChanged(
        f"hf_vegas relies on transformers' private `{name}`, checked on transformers {' and '.join(CHECKED_ON)}; the "
        f"installed transformers {transformers.__version__} changed it{': ' + detail if detail else ''}. Install a "
        "checked release, or see hf_vegas/_compat/internals.py."
    )


# -- special tokens --------------------------------------------------------------------------------------------------

def _special_token_tensor(generation_config, name: str):
    if not hasattr(generation_config, name):
        raise changed(f"GenerationConfig.{name}", "generate no longer sets it before calling custom_generate")
    return getattr(generation_config, name)


def eos_token_tensor(generation_config):
    """The EOS ids as a 1-D tensor on the inputs' device, or None: `generation_config._eos_token_tensor`.

    `GenerationMixin._prepare_special_tokens` sets it on the config it hands a custom_generate callable, after merging
    the model's config, the passed one and the keywords (5.17.0, 5.23.0). Reading it keeps hf_vegas's EOS exactly
    vanilla's, lists and the model-config fallback included.
    """
    return _special_token_tensor(generation_config, "_eos_token_tensor")


def pad_token_tensor(generation_config):
    """The pad id as a 0-D tensor, or None: `generation_config._pad_token_tensor` (as `eos_token_tensor`; when only
    EOS is set, transformers uses its first id, as vanilla pads with it). Checked on 5.17.0, 5.23.0."""
    return _special_token_tensor(generation_config, "_pad_token_tensor")


# -- caches ----------------------------------------------------------------------------------------------------------

def is_user_cache(cache) -> bool:
    """Whether the user passed `cache` as `past_key_values=`, rather than transformers building it for
    `cache_implementation`: `Cache._is_user_defined`, which `GenerationMixin._prepare_cache_for_generation` sets on a
    cache the user passed and leaves unset on the ones it builds (5.17.0, 5.23.0)."""
    return bool(getattr(cache, "_is_user_defined", False))


# -- attention implementation ----------------------------------------------------------------------------------------

def attn_implementation(model):
    """The attention implementation `model` runs now (`"sdpa"`, `"eager"`, ...), in the form
    `model.set_attn_implementation` takes back: `model.config._attn_implementation` (5.17.0, 5.23.0; transformers has
    no public getter)."""
    try:
        return model.config._attn_implementation
    except AttributeError:
        raise changed("PretrainedConfig._attn_implementation") from None


def can_set_attn_implementation(model) -> bool:
    """Whether `model`'s attention goes through `AttentionInterface`, so that `set_attn_implementation("vegas")`
    reaches every attention layer: `PreTrainedModel._can_set_attn_implementation()`, a classmethod that reads the
    class's module source (5.17.0, 5.23.0)."""
    method = getattr(type(model), "_can_set_attn_implementation", None)
    if not callable(method):
        raise changed("PreTrainedModel._can_set_attn_implementation", "the classmethod is gone")
    return bool(method())


# -- generate arguments a custom_generate callable does not receive --------------------------------------------------

def generate_call_argument(name: str):
    """The value of `name` (`streamer`, `synced_gpus`) in the enclosing `GenerationMixin.generate` call, if any.

    transformers (5.17.0, 5.23.0) replaces the mode keywords of a custom_generate callable by the callable's own
    extra parameters (`GenerationMixin._extract_generation_mode_kwargs`), so a user's `streamer=` or `synced_gpus=`
    never reaches it; without this lookup they would be silently ignored. It walks up the stack to the innermost
    frame of a function named `generate` whose `self` is a model and reads its local `name` (generate's parameter).
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "generate" and isinstance(frame.f_locals.get("self"), GenerationMixin):
            return frame.f_locals.get(name)
        frame = frame.f_back
    return None


def synced_gpus(model, requested: bool | None) -> bool:
    """Whether a generate call with `synced_gpus=requested` runs synchronised across GPUs, as transformers decides:
    the value given, or, when it is None, on under DeepSpeed ZeRO-3 or FSDP with more than one process.

    transformers takes that decision in `GenerationMixin._extract_generation_mode_kwargs` and does not pass the
    result to a custom_generate callable; asking the same method keeps hf_vegas's answer vanilla's (5.17.0, 5.23.0).
    """
    method = getattr(model, "_extract_generation_mode_kwargs", None)
    if method is None:
        raise changed("GenerationMixin._extract_generation_mode_kwargs", "the method is gone")
    try:
        decided = method(custom_generate=None, kwargs={}, synced_gpus=requested, assistant_model=None, streamer=None)
    except TypeError as error:
        raise changed("GenerationMixin._extract_generation_mode_kwargs", str(error)) from None
    return bool(decided.get("synced_gpus", False))


# -- assisted decoding -----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def candidate_generator(model, build):
    """Inside the block, HF's assisted-decoding loop on `model` drafts with `build(generation_config,
    logits_processor)`, a `CandidateGenerator`.

    transformers has no argument for a custom candidate generator: `GenerationMixin._assisted_decoding` asks
    `self._get_candidate_generator(generation_config=..., logits_processor=..., ...)` (keywords, 5.17.0, 5.23.0).
    This overrides that method on this instance only, and puts back what the instance had after the block.
    """
    name = "_get_candidate_generator"
    if not callable(getattr(type(model), name, None)):
        raise changed(f"GenerationMixin.{name}", "the method is gone")

    def method(self, generation_config, logits_processor, **unused):
        return build(generation_config, logits_processor)

    had_own = name in vars(model)
    previous = vars(model).get(name)
    setattr(model, name, types.MethodType(method, model))
    try:
        yield
    finally:
        if had_own:
            setattr(model, name, previous)
        else:
            delattr(model, name)


# -- tensor parallelism ----------------------------------------------------------------------------------------------

def tensor_parallel_module():
    """transformers' tensor-parallel module. Its row-parallel layers sum their partial outputs with `dist.all_reduce`
    (`RowwiseParallel.transform_output_post_forward`, 5.17.0 and 5.24.0), `dist` being its name for
    `torch.distributed` (or, during a generation with `vegas_tp_all_reduce="symmetric_memory"`, hf_vegas' stand-in)."""
    try:
        from transformers.distributed import tensor_parallel as module
    except ImportError as error:
        raise changed("transformers.distributed.tensor_parallel", str(error)) from None
    if not hasattr(module, "dist"):
        raise changed("transformers.distributed.tensor_parallel.dist", "the module no longer names torch.distributed")
    return module


def _tensor_parallel_forward(linear, style_name: str) -> tuple | None:
    """(layer style, mesh) if `linear`'s forward is transformers' tensor-parallel one (`TensorParallelLayer.
    install_forward`'s `tp_forward`, a closure over the style (`self`), the module, the mesh and the forward it wraps:
    5.17.0 and 5.24.0) of the style class `style_name` exactly, wrapping `nn.Linear`'s own forward; else None."""
    captured = _tp_forward_closure(linear)
    if captured is None:
        return None
    try:
        from transformers.distributed import tensor_parallel
    except ImportError:
        return None
    style = captured.get("self")
    if type(style) is not getattr(tensor_parallel, style_name, None) or captured.get("module") is not linear:
        return None
    return style, captured.get("mesh")


def replicated_norm(module) -> bool:
    """Whether transformers' tensor parallelism made `module` a replicated norm between a column- and a row-parallel
    layer (`ReplicatedWithGradAllReduce`: Qwen3's `q_norm` and `k_norm`) in a form whose forward, without gradients,
    is just the class's own, and nothing else hooks it:
    - 5.24.0: an instance forward (`install_forward`'s `tp_forward`) wrapping the class's forward, no hooks;
    - 5.25.0: no instance forward and one forward pre-hook (`install_forward`'s `tp_forward_pre_hook`), which only
      hooks the weight's gradient while gradients are enabled.
    5.17.0 puts a module backward hook there instead and no forward (`hf_vegas.backward_hooks`)."""
    if module._forward_hooks:
        return False
    forward = vars(module).get("forward")
    if forward is not None:
        return (not module._forward_pre_hooks and getattr(forward, "__qualname__", "") == _REPLICATED + "tp_forward"
                and _tp_forward_closure(module) is not None)
    hooks = list(module._forward_pre_hooks.values())
    return len(hooks) == 1 and getattr(hooks[0], "__qualname__", "") == _REPLICATED + "tp_forward_pre_hook"


_REPLICATED = "ReplicatedWithGradAllReduce.install_forward.<locals>."


def _tp_forward_closure(module) -> dict | None:
    """The variables `module`'s instance forward closes over, if it is a `tp_forward` of transformers' tensor
    parallelism wrapping the class's own forward (`original_forward`; not another instance forward installed before
    it), else None."""
    forward = vars(module).get("forward")
    code = getattr(forward, "__code__", None)
    if code is None or code.co_name != "tp_forward" or forward.__closure__ is None:
        return None
    try:
        captured = dict(zip(code.co_freevars, (cell.cell_contents for cell in forward.__closure__)))
    except ValueError:  # an empty cell
        return None
    wrapped = captured.get("original_forward")
    if (getattr(wrapped, "__func__", None) is not type(module).forward
            or getattr(wrapped, "__self__", None) is not module):
        return None
    return captured


def column_parallel_shard(linear) -> tuple | None:
    """(weight, bias) of this rank's shard if `linear` is an `nn.Linear` that transformers' tensor parallelism made
    column-parallel with a local, column-sharded output (`ColwiseParallel`, exactly: replicated input, output
    `Shard(-1)` handed on as a plain tensor), else None.

    Without gradients and on a plain input its forward is `F.linear` with the local weight and bias
    (`ColwiseParallel`'s "inference fast path"), whose output columns are this rank's: the same product a kernel
    computes from the shard."""
    found = _tensor_parallel_forward(linear, "ColwiseParallel")
    if found is None:
        return None
    from torch.distributed.tensor import DTensor, Replicate, Shard

    style = found[0]
    if not style.use_local_output or style.input_layouts != Replicate() or style.output_layouts != Shard(-1):
        return None
    weight, bias = linear.weight, linear.bias
    if not isinstance(weight, DTensor) or weight.placements != (Shard(0),):
        return None
    if bias is not None and (not isinstance(bias, DTensor) or bias.placements != (Shard(0),)):
        return None
    return weight.to_local(), None if bias is None else bias.to_local()


def row_parallel_shard(linear) -> tuple | None:
    """(weight shard, layer style, mesh) if `linear` is an `nn.Linear` that transformers' tensor parallelism made
    row-parallel (`RowwiseParallel`, exactly: input `Shard(-1)`, output `Replicate()`; weight sharded over its input
    columns, bias replicated or none), else None.

    Without gradients, on a plain input, its forward is `F.linear` of the input (this rank's columns) with the local
    weight and no bias, then `style.transform_output_post_forward(linear, partial, mesh)`: the all-reduce over the
    ranks, then the bias. A kernel may compute the partial product and hand it to the same method."""
    found = _tensor_parallel_forward(linear, "RowwiseParallel")
    if found is None:
        return None
    from torch.distributed.tensor import DTensor, Replicate, Shard

    style, mesh = found
    if mesh is None or style.input_layouts != Shard(-1) or style.output_layouts != Replicate():
        return None
    weight, bias = linear.weight, linear.bias
    if not isinstance(weight, DTensor) or weight.ndim != 2 or weight.placements not in ((Shard(1),), (Shard(-1),)):
        return None
    if isinstance(bias, DTensor) and bias.placements != (Replicate(),):
        return None
    return weight.to_local(), style, mesh
