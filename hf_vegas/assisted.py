"""Run the Vegas drafter inside transformers' own assisted-decoding loop (batch 1).

transformers has no public argument for a custom `CandidateGenerator`; assisted decoding builds its generator in
`_get_candidate_generator`. `assisted_generate` overrides that method on this model instance for one call
(`hf_vegas._compat.internals.candidate_generator`) and selects the assisted mode with `prompt_lookup_num_tokens`
(only used as the mode switch). HF then verifies, accepts, crops the cache and stops; `hf_vegas.generate` is the
batched loop and the faster choice.
"""

from __future__ import annotations

import torch

from . import placement, symmetric_all_reduce, tensor_parallel, validation
from ._compat import internals as compat
from .attention import active_cache, vegas_attention
from .cache import VegasCache
from .candidate import VegasCandidateGenerator
from .config import resolve_config
from .fused_layers import fused_steps
from .ops import backend


@torch.no_grad()
def assisted_generate(model, input_ids: torch.LongTensor, vegas_config=None, max_new_tokens: int = 20, **kwargs):
    r"""
    `model.generate` in HF's assisted-decoding mode with `VegasCandidateGenerator` as the drafter.

    Args:
        input_ids (`torch.LongTensor` of shape `(1, length)`): the prompt (HF's assisted loop is batch 1).
        vegas_config (`VegasConfig` or `dict`, *optional*): Vegas settings; flat `vegas_*` keys are accepted too.
        max_new_tokens (`int`): as in `generate`. Other keyword arguments go to `generate`.
    """
    flat = {k: kwargs.pop(k) for k in list(kwargs) if k.startswith("vegas_")}
    config = resolve_config(vegas_config, **flat)
    if config.gamma == 0:
        raise ValueError("`vegas_gamma=0` (no drafts) has nothing to assist: use hf_vegas.generate, or gamma >= 1.")
    if config.gamma == "auto":
        raise ValueError("`vegas_gamma='auto'` runs in hf_vegas.generate; HF's assisted loop drafts a fixed number of "
                         "tokens: pass an integer gamma >= 1.")
    if config.compile:
        raise ValueError(
            "`vegas_compile=True` compiles captured steps; HF's assisted loop runs eagerly. Leave it off."
        )
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"HF's assisted decoding runs batch 1; got input_ids of shape {tuple(input_ids.shape)}.")
    chunk = kwargs.get("prefill_chunk_size")
    if chunk is None:  # not passed: what the generation config transformers will use holds
        chunk = getattr(kwargs.get("generation_config") or model.generation_config, "prefill_chunk_size", None)
    if chunk is not None:
        raise ValueError(
            f"`prefill_chunk_size={chunk!r}` runs in hf_vegas.generate; in HF's assisted loop the drafter prefills "
            "the prompt in one forward. Remove it, or use hf_vegas.generate."
        )
    validation.check_synced_gpus(model, kwargs.get("synced_gpus"))
    validation.check_model(model)
    capacity = input_ids.shape[1] + max_new_tokens + 2 * config.gamma + 1
    validation.check_layers(model, capacity, config)
    symmetric = config.tp_all_reduce == "symmetric_memory"
    if symmetric:
        symmetric_all_reduce.check(model, input_ids.device)
    backend_name = backend.resolve_backend(config.backend, input_ids.device, model.dtype)
    cache = VegasCache(model.config, 1, capacity, config, device=input_ids.device, backend=backend_name,
                       layer_devices=placement.layer_devices(model))
    cache.selection.pool_over(tensor_parallel.score_group(model) if config.selection_heads == "all" else None)
    fusing = backend_name == "triton" and config.fuse_projections and not cache.spread

    def drafter(generation_config, logits_processor):
        return VegasCandidateGenerator(model, cache, logits_processor, bool(generation_config.do_sample))

    with (
        vegas_attention(model),
        active_cache(cache),
        compat.candidate_generator(model, drafter),
        placement.device_guard(input_ids.device),
        symmetric_all_reduce.symmetric_all_reduces(model, config.gamma + 1, input_ids.device, symmetric,
                                                   draft_rows=1 if fusing else 0) as exchange,
        fused_steps(model, cache, fusing, exchange),
    ):
        return model.generate(
            input_ids,
            **{compat.CACHE_KEYWORD: cache},
            prompt_lookup_num_tokens=config.gamma,
            max_new_tokens=max_new_tokens,
            **kwargs,
        )
