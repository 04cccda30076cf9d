"""The README of the Hub folder that `python -m hf_vegas.hub export` writes (`hub.export_hub_folder`): the sections
a `custom_generate` repository's card has, with the `vegas_*` arguments read from `VegasConfig` (name, type and
default from its fields, meaning from its docstring), so the card cannot drift from the code."""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap

from .config import VegasConfig


class ExportError(RuntimeError):
    """The Hub folder cannot be written as it should: hf_vegas's code has an import the flat export cannot rewrite
    mechanically, or `VegasConfig` has a field its docstring does not describe."""


def _default(value) -> str:
    return f'`"{value}"`' if isinstance(value, str) else f"`{value}`" if isinstance(value, bool) else str(value)


def arguments() -> str:
    """The `vegas_*` arguments: name, type and default from `VegasConfig`'s fields, meaning from its docstring."""
    doc = inspect.cleandoc(VegasConfig.__doc__)
    entries = dict(re.findall(r"^    (\w+) \(.*\):\n((?:        .*\n?)+)", doc, re.MULTILINE))
    items = []
    for field in dataclasses.fields(VegasConfig):
        if field.name not in entries:
            raise ExportError(f"VegasConfig's docstring does not describe `{field.name}`.")
        meaning = " ".join(entries[field.name].split())
        default = _default(field.default)
        items.append(f"`vegas_{field.name}` (`{field.type}`, *optional*, defaults to {default}): {meaning}")
    items.append(
        '`vegas_config` (`dict`, *optional*): the fields above at once, by name without `vegas_` (`{"gamma": 4}`); '
        "flat keys win. An unknown `vegas_*` key is an error naming the allowed ones. References to "
        "`hf_vegas.<module>` above name the module of that name in `custom_generate/`."
    )
    return "\n".join(_wrapped(f"- {item}", indent="  ") for item in items)


def _wrapped(text: str, indent: str = "") -> str:
    """`text` wrapped at 119 columns, never inside a `code span` (markdown would read the break as a space there)."""
    glued = re.sub(r"`[^`]*`", lambda span: span.group().replace(" ", "\0"), text)
    return textwrap.fill(glued, width=119, subsequent_indent=indent, break_on_hyphens=False).replace("\0", " ")


def folder_readme(command: str, requirements: tuple[str, ...]) -> str:
    """The folder's README.md: what `custom_generate` model cards describe, the `vegas_*` arguments from
    `VegasConfig`. `command` is what wrote the folder; `requirements` what its code imports."""
    return f"""---
library_name: transformers
tags:
  - custom_generate
---

<!-- Written by `{command}`; edit hf_vegas/hub_readme.py, not this file. -->

## Description
Vegas self-speculative decoding (Yue, Xue, Huang, *Vegas: Self-Speculative Decoding with Verification-Guided Sparse
Attention*, ICML 2026, arXiv 2602.07223). Each iteration the model drafts `gamma` tokens with itself, its
full-attention layers reading only the KV entries the previous verification found critical, then verifies the drafts
with full attention in one forward. No draft model, no training: greedy output is token-identical to vanilla greedy
`generate` in fp32 (in bf16 on a GPU the attention kernels round differently from SDPA, so rows may drift after a
near tie), and sampling keeps vanilla's distribution (speculative sampling with the real draft probabilities).

{_wrapped(
    "This folder is self-contained: `custom_generate/` holds a copy of the decoding code of the `hf_vegas` package "
    f"(exported by `{command}`), so it needs only `{'` and `'.join(requirements)}`; `hf_vegas` need not be installed."
)}

## Base model
Any decoder-only model whose attention goes through transformers' `AttentionInterface` (Llama, SmolLM2, Mistral,
Qwen3, Gemma-3, Phi-3, DeepSeek-V2/V3 and others).

## Model compatibility
- Decoder-only models; batches of any size, left-padded (`tokenizer(..., padding_side="left")`).
- Greedy decoding and sampling with every standard logits processor, stopping criteria and stop strings, streamers
  (batch 1), `output_scores` / `output_logits`, `inputs_embeds`, and a prefilled `DynamicCache` prompt cache.
- Sliding-window layers draft sparsely inside their window when it is long enough to pay (a draft reading under a
  quarter of it), else with their whole window; learned attention sinks (gpt-oss) are supported. Layers with recurrent
  or linear attention, image inputs, beam search and the other decoding modes are refused before any forward pass,
  with the argument named.

## Additional Arguments
{arguments()}

## Output Type changes
With `return_dict_in_generate=True` the output is a `VegasGenerateOutput`: the usual fields (`sequences`, and
`scores` / `logits` with `output_scores` / `output_logits`), plus `accepted` (draft tokens accepted per row and
iteration, `-1` once a row has finished) and `tokens_per_iteration`. `cache` (`past_key_values` before transformers
5.24) is the generation's own cache, or None when it was kept for the next call (CUDA graphs).

## Example usage
```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
tokenizer = AutoTokenizer.from_pretrained(model_id)
model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.bfloat16).to("cuda").eval()

prompts = ["A long document ... Summarize it.", "Another long document ... What is its main point?"]
inputs = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to(model.device)
out = model.generate(
    **inputs,
    custom_generate="<org>/vegas",  # this repository, or the path of this folder
    trust_remote_code=True,
    max_new_tokens=256,
    do_sample=False,
    vegas_gamma=6,
)
print(tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
```

Speculation pays where the KV cache dominates a decoding step: long prompts and large batches. At short prompts or
batch 1, `vegas_gamma=0` (plain decoding over the same static cache and CUDA graphs) is the faster choice.

## Kernels
On CUDA, `vegas_backend="auto"` runs the Triton kernels of `hf_vegas_kernels` when that package is importable
(it comes with the `hf_vegas` package, in its `kernels/` folder). Only their plain-PyTorch counterparts
(`hf_vegas_kernels_naive.py`) are part of this folder, whose loading would otherwise require `triton` everywhere;
without the kernels those run: the same tokens, slower.
"""
