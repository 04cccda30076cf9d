"""Draw the throughput benchmark's results from its JSONL records.

    python benchmarks/plot_throughput.py              # benchmarks/results/throughput.jsonl -> throughput.png

One panel per (model, decoding, and tensor-parallel world size where above 1): decode tokens/s of each method at
each batch size (bars, log scale), with each method's memory-traffic bound as a tick above its bar (under tensor
parallelism, over the GPUs' bandwidth together). Projected values (random-weight shapes) are hatched. A sampled
measurement over several seeds (`throughput.py --seeds`) is drawn as the mean of its seeds' calls in that process,
with a line from the least to the most.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from results_io import read_records, save_figure  # noqa: E402  (benchmarks/ is the script's directory)

COLORS = {"hf": "#9e9e9e", "dense": "#4c72b0", "streaming": "#dd8452", "vegas": "#55a868"}
LABELS = {"hf": "HF static + compile", "dense": "hf_vegas dense (gamma 0)", "streaming": "streaming drafts",
          "vegas": "Vegas"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=Path, default=Path("benchmarks/results/throughput.jsonl"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/throughput.png"))
    parser.add_argument("--commit", nargs="*", default=None, help="plot only these commits' records (default: all)")
    args = parser.parse_args()
    records = read_records(args.records)
    # The last record of each measurement wins. Experiments are not plotted: compiler options (`--inductor`) and launch
    # settings other than the defaults (`--tuning`, `--tuning-sets`).
    latest, seeds = {}, {}
    for r in records:
        chosen = args.commit is None or any(r["commit"].startswith(c) for c in args.commit)  # (a short or full hash)
        if chosen and "tokens_per_s" in r and not r.get("sweep") \
                and not r.get("inductor") and not r.get("tuning_overrides") and not r.get("tuning_set"):
            # a tensor-parallel run is its own panel ("qwen3-8b-shape, TP = 2"): its bars are those of N GPUs
            model = r["model"] + (f", TP = {r['world_size']}" if r.get("world_size", 1) > 1 else "")
            key = (model, r["decoding"], r["batch"], r["prompt_tokens"], r["method"])
            latest[key] = r
            if "seed" in r:
                seeds.setdefault(key, []).append(r)
    commit = ", ".join(sorted({r["commit"][:7] for r in latest.values()}))  # (records may hold full hashes)
    panels = sorted({(m, d) for m, d, *_ in latest}, key=lambda p: (p[0] != "smollm2", p))
    gpus = sorted({_short(r["gpu"]) for r in latest.values()})

    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False)
    for ax, (model, decoding) in zip(axes[0], panels):
        groups = sorted({(b, p) for m, d, b, p, _ in latest if (m, d) == (model, decoding)})
        methods = [m for m in COLORS if any((model, decoding, b, p, m) in latest for b, p in groups)]
        width = 0.8 / len(methods)
        for i, method in enumerate(methods):
            for g, (batch, prompt) in enumerate(groups):
                r = latest.get((model, decoding, batch, prompt, method))
                if r is None:
                    continue
                x = g + (i - (len(methods) - 1) / 2) * width
                measured = seed_calls(r, seeds.get((model, decoding, batch, prompt, method), []))
                rates = [m["tokens_per_s"] for m in measured]
                if len(rates) > 1:
                    ax.plot([x, x], [min(rates), max(rates)], color="black", linewidth=0.8)
                ax.bar(x, sum(rates) / len(rates), width, color=COLORS[method],
                       hatch="//" if r.get("projected") else None, label=LABELS[method] if g == 0 else None,
                       edgecolor="white")
                bound = sum(m["bound_tokens_per_s"] for m in measured) / len(measured)
                ax.plot([x - width / 2, x + width / 2], [bound] * 2, color="black", linewidth=1.5)
        # Several GPUs in one figure (a shape that fits only the larger card): each group says where it ran.
        where = {g: {_short(r["gpu"]) for key, r in latest.items() if key[:4] == (model, decoding, *g)}
                 for g in groups}
        ax.set_xticks(range(len(groups)), [f"{b} x {p}" + (f"\n{', '.join(sorted(where[(b, p)]))}"
                                                            if len(gpus) > 1 else "") for b, p in groups])
        ax.set_yscale("log")
        ax.set_title(f"{model}, {decoding}", fontsize=10)
        ax.set_xlabel("batch x prompt tokens")
        ax.set_ylabel("decode tokens/s")
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=7, loc="upper left")
    bandwidths = ", ".join(f"{gpu} {bw:.0f}" for gpu, bw in sorted(
        {_short(r["gpu"]): r["read_bandwidth_GBps"] for r in latest.values()}.items()))
    save_figure(fig, args.out, f"hf_vegas throughput, {', '.join(gpus)}, bf16, commits {commit}; black tick: "
                f"memory-traffic bound (read GB/s: {bandwidths}); hatched: projected", 9,
                f"{len(latest)} records (commits {commit})")


def seed_calls(latest: dict, with_seeds: list[dict]) -> list[dict]:
    """The records of the measurement `latest` ends: for a sampled one over several seeds (`throughput.py --seeds`),
    the latest call of each seed in the same process (`run`; records from before `run` existed: the same commit and
    GPU), in the order `with_seeds` holds them (the file's); else `latest` alone."""
    if "seed" not in latest:
        return [latest]
    same = ("run",) if "run" in latest else ("commit", "gpu")
    calls = {r["seed"]: r for r in with_seeds if all(r.get(k) == latest[k] for k in same)}  # (`latest` among them)
    return list(calls.values())


def _short(gpu: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "H100"."""
    words = gpu.replace("NVIDIA ", "").split()
    return words[0] if words else gpu


if __name__ == "__main__":
    main()
