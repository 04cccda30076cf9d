"""The Hub folder the tests load with `custom_generate=<folder>`: what `python -m hf_vegas.hub export` writes, into a
temporary directory, once per test process (the repository keeps no copy of it)."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from hf_vegas.hub import export_hub_folder


@functools.cache
def hub_folder() -> str:
    root = Path(tempfile.mkdtemp(prefix="hf_vegas_hub_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return str(export_hub_folder(root / "vegas"))
