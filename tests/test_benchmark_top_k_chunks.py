"""`benchmarks/top_k_chunks.py` refuses bad shapes and settings by name before any GPU work."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import top_k_chunks  # noqa: E402


def test_shapes_parse_and_bad_ones_are_refused_by_name():
    assert top_k_chunks.parse_shape("36x16x33024") == (36, 16, 33024)
    assert top_k_chunks.parse_shape("1X1X301") == (1, 1, 301)
    for bad in ("36x16", "36x0x33024", "36x16x300", "ax16x33024", "36x16x33024x2"):
        with pytest.raises(SystemExit, match="--shapes"):
            top_k_chunks.parse_shape(bad)


@pytest.mark.parametrize("chunks, bits, warps, named", [
    ([1000], [8], [4], "--chunks"), ([8], [8], [4], "--chunks"), ([32768], [8], [4], "--chunks"),
    ([2048], [5], [4], "--bits"), ([2048], [8], [3], "--warps"),
])
def test_settings_the_passes_cannot_run_are_refused_by_name(chunks, bits, warps, named):
    with pytest.raises(SystemExit, match=named):
        top_k_chunks.check_settings(chunks, bits, warps)
    top_k_chunks.check_settings([16, 2048, 16384], [4, 8], [1, 4, 32])  # the bounds themselves pass


def test_main_refuses_before_any_gpu_work(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["top_k_chunks.py", "--bits", "6"])
    with pytest.raises(SystemExit, match="--bits 6"):
        top_k_chunks.main()
