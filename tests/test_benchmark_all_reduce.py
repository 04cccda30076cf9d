"""`benchmarks/all_reduce.py` (NCCL against symmetric-memory all-reduces, two GPUs under torchrun) refuses what it
cannot run before any GPU work: a launch outside torchrun or on one GPU, sizes that are not positive, chains whose
values would overflow, and rows the one-shot kernel cannot move."""

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


@pytest.mark.parametrize("world_size", [None, "1"])
def test_outside_torchrun_or_on_one_gpu_it_says_how_to_launch(monkeypatch, world_size):
    if world_size is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", world_size)
    assert "torchrun --nproc_per_node 2" in _main(monkeypatch)


@pytest.mark.parametrize("argv,message", [
    (["--rows", "16", "0"], "must be positive integers"), (["--count", "0"], "must be positive integers"),
    (["--hidden", "-1"], "must be positive integers"), (["--replays", "0"], "must be positive integers"),
    (["--count", "101"], "--count must be at most 100"), (["--rows", "16", "3", "--hidden", "7"], "must be even"),
    (["--compile", "--rows", *"1 2 3 4 5 6 7 8 9".split()], "at most 8 row counts"),
    (["--compile", "--norm"], "pick one"),
])
def test_what_it_cannot_run_is_refused(monkeypatch, argv, message):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert message in _main(monkeypatch, *argv)
