"""The notebook and the README's main example run (smoke-sized) and keep their promises."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("notebook", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_runs_in_smoke_mode(notebook, monkeypatch):
    """Executes the code cells in order in one namespace (what a kernel does), without a Jupyter dependency."""
    monkeypatch.setenv("HF_VEGAS_SMOKE", "1")
    cells = json.loads(notebook.read_text())["cells"]
    namespace = {"__name__": "__main__"}
    for cell in cells:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{notebook.name}", "exec"), namespace)  # noqa: S102


def test_main_example_matches_vanilla():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "generate_smollm2.py"), "--prompt-tokens", "512",
         "--max-new-tokens", "24"],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "identical to vanilla greedy generate: True" in result.stdout
