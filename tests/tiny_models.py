"""Tiny random-weight decoder models built from configs: the unit-test workhorses (no download)."""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

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
}


def tiny_model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    return BUILDERS[arch]().eval()


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

    return out.past_key_values if out.past_key_values is not None else graphs.pooled_cache(model)
