"""Checks that run before any forward pass: bad input fails fast, naming the argument and what is allowed."""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor

from ._compat import internals as compat
from .cache import layer_types, sparse_layers
from .config import SHORT_WINDOW

# What transformers' own preparation leaves in `model_kwargs` for a decoder-only model; anything else came from the
# user and would be silently dropped, so it is refused.
PREPARED_MODEL_KWARGS = {
    "attention_mask", "position_ids", "logits_to_keep", compat.CACHE_KEYWORD, "use_cache", "inputs_embeds"
}
EMPTY_OK = {"mm_encoder_outputs"}
MEDIA_INPUTS = {"mm_encoder_outputs", "pixel_values", "pixel_values_videos", "image_sizes", "input_features",
                "input_values", "image_grid_thw", "video_grid_thw", "mm_token_type_ids"}
SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}
UNSUPPORTED_OUTPUTS = ("output_attentions", "output_hidden_states")
# The decoding mode is transformers' own (`GenerationConfig.get_generation_mode`); these are the fields that switch it
# away from greedy decoding and sampling, named in the error when set.
DECODING_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
MODE_FIELDS = ("num_beams", "num_beam_groups", "constraints", "force_words_ids", "penalty_alpha", "top_k",
               "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp", "dola_layers")
# `cache_implementation` values that only choose how vanilla stores its cache; the output does not depend on them.
EQUIVALENT_CACHES = (None, "dynamic", "static")
# Fields that change how vanilla runs (memory, compilation) in ways hf_vegas does not reproduce, with what to do.
NOT_HONOURED = (
    ("cache_config", "hf_vegas builds its own static cache (no quantised or offloaded cache); remove it."),
    ("compile_config", "vanilla's automatic compilation is replaced by `vegas_compile=True`; remove it."),
    ("continuous_batching_config", "continuous batching is vanilla's own engine; remove it."),
)


def check_model(model) -> None:
    config = model.config
    if config.is_encoder_decoder:
        raise ValueError("hf_vegas supports decoder-only models; this model is an encoder-decoder.")
    if not compat.can_set_attn_implementation(model):
        raise ValueError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, so "
            "hf_vegas cannot switch it to sparse drafting (unsupported attention type)."
        )
    text_config = config.get_text_config(decoder=True)
    unsupported = set(layer_types(text_config)) - SUPPORTED_LAYER_TYPES
    if "chunked_attention" in unsupported:
        # Llama 4: a token sees only the keys of its own chunk of `attention_chunk_size` positions, a window that
        # restarts at every chunk boundary. The sparse drafts, the verification and the selection's candidates
        # would each need that boundary; until they have it, vanilla generate is the one that is right.
        raise ValueError(
            "Unsupported layer type 'chunked_attention' (Llama 4: a token sees only its chunk of "
            f"{getattr(text_config, 'attention_chunk_size', '?')} positions); hf_vegas supports "
            f"{sorted(SUPPORTED_LAYER_TYPES)}. Use vanilla generate."
        )
    if unsupported:
        raise ValueError(
            f"Unsupported attention layer type(s) {sorted(unsupported)}; hf_vegas supports "
            f"{sorted(SUPPORTED_LAYER_TYPES)}."
        )
    if getattr(text_config, "use_bidirectional_attention", False):
        raise ValueError("hf_vegas needs causal attention; this config sets use_bidirectional_attention=True.")
    if model.training:
        raise ValueError("hf_vegas runs inference only: call model.eval() before generate.")
    check_placement(model)


def _placement(where) -> str:
    """One name per device of a `device_map` value or a tensor's device (an int, or "cuda:1", is an accelerator)."""
    if isinstance(where, int):
        return f"accelerator {where}"
    if where == "disk":
        return "disk"
    device = torch.device(where)
    return device.type if device.type in ("cpu", "meta") else f"accelerator {device.index or 0}"


