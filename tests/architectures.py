"""The coverage matrix: every causal-LM architecture of the installed transformers, as a tiny random model, through
hf_vegas against vanilla greedy `generate`.

The list comes from transformers itself (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), so a new architecture shows up here by
itself. Each config is shrunk by overriding the usual size fields; a config that stays large (a field this file does
not know) is reported as not built rather than allocated. `python tests/architectures.py` prints the matrix as a
markdown table; `--update-readme` writes it into README's "Supported models" section.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_vegas  # noqa: F401  (the "vegas" name)
from hf_vegas._compat.internals import CACHE_KEYWORD

# Size fields under their various names, and the tiny value each gets where a config has it.
TINY = {
    "vocab_size": 128, "hidden_size": 64, "n_embd": 64, "d_model": 64, "intermediate_size": 128, "n_inner": 128,
    "ffn_dim": 128, "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "num_attention_heads": 4, "n_head": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "n_positions": 512,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "kv_lora_rank": 32, "q_lora_rank": 32,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "rotary_dim": 16,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
# Hybrid models (`layer_types` given) keep a short window so that a 24-token prompt still crosses it; models that
# window every layer keep their own (Mistral v0.1's 4096 is longer than any generation here: full attention).
HYBRID_WINDOW = 16
MAX_PARAMETERS = 4_000_000
VERDICTS = ("identical", "refused", "different", "crashed", "not built")


class NotBuilt(Exception):
    """No tiny model could be made from this architecture's config."""


def causal_lm_architectures() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrink(config) -> None:
    text = config.get_text_config(decoder=True)
    for part in {id(config): config, id(text): text}.values():
        for name, value in TINY.items():
            if getattr(part, name, None) is not None:
                try:
                    setattr(part, name, value)
                except AttributeError:  # a derived field (a property without a setter)
                    pass
        if getattr(part, "qk_rope_head_dim", None) is not None and getattr(part, "head_dim", None) is not None:
            part.head_dim = part.qk_rope_head_dim  # latent attention's rotary part (DeepSeek, MiniCPM3, GLM)
        # Keep one layer of each attention type, in the config's order (Gemma-3: a sliding layer, then a full one).
        types = getattr(part, "layer_types", None)
        if types:
            kept = [types[i] for i in sorted({types.index(t) for t in types})]
            try:
                part.layer_types, part.num_hidden_layers = kept, len(kept)
            except AttributeError:
                pass
            if getattr(part, "sliding_window", None) is not None:
                part.sliding_window = HYBRID_WINDOW


def tiny_model(model_type: str):
    """A tiny random model of `model_type` in eval mode, or `NotBuilt`."""
    try:
        config = AutoConfig.for_model(model_type)
        _shrink(config)
        model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
        with torch.device("meta"):  # count before allocating: a field this file does not shrink could be huge
            parameters = sum(p.numel() for p in model_class(config).parameters())
        if parameters > MAX_PARAMETERS:
            raise NotBuilt(f"still {parameters / 1e6:.0f}M parameters after shrinking the usual size fields")
        torch.manual_seed(0)
        return model_class(config).eval()
    except NotBuilt:
        raise
    except Exception as error:  # noqa: BLE001  (any config this generic shrinking cannot satisfy)
        raise NotBuilt(f"{type(error).__name__}: {str(error).splitlines()[0][:160]}") from error


def check(model_type: str) -> tuple[str, str]:
    """`(verdict, detail)`: vanilla greedy against `custom_generate="vegas"` on a ragged batch of two rows."""
    try:
        model = tiny_model(model_type)
    except NotBuilt as error:
        return "not built", str(error)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(3, vocab, (2, 24), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    common = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            expected = model.generate(ids, **common)
        except Exception as error:  # noqa: BLE001
            return "not built", f"vanilla generate fails: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
        forwards = []
        handle = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
        try:
            out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=3, vegas_sparsity=0.2,
                                 vegas_min_tokens=4, return_dict_in_generate=True)
        except Exception as error:  # noqa: BLE001
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            if forwards:
                return "crashed", f"{type(error).__name__} after {len(forwards)} forward(s): {first_line[:160]}"
            return "refused", first_line[:200]
        finally:
            handle.remove()
    if not torch.equal(out.sequences, expected):
        return "different", "greedy tokens differ from vanilla"
    cache = getattr(out, CACHE_KEYWORD)
    sparse = f"{len(cache.selection.sparse_layers)} of {len(cache.layers)} layers drafted sparsely"
    return "identical", sparse


def markdown(results: dict[str, tuple[str, str]]) -> str:
    lines = ["| architecture | result | detail |", "|---|---|---|"]
    lines += [f"| `{name}` | {verdict} | {detail.replace('|', '/')} |" for name, (verdict, detail) in results.items()]
    counts = {v: sum(1 for verdict, _ in results.values() if verdict == v) for v in VERDICTS}
    summary = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    return f"transformers {transformers.__version__}: {summary}.\n\n" + "\n".join(lines)


BEGIN, END = "<!-- architectures: begin -->", "<!-- architectures: end -->"


def update_readme(path: Path, table: str) -> None:
    """Replace the block between README's architecture markers with `table`."""
    text = path.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    path.write_text(text[:start] + "\n" + table + "\n" + text[stop:])


if __name__ == "__main__":
    update = "--update-readme" in sys.argv
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or causal_lm_architectures()
    table = markdown({name: check(name) for name in names})
    if update:
        update_readme(Path(__file__).resolve().parents[1] / "README.md", table)
    print(table)
