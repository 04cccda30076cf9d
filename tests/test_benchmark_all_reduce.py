"""`benchmarks/all_reduce.py` (NCCL against symmetric-memory all-reduces, two GPUs under torchrun) refuses what it
cannot run before any GPU work: a launch outside torchrun, and sizes that are not positive."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import all_reduce  # noqa: E402


def _main(monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", ["all_reduce.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        all_reduce.main()
    return str(exit_info.value)


def test_outside_torchrun_it_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert "torchrun --nproc_per_node 2" in _main(monkeypatch)


@pytest.mark.parametrize("argv", [["--rows", "16", "0"], ["--count", "0"], ["--hidden", "-1"], ["--replays", "0"]])
def test_sizes_must_be_positive(monkeypatch, argv):
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert "must be positive integers" in _main(monkeypatch, *argv)
