"""The benchmarks' launch-setting overrides (`benchmarks/launch_tuning.py`): `--tuning` and the A/B sets of
`--tuning-sets`, which must leave the defaults exactly as they were between sets."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import launch_tuning  # noqa: E402

_launch = pytest.importorskip("hf_vegas_kernels._launch")


def test_a_set_applies_over_the_defaults_and_restore_puts_them_back():
    saved = launch_tuning.snapshot()
    try:
        applied = launch_tuning.apply_tuning(["pdl:prefetch_weights=0", "sparse:waves=1.5", "gated:block_n=32",
                                              "dense:fused_combine_max_splits=3"])  # (a key dense's default lacks)
        assert applied == {"pdl:prefetch_weights": 0, "sparse:waves": 1.5, "gated:block_n": 32,
                           "dense:fused_combine_max_splits": 3}
        assert _launch.LINEAR_TUNING["gated"]["block_n"] == 32
        assert _launch.PDL["prefetch_weights"] == 0 and _launch.TUNING["sparse"]["waves"] == 1.5
    finally:
        launch_tuning.restore(saved)
    assert launch_tuning.snapshot() == saved and _launch.PDL["prefetch_weights"] == saved["pdl"]["prefetch_weights"]


def test_sets_are_checked_before_any_run_and_change_nothing():
    saved = launch_tuning.snapshot()
    assert launch_tuning.parse_sets(["pdl:early_trigger=0 pdl:prefetch_weights=0", ""]) == [
        "pdl:early_trigger=0 pdl:prefetch_weights=0", ""]
    assert launch_tuning.snapshot() == saved
    for bad, says in (("pdl:early=0", "pdl takes KEY one of"), ("nothing:x=1", "KIND one of"),
                      ("pdl:enabled=yes", "must be a number"), ("gated:blockn=32", "gated takes KEY one of"),
                      ("qkv_rope:block_n=32", "qkv_rope takes KEY one of"), ("verify:wave=2", "verify takes KEY"),
                      ("verify_wide_head:nearest=1", "by `fill` .* or to the nearest, not both")):
        with pytest.raises(SystemExit, match=says):
            launch_tuning.parse_sets([f"pdl:enabled=0 sparse:waves=3 {bad}"])  # (applied before the bad one)
        assert launch_tuning.snapshot() == saved, bad


def test_speedups_compare_each_run_with_dense_of_its_own_set_and_pass():
    """`--tuning-sets` with `--repeats`: a Vegas record's `x_dense` is over the dense record of the same launch
    settings in the same pass (not the last dense record of any)."""
    import throughput_records

    workload = dict(model="smollm2", batch=64, prompt_tokens=7502, decoding="greedy", bound_tokens_per_s=1.0)
    records = []
    for repeat in (0, 1):
        for method, tuning_set, tokens_per_s in (("dense", {"pdl:enabled": 0}, 10.0 + repeat), ("dense", {}, 12.0),
                                                 ("vegas", {}, 30.0), ("vegas", {"pdl:enabled": 0}, 20.0)):
            record = dict(workload, method=method, tuning_set=tuning_set, repeat=repeat, tokens_per_s=tokens_per_s)
            throughput_records.add_ratios(record, records)
            records.append(record)
    assert [r.get("x_dense") for r in records] == [None, None, 2.5, 2.0, None, None, 2.5, 20.0 / 11.0]
