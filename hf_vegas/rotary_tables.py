"""The rotary tables written once per compiled forward, instead of recomputed in every layer's rotations.

A model computes `cos` and `sin` of each position's rotary angles once per forward (its `*RotaryEmbedding`
module) and hands them to every layer. Compiled, inductor does not keep them as tensors: it inlines the two
transcendentals into each kernel that rotates a query or a key, so every layer recomputes both tables for every
element it rotates. In a SmolLM2 verification (64 rows x 7 tokens, H100, `benchmarks/profile_forward.py --compile`)
its 60 rotations took 4.65 us each, against 1.4-1.8 us for the one-token rotations of a dense step. Returned by an
op, which inductor cannot look into, the tables are one buffer per forward that every rotation reads.

The values are the same: the buffer holds the very `cos` and `sin` the module returned (the same fp32 angles, rounded
to the model's dtype as before), so no rotation changes by a bit. Eager forwards are left alone (there the module's
outputs already are such tensors), and so are the draft steps of fused layers, which write their tables themselves
(`draft_layers`). The modules are changed by an instance-level `forward` attribute, removed when the block exits,
also on an exception.
"""

from __future__ import annotations

import contextlib

import torch


@torch.library.custom_op("hf_vegas::rotary_tables", mutates_args=())
def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`(2, *cos.shape)`: `cos` and `sin` stacked into one new buffer."""
    return torch.stack((cos, sin))


@rotary_tables.register_fake
def _(cos, sin):
    return cos.new_empty(2, *cos.shape)


def _rotary_modules(model) -> list[torch.nn.Module]:
    """The modules of `model` that compute rotary tables: HF names their classes `...RotaryEmbedding`."""
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


@contextlib.contextmanager
def rotary_tables_once(model, skip=lambda: False):
    """Inside the block, every compiled forward of `model` hands its layers rotary tables written by one op (see the
    module docstring), except while `skip()` says so. Yields the number of rotary modules changed."""
    patched = []
    try:
        for module in _rotary_modules(model):
            standard = type(module).forward

            def forward(*args, _module=module, _standard=standard, **kwargs):
                out = _standard(_module, *args, **kwargs)
                if not torch.compiler.is_compiling() or skip():
                    return out
                if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
                        and out[0].shape == out[1].shape and out[0].dtype == out[1].dtype):
                    return out  # not a (cos, sin) pair: a module of another shape, left as it computes
                tables = rotary_tables(*out)
                return tables[0], tables[1]

            module.forward = forward
            patched.append(module)
        yield len(patched)
    finally:
        for module in patched:
            del module.forward  # the class's forward again
