"""Tiny random-weight decoder models built from configs: the unit-test workhorses (no download)."""

from __future__ import annotations

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DiffLlamaConfig,
    DiffLlamaForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MiniCPM3Config,
    MiniCPM3ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3ForCausalLM,
    SiglipVisionConfig,
    Starcoder2Config,
    Starcoder2ForCausalLM,
)
from hf_vegas._compat.internals import CACHE_KEYWORD

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, max_position_embeddings=1024)

BUILDERS = {
    # GQA group 2.
    "llama": lambda: LlamaForCausalLM(
        LlamaConfig(**COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    ),
    # GQA group 3, no sliding window (all layers full attention).
    "mistral": lambda: MistralForCausalLM(
        MistralConfig(**COMMON, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                      sliding_window=None)
    ),
    # q/k norms, GQA group 4.
    "qwen3": lambda: Qwen3ForCausalLM(
        Qwen3Config(**COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=16)
    ),
    # Hybrid: 5 sliding-window layers (window 16) then 1 full layer, like Gemma-3's 5:1 pattern.
    "gemma3": lambda: Gemma3ForCausalLM(
        Gemma3TextConfig(**COMMON, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         sliding_window=16)
    ),
    # Mistral-v0.1 style: every layer windowed (no `layer_types`), the window longer than any test's generation, so
    # every layer is full attention and drafted sparsely.
    "mistral_window": lambda: MistralForCausalLM(
        MistralConfig(**COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=4096)
    ),
    # Phi-3-128k style: partial rotary, a fused qkv projection, and a window (262144) longer than any context.
    "phi3": lambda: Phi3ForCausalLM(
        Phi3Config(**COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=262144,
                   partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ),
    # Splits the value heads between the cache's `update` and attention (needs transformers' cache layout).
    "diffllama": lambda: DiffLlamaForCausalLM(
        DiffLlamaConfig(**COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    ),
    # Multi-head latent attention: key head dim 24 (16 + 8 rotary), value head dim 16; MoE after the first layer.
    "deepseek_v3": lambda: DeepseekV3ForCausalLM(
        DeepseekV3Config(**COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                         kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                         num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                         moe_intermediate_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ),
    # The multimodal class Gemma-3 4B-27B load as, given text prompts: its language model is the hybrid above.
    "gemma3_multimodal": lambda: Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config=Gemma3TextConfig(**COMMON, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, sliding_window=16),
            vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14),
            mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
        )
    ),
}


# Checked in one greedy test each (tests/test_greedy_equivalence.py), not in every parametrized suite: the same code
# paths as the builders above (latent attention: deepseek_v3; windows: mistral_window).
MORE_BUILDERS = {
    "deepseek_v2": lambda: DeepseekV2ForCausalLM(
        DeepseekV2Config(**COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                         kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                         num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=32)
    ),
    "minicpm3": lambda: MiniCPM3ForCausalLM(
        MiniCPM3Config(**COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                       kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    ),
    "starcoder2": lambda: Starcoder2ForCausalLM(
        Starcoder2Config(**COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         sliding_window=4096)
    ),
}


# Mistral v0.1 past its window: every layer windowed (40 positions), shorter than the test prompts. Such a short window
# drafts sparsely only where a test lowers `hf_vegas.config.SHORT_WINDOW` (the `short_windows_draft` fixture);
# tests/test_sliding_windows.py also runs a window above the real threshold.
WINDOWED_BUILDERS = {
    "mistral_short_window": lambda: MistralForCausalLM(
        MistralConfig(**COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=40)
    ),
}


def tiny_model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    return {**BUILDERS, **MORE_BUILDERS, **WINDOWED_BUILDERS}[arch]().eval()


def ragged_batch(lengths: list[int], seed: int = 0, pad_id: int = 0):
    """Left-padded `(input_ids, attention_mask)` with the given real lengths."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    return ids.masked_fill(mask == 0, pad_id), mask


def generation_cache(model, out):
    """The `VegasCache` a generation used: its own (returned in the output) or, with CUDA graphs, the pooled one."""
    from hf_vegas import graphs

    own = getattr(out, CACHE_KEYWORD)
    return own if own is not None else graphs.pooled_cache(model)
