"""Draw the kernel benchmark's achieved bandwidth from its JSONL records.

    python benchmarks/plot_kernels.py                  # benchmarks/results/kernels.jsonl -> kernels.png

One panel per (model shape, kernel), one line per batch size: KV bytes read per second as a share of the measured
copy bandwidth, against the context length, with the issue's targets drawn in.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from results_io import read_records, save_figure  # noqa: E402  (benchmarks/ is the script's directory)

OPS = {"draft": ("sparse draft", 0.70), "dense": ("dense decode", 0.75), "verify": ("verification", 0.75),
       "verify+scores(weights)": ("verification + weights", 0.75)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=Path, default=Path("benchmarks/results/kernels.jsonl"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kernels.png"))
    parser.add_argument("--commit", default=None, help="plot this commit's records (default: the newest)")
    args = parser.parse_args()
    records = read_records(args.records)
    commit = args.commit or records[-1]["commit"]
    records = [r for r in records if r["commit"] == commit and r["op"] in OPS]
    shapes = sorted({r["shape"] for r in records})
    lines = defaultdict(list)
    for r in records:
        lines[(r["shape"], r["op"], r["batch"])].append((r["context"], 100 * r["fraction_of_copy"]))

    fig, axes = plt.subplots(len(shapes), len(OPS), figsize=(4 * len(OPS), 3.2 * len(shapes)), squeeze=False,
                             sharey=True)
    for row, shape in enumerate(shapes):
        for col, (op, (title, target)) in enumerate(OPS.items()):
            ax = axes[row][col]
            for (s, o, batch), points in sorted(lines.items(), key=lambda item: item[0][2]):
                if (s, o) == (shape, op):
                    xs, ys = zip(*sorted(points))
                    ax.plot(xs, ys, marker="o", label=f"batch {batch}")
            ax.axhline(100 * target, color="gray", linestyle="--", linewidth=1)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{shape}: {title}", fontsize=9)
            ax.set_xlabel("context (tokens)")
            if col == 0:
                ax.set_ylabel("% of copy bandwidth")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    first = records[0]
    save_figure(fig, args.out, f"hf_vegas kernels, {first['gpu']}, {first['dtype']}, commit {commit} "
                f"(copy {first['copy_bandwidth_GBps']:.0f} GB/s; dashed: target)", 10,
                f"{len(records)} records of commit {commit}")


if __name__ == "__main__":
    main()
