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


def dirty() -> bool | None:
    """Whether the checkout has uncommitted changes to tracked files (None outside a git checkout)."""
    try:
        out = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], text=True,
                                      stderr=subprocess.DEVNULL)
    except (OSError, subprocess.CalledProcessError):
        return None
    return bool(out.strip())


def gpu_run(commit_arg: str | None = None, **extra) -> dict:
    """What every GPU benchmark record starts with: the GPU, the torch and Triton versions and the commit."""
    import torch
    import triton

    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=commit_arg or commit(), dirty=dirty(), **extra)
