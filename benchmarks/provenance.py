"""Where a benchmark record comes from: the commit it measured (shared by the benchmark scripts)."""

from __future__ import annotations

import subprocess


def commit() -> str:
    """Short hash of HEAD, or "unknown" outside a git checkout (pass `--commit` there)."""
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], text=True, stderr=subprocess.DEVNULL
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
