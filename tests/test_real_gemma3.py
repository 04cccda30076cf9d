"""The second real model: Gemma-3-270M (GGUF from PyPI), a hybrid of 512-token sliding-window layers and full ones,
CPU, fp32. Prompts longer than the window, so the sliding layers really slide while the full layers draft sparsely."""

import pytest
import torch

from hf_vegas._compat.internals import CACHE_KEYWORD
from hf_vegas.real_models import long_prompt

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("policy", ["vegas", "oracle"])
def test_code_continuation_greedy_identical_to_vanilla(gemma3, policy):
    model, tokenizer = gemma3
    ids = long_prompt(tokenizer, 1200, task="code")
    expected = model.generate(ids, max_new_tokens=24, do_sample=False)
    out = model.generate(ids, max_new_tokens=24, do_sample=False, custom_generate="vegas", vegas_policy=policy,
                         vegas_min_tokens=64, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    sel = getattr(out, CACHE_KEYWORD).selection
    full = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
    assert sel.sparse_layers == full and len(full) < model.config.num_hidden_layers, "sliding layers keep their window"
    assert bool((sel.sel_count < sel.sel_end).all()), "the full layers' drafts are sparse"
    assert out.tokens_per_iteration > 2.0


def test_ragged_batch_of_summary_and_code_greedy_identical_to_vanilla(gemma3):
    model, tokenizer = gemma3
    rows = [long_prompt(tokenizer, 900, task="summary")[0],
            long_prompt(tokenizer, 700, task="code", topic_offset=3)[0]]
    width = max(r.numel() for r in rows)
    ids = torch.full((2, width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - row.numel():], mask[b, width - row.numel():] = row, 1
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, custom_generate="vegas",
                         vegas_min_tokens=64)
    assert torch.equal(out, expected)