def check_placement(model) -> None:
    """Refuse a model offloaded to the CPU or disk (accelerate's `device_map` with offloading, or weights left on
    "meta"): every layer runs where its weights are, on accelerators of one kind. One device, or layers spread over
    several GPUs (`device_map="auto"`, `hf_vegas.placement`), pass; so does tensor parallelism (`tp_plan="auto"`),
    whose ranks each hold their shards on their own device."""
    placed = {_placement(where) for where in (getattr(model, "hf_device_map", None) or {}).values()}
    held = {_placement(t.device) for t in (*model.parameters(), *model.buffers())}
    for spread in (placed, held):
        kinds = {name.split()[0] for name in spread}
        if len(spread) > 1 and (kinds & {"cpu", "disk", "meta"} or len(kinds) > 1):
            raise ValueError(
                f"hf_vegas runs every layer where its weights are, but this model is spread over "
                f"{', '.join(sorted(spread))} (a `device_map` that offloads to the CPU or disk): it runs on one "
                "device, or with its layers on several GPUs (`device_map='auto'` with enough GPU memory for every "
                "layer), or split over GPUs with tensor parallelism: `from_pretrained(..., "
                "distributed_config=DistributedConfig(tp_plan='auto'))` under `torchrun` (README, 'Multi-GPU')."
            )


def check_synced_gpus(model, requested: bool | None) -> None:
    """Refuse `synced_gpus`: hf_vegas's rows take different numbers of forwards, which would leave processes that
    share sharded weights (DeepSpeed ZeRO-3, FSDP) waiting for each other. `requested` is the user's value (None:
    unset, which transformers turns on by itself under ZeRO-3 or FSDP with more than one process)."""
    if not compat.synced_gpus(model, requested):
        return
    why = "`synced_gpus=True`" if requested else (
        "`synced_gpus` (transformers turns it on by itself here, where DeepSpeed ZeRO-3 or FSDP shards the model "
        "over several processes)")
    raise ValueError(
        f"hf_vegas does not support {why}: generation synchronised across GPUs. Allowed: `synced_gpus=False`, or "
        "leaving it unset with a model that is not sharded over several processes."
    )


def check_layers(model, reach: int, config) -> None:
    """At least one layer must draft sparsely for a generation reaching `reach` positions under `config`, or drafts
    would be the model itself: a full-attention layer (a sliding window at least `reach` long is one), or a window
    long enough for the budget to pay (`VegasConfig.drafts_window_sparsely`). `gamma=0` drafts nothing."""
    text_config = model.config.get_text_config(decoder=True)
    if config.gamma == 0 or sparse_layers(text_config, config, reach):
        return
    window = getattr(text_config, "sliding_window", None)
    budget = config.budget(window) if isinstance(window, int) else "?"
    raise ValueError(
        f"Every layer of this model attends through a sliding window of {window} positions, shorter than this "
        f"generation's {reach} (longest prompt without padding + max_new_tokens + 2 * gamma + 1), and too short for "
        f"a sparse draft to pay: a draft reads a window sparsely only when it is longer than {SHORT_WINDOW} slots and "
        f"its budget (vegas_min_tokens={config.min_tokens}, vegas_sparsity={config.sparsity}: {budget} slots) is "
        "under a quarter of it, so drafts would be the model itself. Use vanilla generate (or a lower "
        "`vegas_min_tokens`, for a window longer than that)."
    )


