"""A prompt cache the user prefilled (`cache=DynamicCache`, `past_key_values=` before transformers 5.24; the
prompt-reuse recipe): checked before any forward, then copied into the empty rows of the `VegasCache`, whose prefill
continues after it."""

from __future__ import annotations

import torch
from hf_vegas_kernels import naive
from transformers.cache_utils import Cache, DynamicCache

from ._compat import internals as compat
from .cache import VegasCache

_NAME = compat.CACHE_KEYWORD  # the keyword the user passed the cache by, in errors


def checked(cache, prompt_length: int, batch: int) -> DynamicCache | None:
    """The user's prefilled prompt cache (`compat.CACHE_KEYWORD`), checked; None when none was passed.

    hf_vegas copies its keys and values into its own cache and prefills the rest of the prompt; the user's cache is
    left as it was (vanilla would extend it in place).
    """
    if cache is None:
        return None
    if cache.get_seq_length() == 0:
        if compat.is_user_cache(cache):  # vanilla would fill it for the caller; hf_vegas keeps its own cache
            raise ValueError(
                f"`{_NAME}` is an empty {type(cache).__name__}: hf_vegas decodes in its own cache and would "
                "not fill yours. Pass no cache, or a DynamicCache prefilled with the start of the prompt."
            )
        return None  # built by transformers for `cache_implementation`: nothing to copy
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"`{_NAME}` must be a prefilled DynamicCache (the prompt-reuse recipe), got "
            f"{type(cache).__name__}: hf_vegas copies it into its own static cache. Remove it, or pass a DynamicCache."
        )
    rows = sorted({layer.keys.shape[0] for layer in cache.layers if getattr(layer, "keys", None) is not None})
    if rows != [batch]:
        raise ValueError(f"`{_NAME}` holds a batch of {'/'.join(map(str, rows))} rows; the prompt has "
                         f"{batch}. Prefill the prompt cache with the same batch.")
    cached = cache.get_seq_length()
    if cached >= prompt_length:
        raise ValueError(
            f"`{_NAME}` already holds {cached} positions but the prompt has {prompt_length}: pass the whole "
            "prompt (cached part included) with at least one position the cache does not hold."
        )
    return cache


def load(cache: VegasCache, prefix: Cache, left_pad: torch.Tensor) -> None:
    """Copy a prefilled prompt cache (`(B, kv_heads, positions, head_dim)` per layer, left-padded like the prompt)
    into the empty rows; a sliding layer may hold only its last positions. Sets each row's length."""
    if len(prefix.layers) != len(cache.layers):
        raise ValueError(f"The prompt cache has {len(prefix.layers)} layers; this model has {len(cache.layers)}.")
    cached = prefix.get_seq_length()
    for index, (layer, source) in enumerate(zip(cache.layers, prefix.layers)):
        held = source.keys.shape[2]
        if held != cached and not layer.is_sliding:
            raise ValueError(f"A full-attention layer of the prompt cache holds {held} of {cached} positions.")
        if not layer.is_initialized:
            layer.lazy_initialization(source.keys[:, :, :0], source.values[:, :, :0])
        # A pooled cache is already laid out: the prompt cache must match it (heads, head dims), as the model's
        # own forwards would.
        stored = (layer.keys.shape[2], layer.keys.shape[3], layer.values.shape[3])
        given = (source.keys.shape[1], source.keys.shape[3], source.values.shape[3])
        if stored != given:
            raise ValueError(f"Layer {index} of `{_NAME}` has (heads, key dim, value dim) {given}; this "
                             f"model's cache has {stored}.")
        positions = torch.arange(cached - held, cached, device=cache.device)
        slots = positions[None, :] - left_pad[:, None]
        slots = torch.where(slots < 0, cache.capacity, slots)  # pads go to the scratch slot, as in a prefill
        naive.write_kv(layer.keys, layer.values, source.keys.to(layer.device), source.values.to(layer.device),
                       slots.to(layer.device))
    cache.plan.lengths.copy_((cached - left_pad).clamp_min(0))
