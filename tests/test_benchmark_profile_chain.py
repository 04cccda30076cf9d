"""`benchmarks/profile_forward.py`'s chain view: under programmatic dependent launch kernels overlap, so each one's
share of a step is its end past the latest end before it, and the shares add up to the step's span."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import profile_forward  # noqa: E402


def test_increments_count_overlapped_time_once_and_add_up_to_the_span():
    # a: 0-5; b starts while a runs and ends at 12; c lies inside b; d starts at b's end; e after a gap
    spans = [(0.0, 5.0), (2.0, 10.0), (3.0, 4.0), (12.0, 3.0), (20.0, 1.0)]
    adds = profile_forward.chain_increments(spans)
    assert adds == pytest.approx([5.0, 7.0, 0.0, 3.0, 1.0])
    # with the idle gap between d and e, the increments sum to the busy time, not the wall span
    assert sum(adds) == pytest.approx(16.0)


def test_back_to_back_kernels_add_their_durations():
    assert profile_forward.chain_increments([(0.0, 2.0), (2.0, 3.5), (5.5, 1.0)]) == pytest.approx([2.0, 3.5, 1.0])
