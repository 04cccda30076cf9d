"""The rotary tables written once per compiled forward, instead of recomputed in every layer's rotations.

A model computes `cos` and `sin` of each position's rotary angles once per forward (its `*RotaryEmbedding`
module) and hands them to every layer. Compiled, inductor does not keep them as tensors: it inlines the two
transcendentals into each kernel that rotates a query or a key, so every layer recomputes both tables for every
element it rotates. In a SmolLM2 verification (64 rows x 7 tokens, H100, `benchmarks/profile_forward.py --compile`)
its 60 rotations took 4.65 us each, against 1.4-1.8 us for the one-token rotations of a dense step. Returned by an
op, which inductor cannot look into, the tables are one buffer per forward that every rotation reads: 1.42 us each
(H100, 8eaac62 against dc9a8c6).

The values are the same: the buffer holds the very `cos` and `sin` the module returned (the same fp32 angles, rounded
to the model's dtype as before). That no rotation changes by a bit holds because the steps compile with
`graphs.INDUCTOR_OPTIONS` (`emulate_precision_casts`): inductor then rounds the inlined tables to the model's dtype as
eager does; without it the inlined tables stay fp32 and the rotations round otherwise (`tests/test_rotary_tables.py`
compares with inductor where a C++ compiler is found). Eager forwards are left alone (there the module's outputs
already are such tensors), and so are the draft steps of fused layers, which write their tables with the same op
themselves (`fused_layers`: once per chain of fused layers). A module is changed by an
instance-level `forward` attribute that calls the one it had (the class's, or an instance attribute of its own, such
as accelerate's hooks), which is put back when the block exits, also on an exception.
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
def rotary_tables_once(model, enabled: bool = True, skip=lambda: False):
    """Inside the block, every compiled forward of `model` hands its layers rotary tables written by one op (see the
    module docstring), except while `skip()` says so; a no-op block when not `enabled` (a generation that does not
    compile). Yields the number of rotary modules changed."""
    patched = []
    try:
        for module in _rotary_modules(model) if enabled else []:
            own = vars(module).get("forward")  # e.g. accelerate's hook: kept, called, and put back
            standard = module.forward  # (that one, or the class's, bound)

            def forward(*args, _standard=standard, **kwargs):
                out = _standard(*args, **kwargs)
                if not torch.compiler.is_compiling() or skip():
                    return out
                if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
                        and out[0].shape == out[1].shape and out[0].dtype == out[1].dtype):
                    return out  # not a (cos, sin) pair: a module of another shape, left as it computes
                tables = rotary_tables(*out)
                return tables[0], tables[1]

            module.forward = forward
            patched.append((module, own))
        yield len(patched)
    finally:
        for module, own in patched:
            if own is None:
                del module.forward  # the class's forward again
            else:
                module.forward = own
