"""`benchmarks/throughput.py --seeds`: sampled calls under several torch seeds, each its own record, each compared
with the other methods' call of the same seed, and summarised over the seeds."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import throughput  # noqa: E402
from throughput_table import print_table, seed_summaries  # noqa: E402

WORKLOAD = dict(model="smollm2", batch=64, prompt_tokens=7502, bound_tokens_per_s=1.0)


def _records(rates: dict[tuple[str, int], float], iterations: dict[int, int]) -> list[dict]:
    records = []
    for (method, seed), tokens_per_s in rates.items():
        record = dict(WORKLOAD, decoding="sample", method=method, seed=seed, tokens_per_s=tokens_per_s,
                      step_ms=1.0, fraction_of_bound=1.0)
        if method == "vegas":
            record["iterations"] = iterations[seed]
        throughput._add_ratios(record, records)
        records.append(record)
    return records


def test_each_seed_is_compared_with_the_dense_call_of_its_own_seed():
    records = _records({("dense", 0): 10.0, ("dense", 1): 20.0, ("vegas", 0): 30.0, ("vegas", 1): 30.0},
                       {0: 50, 1: 45})
    assert [r.get("x_dense") for r in records] == [None, None, 3.0, 1.5]


def test_a_seed_without_its_own_dense_call_takes_the_latest_dense_one():
    greedy = dict(WORKLOAD, decoding="greedy", method="dense", tokens_per_s=10.0)
    vegas = dict(WORKLOAD, decoding="greedy", method="vegas", tokens_per_s=25.0)
    throughput._add_ratios(vegas, [greedy])
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


def test_the_plot_draws_the_mean_of_the_last_measurements_seeds(tmp_path, monkeypatch):
    import json

    import plot_throughput

    def record(seed, tokens_per_s, commit="b" * 40):
        return dict(WORKLOAD, decoding="sample", method="vegas", seed=seed, tokens_per_s=tokens_per_s, commit=commit,
                    gpu="NVIDIA H200", read_bandwidth_GBps=4000.0)

    older = record(2, 99.0, commit="a" * 40)  # an earlier measurement's seed 2: not part of the last one
    rows = [older, record(0, 20.0), record(1, 30.0)]
    by_seed = {0: rows[1], 1: rows[2], 2: older}
    assert plot_throughput._seed_rates(rows[2], by_seed) == [20.0, 30.0]
    no_seed = {k: v for k, v in rows[2].items() if k != "seed"}
    assert plot_throughput._seed_rates(no_seed, by_seed) == [30.0]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "plot.png"
    monkeypatch.setattr(sys, "argv", ["plot_throughput.py", "--records", str(path), "--out", str(out)])
    plot_throughput.main()
    assert out.stat().st_size > 0
