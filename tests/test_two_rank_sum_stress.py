"""The fused two-rank sum (`hf_vegas_kernels.exchange_sum_norm`) under stress on two GPUs: skewed ranks, sums back
to back, up to the exchange's largest row count (`two_rank_sum_stress_worker.py` says what it runs). On the CPU the
same kernel runs looped back to itself under the interpreter (`kernels/tests/test_kernels_two_rank_sum.py`,
`tests/test_fused_tp_sums.py`); a hang or a lost signal needs two real GPUs to show."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("two_rank_sum_stress_worker.py")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs of one host (symmetric memory, "
                    "NVLink); the CPU counterparts loop the kernel back to itself (test_kernels_two_rank_sum.py)")
def test_skewed_ranks_sum_bit_for_bit_and_leave_no_flag_raised(tmp_path):
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    paths = [str(root), str(root / "kernels" / "torch-ext"), os.environ.get("PYTHONPATH", "")]
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
         str(tmp_path), "40"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["sums"] == 40 * 16 and report["capacity"] >= 1024, report
        assert report["mismatch_count"] == 0, report["mismatches"]
        assert report["flags_left"] == 0, "every sum leaves its rank's flags cleared"
