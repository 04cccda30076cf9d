"""Real-text benchmark prompts, read through `datasets` from local files (no Hub).

Any file `datasets` reads locally works (`--data-files docs.jsonl --text-column text`, also csv, parquet, txt). The
default corpus is Python's own reference documentation (`pydoc_data`, shipped with every Python), written once to
a JSONL file so that it goes through the same `datasets` path as a user's file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

DEFAULT_CORPUS = Path(__file__).parent / "data" / "python_docs.jsonl"
QUESTION = "Summarize the documentation above in a few sentences."


def write_default_corpus(path: Path = DEFAULT_CORPUS) -> Path:
    """One JSON record per documentation topic: `{"title": ..., "text": ...}` (about 0.9 MB)."""
    from pydoc_data.topics import topics

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for title in sorted(topics):
                f.write(json.dumps({"title": title, "text": topics[title]}) + "\n")
    return path


def load_texts(data_files: str | None = None, text_column: str = "text") -> list[str]:
    """Every record's text, in file order."""
    import datasets

    path = data_files or str(write_default_corpus())
    suffix = Path(path).suffix.lstrip(".")
    builder = {"jsonl": "json", "txt": "text"}.get(suffix, suffix)
    dataset = datasets.load_dataset(builder, data_files=path, split="train")
    if text_column not in dataset.column_names:
        raise ValueError(f"--text-column {text_column!r} is not a column of {path}: {dataset.column_names}")
    return [t for t in dataset[text_column] if t and t.strip()]


def chat_prompts(tokenizer, texts: list[str], batch: int, num_tokens: int) -> list[torch.Tensor]:
    """`batch` chat prompts of `num_tokens` tokens, each a different stretch of the corpus + a question.

    Row `b` starts at record `b * len(texts) // batch` and takes the following records until the document is long
    enough (wrapping around), so rows read different text.
    """
    overhead = len(_wrap(tokenizer, ""))
    if num_tokens <= overhead + 16:
        raise ValueError(f"--prompt-tokens must exceed the chat template's {overhead + 16} tokens, got {num_tokens}.")
    records = tokenizer([t + "\n\n" for t in texts], add_special_tokens=False).input_ids
    prompts = []
    for b in range(batch):
        start = b * len(records) // batch
        document: list[int] = []
        for i in range(len(records)):
            document += records[(start + i) % len(records)]
            if len(document) >= num_tokens:
                break
        if len(document) < num_tokens:
            raise ValueError(f"The corpus has {len(document)} tokens, fewer than --prompt-tokens {num_tokens}.")
        ids = _fit(tokenizer, document, num_tokens, overhead)
        prompts.append(torch.tensor(ids))
    return prompts


def _wrap(tokenizer, document: str) -> list[int]:
    messages = [{"role": "user", "content": f"{document}\n\n{QUESTION}"}]
    return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)


def _fit(tokenizer, document: list[int], num_tokens: int, overhead: int) -> list[int]:
    """Trim the document until the wrapped prompt has `num_tokens` tokens (re-tokenising the decoded text can merge
    or split a few tokens, so this converges in a step or two; rows that end a token off are left-padded)."""
    take = num_tokens - overhead
    for _ in range(4):
        ids = _wrap(tokenizer, tokenizer.decode(document[:take]))
        if len(ids) == num_tokens:
            break
        take += num_tokens - len(ids)
    return ids
