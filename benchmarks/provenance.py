"""Where a benchmark record comes from: the commit it measured (shared by the benchmark scripts).

A record names HEAD's commit, whether tracked files differ from it (`dirty`), and the hash of the working tree as
git would commit it (`tree`: tracked and untracked files, ignored ones left out). The tree identifies what ran also
where the checkout's git metadata is older than its files (a copy of a working tree sent to another machine): the
commit that holds that tree is

    python benchmarks/provenance.py TREE...        # prints "TREE COMMIT" for each commit whose tree it is
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile


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


def tree() -> str | None:
    """The working tree's git tree hash (None outside a git checkout). Built in a throwaway copy of the checkout's
    index (tracked files stay in even where an ignore rule matches them; the own index is untouched), updated with
    every change and untracked file as `git add -A` would; the files' blobs are written to the object store. (A copy
    that changed a file's mode, as the executable bit of `.ci/run`, hashes differently.)"""
    try:
        root = subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
        index = subprocess.check_output(["git", "rev-parse", "--path-format=absolute", "--git-path", "index"],
                                        cwd=root, text=True, stderr=subprocess.DEVNULL).strip()
        with tempfile.TemporaryDirectory() as scratch:
            env = {**os.environ, "GIT_INDEX_FILE": os.path.join(scratch, "index")}
            if os.path.exists(index):
                # With the index's own mtime: git re-reads a file whose mtime is not older than the index's ("racily
                # clean"); a copy stamped now would let an edit of the same size within the file system's timestamp
                # granularity of the file's indexed write pass as unchanged.
                shutil.copy2(index, env["GIT_INDEX_FILE"])
            subprocess.check_call(["git", "add", "-A", "."], cwd=root, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
            return subprocess.check_output(["git", "write-tree"], cwd=root, env=env, text=True,
                                           stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def commits_of(trees: list[str]) -> list[tuple[str, str]]:
    """(tree, commit hash) for every commit of this repository's history whose tree is one of `trees`."""
    log = subprocess.check_output(["git", "log", "--all", "--format=%T %H"], text=True)
    wanted = set(trees)
    return [tuple(line.split()) for line in log.splitlines() if line.split()[0] in wanted]


def gpu_run(commit_arg: str | None = None, **extra) -> dict:
    """What every GPU benchmark record starts with: the GPU, the torch and Triton versions and the commit."""
    import torch
    import triton

    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=commit_arg or commit(), dirty=dirty(), tree=tree(), **extra)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    for found_tree, found_commit in commits_of(sys.argv[1:]):
        print(found_tree, found_commit)
