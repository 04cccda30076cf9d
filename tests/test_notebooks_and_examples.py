"""The notebooks and the README's main example run (smoke-sized) and keep their promises.

Each notebook runs in a real Jupyter kernel (nbclient, which the `test` extra installs through nbmake), as a person
would run it: any cell that raises fails the test, and each cell has `CELL_TIMEOUT` seconds. `pytest --nbmake
notebooks/` runs the same notebooks through nbmake's own plugin.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT = 600  # seconds; a smoke-mode notebook takes 1-2 minutes on 2 CPU cores, model load included
# Pictures (matplotlib figures shown inline) each notebook must draw; a notebook not listed must draw at least one.
# Every notebook reads HF_VEGAS_SMOKE and prints `smoke=True` or `smoke=False` from its first code cell.
PICTURES = {"quickstart.ipynb": 1, "what_vegas_selects.ipynb": 4, "tuning.ipynb": 1}
pytestmark = pytest.mark.slow


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= set(PICTURES)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_in_smoke_mode(notebook, monkeypatch):
    nbclient = pytest.importorskip("nbclient", reason="the notebooks run under nbclient: pip install -e '.[test]'")
    nbformat = pytest.importorskip("nbformat")
    monkeypatch.setenv("HF_VEGAS_SMOKE", "1")
    # The kernel is a process of its own: give it this worker's share of the cores (see conftest.py) and the inline
    # backend, whose figures land in the cell outputs.
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(notebook, as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), (
        f"{notebook.name} is committed with outputs; clear them (Jupyter: Edit > Clear Outputs of All Cells)"
    )
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT, kernel_name="python3", resources={"metadata": {"path": str(notebook.parent)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    pictures = sum("image/png" in out.get("data", {}) for out in outputs)
    assert pictures >= PICTURES.get(notebook.name, 1), f"{notebook.name} drew {pictures} pictures"
    text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    assert "smoke=True" in text, "the notebook did not run in smoke mode"


def test_main_example_matches_vanilla():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "generate_smollm2.py"), "--prompt-tokens", "512",
         "--max-new-tokens", "24"],
        capture_output=True, text=True, env=env, timeout=900, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "identical to vanilla greedy generate: True" in result.stdout


@pytest.mark.parametrize("how", ["--device-map", "--tensor-parallel"])
def test_multi_gpu_example_runs_both_placements_on_the_cpu(how, tmp_path):
    """`examples/multi_gpu.py`, the README's two multi-GPU launch commands, on a tiny model: on the CPU the
    device_map run holds the whole model and the tensor-parallel one runs two gloo ranks; both check Vegas greedy
    against vanilla greedy and exit 1 otherwise."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import tiny_model

    tiny_model("llama").save_pretrained(tmp_path / "model")
    example = [str(ROOT / "examples" / "multi_gpu.py"), how, str(tmp_path / "model"), "--batch", "2",
               "--prompt-tokens", "96", "--max-new-tokens", "12", "--gamma", "3"]
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
              if how == "--tensor-parallel" else [sys.executable])
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    result = subprocess.run(launch + example, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Vegas greedy identical to vanilla greedy: True" in result.stdout
    assert ("rank 0 of 2" in result.stdout) == (how == "--tensor-parallel")
