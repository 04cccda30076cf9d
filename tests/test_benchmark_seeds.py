"""`benchmarks/throughput.py --seeds`: sampled calls under several torch seeds, each its own record, each compared
with the other methods' call of the same seed, and summarised over the seeds."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import throughput  # noqa: E402
import throughput_records  # noqa: E402
from throughput_table import print_table, seed_summaries  # noqa: E402

WORKLOAD = dict(model="smollm2", batch=64, prompt_tokens=7502, bound_tokens_per_s=1.0)


def _records(rates: dict[tuple[str, int], float], iterations: dict[int, int]) -> list[dict]:
    records = []
    for (method, seed), tokens_per_s in rates.items():
        record = dict(WORKLOAD, decoding="sample", method=method, seed=seed, tokens_per_s=tokens_per_s,
                      step_ms=1.0, fraction_of_bound=1.0)
        if method == "vegas":
            record["iterations"] = iterations[seed]
        throughput_records.add_ratios(record, records)
        records.append(record)
    return records


def test_each_seed_is_compared_with_the_dense_call_of_its_own_seed():
    records = _records({("dense", 0): 10.0, ("dense", 1): 20.0, ("vegas", 0): 30.0, ("vegas", 1): 30.0},
                       {0: 50, 1: 45})
    assert [r.get("x_dense") for r in records] == [None, None, 3.0, 1.5]


def test_a_seed_without_its_own_dense_call_takes_the_latest_dense_one():
    greedy = dict(WORKLOAD, decoding="greedy", method="dense", tokens_per_s=10.0)
    vegas = dict(WORKLOAD, decoding="greedy", method="vegas", tokens_per_s=25.0)
    throughput_records.add_ratios(vegas, [greedy])
    assert vegas["x_dense"] == 2.5
    records = _records({("dense", 0): 10.0, ("vegas", 0): 30.0, ("vegas", 7): 40.0}, {0: 50, 7: 44})
    assert records[-1]["x_dense"] == 4.0, "no dense call of seed 7: the one there is"


def test_summaries_average_over_seeds_and_skip_single_calls(capsys):
    records = _records({("dense", 0): 10.0, ("dense", 1): 10.0, ("vegas", 0): 20.0, ("vegas", 1): 30.0},
                       {0: 53, 1: 46})
    records.append(dict(WORKLOAD, decoding="greedy", method="vegas", tokens_per_s=28.0, step_ms=1.0,
                        fraction_of_bound=1.0))  # greedy: no seed, no summary
    summaries = {s["method"]: s for s in seed_summaries(records)}
    assert set(summaries) == {"dense", "vegas"}
    vegas = summaries["vegas"]
    assert vegas["tokens_per_s"] == 25.0 and vegas["tokens_per_s_range"] == [20.0, 30.0]
    assert vegas["iterations_range"] == [46, 53] and vegas["x_dense"] == 2.5 and vegas["seeds"] == [0, 1]
    assert "iterations_range" not in summaries["dense"]
    only_one = [r for r in records if r.get("seed") != 1]
    assert seed_summaries(only_one) == [], "one seed per run: nothing to summarise"
    print_table(records)
    printed = capsys.readouterr().out
    assert "vegas over seeds [0, 1]: 25 tokens/s on average (20-30), 46-53 iterations, 2.50x dense" in printed
    assert "seed 1" in printed


@pytest.mark.parametrize("seeds", [["1", "1"], ["-1"]])
def test_bad_seeds_stop_before_any_gpu_work(monkeypatch, seeds):
    monkeypatch.setattr(throughput.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(throughput, "read_bandwidth", lambda: pytest.fail("measured before checking --seeds"))
    monkeypatch.setattr(sys, "argv", ["throughput.py", "--workloads", "smollm2:1x100", "--seeds", *seeds])
    with pytest.raises(SystemExit, match="--seeds must be distinct non-negative integers"):
        throughput.main()



@pytest.mark.parametrize("argv", [["--workloads", "smollm2:1x100", "--decodings", "greedy"],
                                  ["--workloads", "qwen3-8b-shape:1x100"]])
def test_seeds_that_would_change_nothing_are_refused(monkeypatch, argv):
    """Greedy runs once, and random-weight shapes run greedy only: seeds asked for there would be ignored."""
    monkeypatch.setattr(throughput.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(throughput, "read_bandwidth", lambda: pytest.fail("measured before checking --seeds"))
    monkeypatch.setattr(sys, "argv", ["throughput.py", *argv, "--seeds", "0", "1"])
    with pytest.raises(SystemExit, match="--seeds 0 1 would change nothing"):
        throughput.main()

def test_summaries_keep_passes_and_processes_apart():
    records = []
    for run, repeat in (("a", 0), ("a", 1), ("b", 0)):
        for seed, rate in ((0, 10.0), (1, 20.0 + repeat)):
            records.append(dict(WORKLOAD, decoding="sample", method="vegas", seed=seed, tokens_per_s=rate, run=run,
                                repeat=repeat, commit="c" * 40, gpu="NVIDIA H200"))
    summaries = seed_summaries(records)
    assert [s["tokens_per_s_range"] for s in summaries] == [[10.0, 20.0], [10.0, 21.0], [10.0, 20.0]]
    assert all(s["seeds"] == [0, 1] for s in summaries)


def test_sampled_jobs_run_once_per_seed_and_greedy_or_random_weights_once():
    import workloads

    plan = [workloads.parse_workload("smollm2:64x7500"), workloads.parse_workload("qwen3-8b-shape:4x32768")]
    sets = [None, "pdl:enabled=0"]
    jobs = throughput.job_list(plan, ["greedy", "sample"], ["hf", "dense", "vegas"], sets, 2, [0, 3])
    real, shape = [j for j in jobs if j[1] is plan[0]], [j for j in jobs if j[1] is plan[1]]
    assert {j[2] for j in shape} == {"greedy"} and all(j[5] is None for j in shape), "random weights: greedy only"
    for repeat in (0, 1):
        sampled = [(m, s, seed) for r, _, d, m, s, seed in real if r == repeat and d == "sample"]
        if repeat == 1:
            sets = sets[::-1]  # (alternate passes take the sets in the opposite order)
        assert sampled == [("hf", None, 0), ("hf", None, 3)] + [
            (m, s, seed) for m in ("dense", "vegas") for s in sets for seed in (0, 3)]
        greedy = [(m, s, seed) for r, _, d, m, s, seed in real if r == repeat and d == "greedy"]
        assert greedy == [("hf", None, None)] + [(m, s, None) for m in ("dense", "vegas") for s in sets]


def test_the_plot_draws_the_mean_of_the_last_measurements_seeds(tmp_path, monkeypatch):
    import json

    import matplotlib.axes
    import plot_throughput

    def record(seed, tokens_per_s, run="new", commit="b" * 40):
        return dict(WORKLOAD, decoding="sample", method="vegas", seed=seed, tokens_per_s=tokens_per_s, commit=commit,
                    gpu="NVIDIA H200", read_bandwidth_GBps=4000.0, run=run, bound_tokens_per_s=10 * tokens_per_s)

    earlier = record(2, 99.0, run="old")  # the same commit and GPU, another process: not this measurement's seed
    rows = [earlier, record(0, 20.0), record(1, 30.0), record(0, 40.0)]  # seed 0 again: its latest call counts
    assert plot_throughput.seed_calls(rows[-1], rows) == [rows[3], rows[2]]
    no_run = [{k: v for k, v in r.items() if k != "run"} for r in rows]  # (records from before `run`)
    assert plot_throughput.seed_calls(no_run[-1], no_run) == [no_run[0], no_run[3], no_run[2]], "same commit and GPU"
    no_seed = {k: v for k, v in rows[2].items() if k != "seed"}
    assert plot_throughput.seed_calls(no_seed, rows) == [no_seed]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "plot.png"
    bars, ticks = [], []
    bar, plot = matplotlib.axes.Axes.bar, matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "bar",
                        lambda self, x, height, *a, **k: bars.append(height) or bar(self, x, height, *a, **k))
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, xs, ys, *a, **k: ticks.append(list(ys)) or plot(self, xs, ys, *a, **k))
    monkeypatch.setattr(sys, "argv", ["plot_throughput.py", "--records", str(path), "--out", str(out)])
    plot_throughput.main()
    assert bars == [35.0], "the mean of seed 0's latest call (40) and seed 1's (30)"
    assert ticks == [[30.0, 40.0], [350.0, 350.0]], "the seeds' range, then the mean bound"
    assert out.stat().st_size > 0
