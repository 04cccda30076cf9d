"""Checks that run before any forward pass: bad input fails fast, naming the argument and what is allowed."""

from __future__ import annotations

import torch

from .cache import layer_types

# What transformers' own preparation leaves in `model_kwargs` for a decoder-only model; anything else came from the
# user and would be silently dropped, so it is refused.
PREPARED_MODEL_KWARGS = {"attention_mask", "position_ids", "logits_to_keep", "past_key_values", "use_cache"}
SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}
UNSUPPORTED_OUTPUTS = ("output_attentions", "output_hidden_states", "output_scores", "output_logits")


def check_model(model) -> None:
    config = model.config
    if config.is_encoder_decoder:
        raise ValueError("hf_vegas supports decoder-only models; this model is an encoder-decoder.")
    if not type(model)._can_set_attn_implementation():
        raise ValueError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, so "
            "hf_vegas cannot switch it to sparse drafting (unsupported attention type)."
        )
    text_config = config.get_text_config(decoder=True)
    types = layer_types(text_config)
    unsupported = set(types) - SUPPORTED_LAYER_TYPES
    if unsupported:
        raise ValueError(
            f"Unsupported attention layer type(s) {sorted(unsupported)}; hf_vegas supports "
            f"{sorted(SUPPORTED_LAYER_TYPES)}."
        )
    if "full_attention" not in types:
        raise ValueError(
            f"hf_vegas drafts sparsely in full-attention layers only, and every layer of this model attends through a "
            f"sliding window (config.sliding_window={getattr(text_config, 'sliding_window', None)}): drafts would be "
            "the model itself. Models with sliding_window=None (e.g. Mistral v0.2+) are supported."
        )
    if getattr(text_config, "use_bidirectional_attention", False):
        raise ValueError("hf_vegas needs causal attention; this config sets use_bidirectional_attention=True.")
    if model.training:
        raise ValueError("hf_vegas runs inference only: call model.eval() before generate.")


def check_generation_config(generation_config) -> None:
    if generation_config.num_beams != 1:
        raise ValueError(f"hf_vegas does not support beam search: `num_beams` must be 1, got {generation_config.num_beams}.")
    if generation_config.use_cache is False:
        raise ValueError("hf_vegas decodes from its own KV cache: `use_cache=False` is not supported.")
    if generation_config.cache_implementation is not None:
        raise ValueError(
            f"`cache_implementation={generation_config.cache_implementation!r}` is not supported: hf_vegas "
            "always uses its own static VegasCache. Remove the argument."
        )
    if generation_config.return_dict_in_generate:
        asked = [name for name in UNSUPPORTED_OUTPUTS if getattr(generation_config, name, False)]
        if asked:
            raise ValueError(f"hf_vegas does not return {asked} yet; allowed extra output: `return_dict_in_generate`.")


def check_model_kwargs(model_kwargs: dict) -> None:
    cache = model_kwargs.get("past_key_values")
    if cache is not None and getattr(cache, "_is_user_defined", False):
        raise ValueError(
            f"A cache was passed in (`past_key_values={type(cache).__name__}`); hf_vegas builds its own static "
            "VegasCache and cannot continue from another cache. Remove `past_key_values`."
        )
    extra = sorted(set(model_kwargs) - PREPARED_MODEL_KWARGS)
    if extra:
        raise ValueError(
            f"hf_vegas does not support the model input(s) {extra}; decoder-only text generation takes "
            "`input_ids` and `attention_mask`."
        )


def left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Number of leading pad tokens per row; raises unless every row is `[0 ... 0, 1 ... 1]`."""
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"`input_ids` must be a non-empty (batch, length) tensor, got shape {tuple(input_ids.shape)}.")
    if attention_mask is None:
        return torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    mask = attention_mask.to(device=input_ids.device, dtype=torch.long)
    if mask.shape != input_ids.shape:
        raise ValueError(f"`attention_mask` shape {tuple(mask.shape)} does not match `input_ids` {tuple(input_ids.shape)}.")
    pad = (mask == 0).sum(dim=1)
    expected = torch.arange(mask.shape[1], device=mask.device)[None, :] >= pad[:, None]
    if not torch.equal(mask.bool(), expected) or bool((pad == mask.shape[1]).any()):
        raise ValueError(
            "hf_vegas needs left padding: every `attention_mask` row must be zeros then ones, with at least one "
            "token (use tokenizer(..., padding_side='left'))."
        )
    return pad


def check_streamer(streamer, batch_size: int) -> None:
    if streamer is not None and batch_size != 1:
        raise ValueError(f"A `streamer` needs batch size 1; got a batch of {batch_size}.")
