"""Reading benchmark records and writing their figures, shared by the plot scripts and the throughput benchmark."""

from __future__ import annotations

import json
from pathlib import Path


def read_records(path: Path) -> list[dict]:
    """Every JSON record of a JSONL file (blank lines skipped); an empty file is an error."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not records:
        raise SystemExit(f"{path} holds no records")
    return records


def save_figure(fig, path: Path, title: str, fontsize: int, what: str) -> None:
    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path} from {what}")


def append_records(path: Path, records: list[dict]) -> None:
    """Append JSON records to a JSONL file (made with its folder if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
