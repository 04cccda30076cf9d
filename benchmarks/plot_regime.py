"""The regime map: where speculation pays. Drawn from the throughput benchmark's `--sweep` records.

    python benchmarks/plot_regime.py             # benchmarks/results/throughput.jsonl -> regime.png

Left: Vegas over our dense path against the batch size, one line per prompt length, measured (solid) and as the
traffic model predicts from the bytes each must read (dashed). Right, where the sweep ran HF too: Vegas over HF's
best vanilla generate.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from results_io import read_records, save_figure  # noqa: E402  (benchmarks/ is the script's directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=Path, default=Path("benchmarks/results/throughput.jsonl"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/regime.png"))
    parser.add_argument("--decoding", default="greedy")
    args = parser.parse_args()
    latest = {}  # the last record of each measurement wins
    for r in read_records(args.records):
        if r.get("sweep") and r["method"] == "vegas" and r["decoding"] == args.decoding and "x_dense" in r:
            # rows' chat prompts land within a few tokens of the size asked for: group by the nearest hundred
            latest[(round(r["prompt_tokens"], -2), r["batch"])] = r
    if not latest:
        raise SystemExit(f"{args.records} holds no --sweep records of Vegas with {args.decoding} decoding")
    prompts = sorted({p for p, _ in latest})
    with_hf = any("x_hf" in r for r in latest.values())
    fig, axes = plt.subplots(1, 2 if with_hf else 1, figsize=(10 if with_hf else 5.5, 3.8), squeeze=False)
    left, right = axes[0][0], axes[0][-1]
    for i, prompt in enumerate(prompts):
        rows = sorted((b, r) for (p, b), r in latest.items() if p == prompt)
        batches = [b for b, _ in rows]
        color = plt.cm.viridis(i / max(len(prompts) - 1, 1))
        left.plot(batches, [r["x_dense"] for _, r in rows], "o-", color=color, label=f"{prompt} tokens, measured")
        left.plot(batches, [r["predicted_x_dense"] for _, r in rows], "s--", color=color, alpha=0.6,
                  label=f"{prompt} tokens, traffic model")
        over_hf = [(b, r["x_hf"]) for b, r in rows if "x_hf" in r]
        if over_hf:
            right.plot(*zip(*over_hf), "o-", color=color, label=f"{prompt} tokens")
    panels = [(left, "Vegas / our dense path")] + ([(right, "Vegas / HF static + compile")] if with_hf else [])
    for ax, title in panels:
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("batch")
        ax.set_ylabel("speedup")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    first = next(iter(latest.values()))
    commits = ", ".join(sorted({r["commit"] for r in latest.values()}))
    save_figure(fig, args.out, f"Where speculation pays: {first['model']}, {args.decoding}\n{first['gpu']}, "
                f"commits {commits}", 9, f"{len(latest)} Vegas records")


if __name__ == "__main__":
    main()