def check_generation_config(generation_config, logits_processor=None) -> None:
    """Refuse every generation option hf_vegas would otherwise ignore or run differently from vanilla `generate`."""
    mode = generation_config.get_generation_mode()
    if mode not in DECODING_MODES:
        default = GenerationConfig()
        asked = [f for f in MODE_FIELDS if getattr(generation_config, f, None) != getattr(default, f, None)]
        raise ValueError(
            f"hf_vegas runs greedy decoding and sampling only; {', '.join(asked) or 'this config'} select(s) "
            f"{mode.value!r}. Remove them (hf_vegas drafts with the model itself: no beams, assistants, prompt lookup "
            "or DoLa)."
        )
    if generation_config.use_cache is False:
        raise ValueError("hf_vegas decodes from its own KV cache: `use_cache=False` is not supported.")
    if generation_config.cache_implementation not in EQUIVALENT_CACHES:
        raise ValueError(
            f"`cache_implementation={generation_config.cache_implementation!r}` is not supported: hf_vegas always "
            f"uses its own static VegasCache, which stands for {[c for c in EQUIVALENT_CACHES if c]} only."
        )
    for name, instead in NOT_HONOURED:
        if getattr(generation_config, name, None) is not None:
            raise ValueError(f"`{name}` is not supported by hf_vegas: {instead}")
    chunk = getattr(generation_config, "prefill_chunk_size", None)
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"`prefill_chunk_size` must be a positive integer (prompt positions per prefill forward) or "
                         f"None, got {chunk!r}.")
    guidance = generation_config.guidance_scale
    if (guidance is not None and guidance != 1) or any(
        isinstance(p, UnbatchedClassifierFreeGuidanceLogitsProcessor) for p in (logits_processor or [])
    ):
        raise ValueError(
            f"hf_vegas does not support classifier-free guidance (`guidance_scale={guidance}`): its processor runs "
            "the model one token at a time on its own cache, which speculative steps cannot feed. Remove it."
        )
    if generation_config.return_dict_in_generate:
        asked = [name for name in UNSUPPORTED_OUTPUTS if getattr(generation_config, name, False)]
        if asked:
            raise ValueError(
                f"hf_vegas does not return {asked} (its draft and verify forwards do not compute vanilla's per-step "
                "tensors); allowed extra outputs: `output_scores`, `output_logits`."
            )


def check_model_kwargs(model_kwargs: dict) -> None:
    # transformers adds an empty `mm_encoder_outputs` for every multimodal class (Gemma3ForConditionalGeneration):
    # a text prompt on such a model passes through its ordinary language-model layers.
    extra = sorted(k for k in set(model_kwargs) - PREPARED_MODEL_KWARGS if not (k in EMPTY_OK and not model_kwargs[k]))
    media = [k for k in extra if k in MEDIA_INPUTS]
    if media:
        raise ValueError(
            f"hf_vegas generates from text prompts; image, audio and video inputs ({media}, which transformers "
            "prepares from `pixel_values` and kin) are not supported yet. "
            "Pass `input_ids` (or `inputs_embeds`) without them."
        )
    if extra:
        raise ValueError(
            f"hf_vegas does not support the model input(s) {extra}; decoder-only text generation takes "
            f"`input_ids` or `inputs_embeds`, `attention_mask` and a prefilled `{compat.CACHE_KEYWORD}` "
            "(DynamicCache)."
        )


def check_position_ids(position_ids: torch.Tensor | None, left_pad: torch.Tensor, prompt_length: int) -> None:
    """hf_vegas numbers each row's real tokens from 0 after its left padding, as transformers' own `position_ids`
    do; other `position_ids` would be ignored, so they are refused."""
    if position_ids is None:
        return
    given = position_ids[..., :prompt_length].to(left_pad.device)
    if given.shape[-1] != prompt_length:
        raise ValueError(f"`position_ids` cover {given.shape[-1]} positions; the prompt has {prompt_length}.")
    columns = torch.arange(prompt_length, device=left_pad.device)[None, :]
    real = columns >= left_pad[:, None]
    expected = columns - left_pad[:, None]
    if not bool(((given == expected) | ~real).all()):
        raise ValueError(
            "Custom `position_ids` are not supported: hf_vegas numbers each row's tokens from 0 after its left "
            "padding (the `position_ids` transformers derives from `attention_mask`). Remove them."
        )


def left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Number of leading pad tokens per row; raises unless every row is `[0 ... 0, 1 ... 1]`."""
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"`input_ids` must be a non-empty (batch, length) tensor, got shape {tuple(input_ids.shape)}."
        )
    if attention_mask is None:
        return torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    mask = attention_mask.to(device=input_ids.device, dtype=torch.long)
    if mask.shape != input_ids.shape:
        raise ValueError(
            f"`attention_mask` shape {tuple(mask.shape)} does not match `input_ids` {tuple(input_ids.shape)}."
        )
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
