"""Modules' backward hooks set aside while a compiled generation runs (they cannot fire there: no gradients).

torch.compile cannot trace a call of a module that has a backward hook: dynamo breaks the graph there ("Module-level
backwards hooks require compiled autograd"), whether or not gradients are on. transformers 5.17's tensor parallelism
puts one on every replicated module (`ReplicatedWithGradAllReduce`, to all-reduce its weight's gradient): Qwen3's
`q_norm` and `k_norm`, i.e. two graph breaks per attention layer. Each break resumes in a new frame compiled per
layer (their `layer_idx` is static), so after 8 layers dynamo reaches its recompile limit and runs the rest of the
forward uncompiled, one kernel per operation (seen on 2 x H200 with the Qwen3-8B shape, transformers 5.17; 5.24
installs no such hook).

`generate` runs without gradients (`torch.no_grad`), where a backward hook is never called. Inside
`backward_hooks_set_aside` the modules of `model` that have backward hooks hold empty hook dicts instead; the block
puts the very same dicts back when it exits, also on an exception. It does nothing while gradients are enabled
(there a hook could fire) or when not `enabled` (a generation that does not compile).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch

_HOOK_DICTS = ("_backward_hooks", "_backward_pre_hooks")


@contextlib.contextmanager
def backward_hooks_set_aside(model: torch.nn.Module, enabled: bool = True):
    """Inside the block, `model`'s modules have no backward hooks (see the module docstring). Yields the number of
    modules whose hooks were set aside."""
    aside = []
    try:
        if enabled and not torch.is_grad_enabled():
            for module in model.modules():
                for name in _HOOK_DICTS:
                    hooks = getattr(module, name, None)
                    if hooks:
                        setattr(module, name, OrderedDict())
                        aside.append((module, name, hooks))
        yield len({id(module) for module, _, _ in aside})
    finally:
        for module, name, hooks in aside:
            setattr(module, name, hooks)
