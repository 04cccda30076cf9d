"""The table and notes `throughput.py` prints at the end of a run, from its records."""

from __future__ import annotations

def _budget_note(r) -> str:
    """The drafts' mean budget scale (and, projected, whose rejections they followed and the real model's)."""
    if "budget_scale" not in r:
        return ""
    real = f", the real model's {r['projected_budget_scale']:.2f}" if "projected_budget_scale" in r else ""
    held = (f" (rows' rejections replayed from {r['replayed_rejections_from']})" if "replayed_rejections_from" in r
            else "")
    if "projected_budget_boost" in r:  # (936660c..a608a8c: the boost itself set to the real model's scale)
        held = f" (budget_boost {r['projected_budget_boost']:.2f} for the configured {r['configured_budget_boost']:g})"
    return f"; drafts at {r['budget_scale']:.2f}x the plain budget{held}{real}"


def seed_summaries(records) -> list[dict]:
    """Per measurement over several sampling seeds (`--seeds`: same process, workload, method, launch settings and
    pass), the mean, least and most tokens/s and iterations over its seeds, and the mean speedup over dense where
    each has one."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if "seed" in r and "error" not in r:
            key = (r["model"], r["batch"], r["prompt_tokens"], r["decoding"], r["method"],
                   str(r.get("tuning_set")), r.get("repeat"), r.get("run"), r.get("commit"), r.get("gpu"))
            groups.setdefault(key, []).append(r)
    summaries = []
    for (model, batch, prompt, decoding, method, *_), rs in groups.items():
        if len(rs) < 2:
            continue
        rates = [r["tokens_per_s"] for r in rs]
        summary = dict(workload=f"{model}:{batch}x{prompt}", decoding=decoding, method=method,
                       seeds=[r["seed"] for r in rs], tokens_per_s=sum(rates) / len(rates),
                       tokens_per_s_range=[min(rates), max(rates)])
        if all(r.get("iterations") for r in rs):
            summary["iterations_range"] = [min(r["iterations"] for r in rs), max(r["iterations"] for r in rs)]
        if all("x_dense" in r for r in rs):
            summary["x_dense"] = sum(r["x_dense"] for r in rs) / len(rs)
        summaries.append(summary)
    return summaries


def print_table(records) -> None:
    print(f"\n{'workload':<24} {'decoding':<7} {'method':<9} {'tok/s':>9} {'step ms':>8} {'bound tok/s':>11} "
          f"{'%bound':>6} {'tok/iter':>8} {'iters':>5} {'tail':>5} {'x hf':>6} {'x dense':>7} {'pred.':>6} "
          f"{'peak GiB':>8}  split ms (draft/verify/accept/host)")
    for r in records:
        name = f"{r['model']}:{r['batch']}x{r['prompt_tokens']}"
        if "error" in r:
            print(f"{name:<24} {r['decoding']:<7} {r['method']:<9} {r['error'][:60]}")
            continue
        nan = float("nan")
        split = r.get("split_ms", {})
        parts = "/".join(f"{split[k]:.2f}" for k in ("draft", "verify", "accept", "host")) if split else ""
        star = "*" if r.get("projected") else " "
        print(f"{name:<24} {r['decoding']:<7} {r['method']:<9} {r['tokens_per_s']:>8.0f}{star} {r['step_ms']:>8.2f} "
              f"{r['bound_tokens_per_s']:>11.0f} {100 * r['fraction_of_bound']:>5.0f}% "
              f"{r.get('tokens_per_iteration', 1.0):>8.2f} {r.get('iterations') or '':>5} "
              f"{r.get('straggler_tail', nan):>5.2f} {r.get('x_hf', nan):>6.2f} {r.get('x_dense', nan):>7.2f} "
              f"{r.get('predicted_x_dense', nan):>6.2f} {r.get('peak_memory_GiB', nan):>8.1f}  {parts}"
              + (f"  [{' '.join(f'{k}={v}' for k, v in r['tuning_set'].items())}]" if "tuning_set" in r else "")
              + (f"  pass {r['repeat'] + 1}" if "repeat" in r else "")
              + (f"  seed {r['seed']}" if "seed" in r else ""))
    for m in seed_summaries(records):
        low, high = m["tokens_per_s_range"]
        iterations = (f", {m['iterations_range'][0]}-{m['iterations_range'][1]} iterations"
                      if "iterations_range" in m else "")
        versus = f", {m['x_dense']:.2f}x dense on average" if "x_dense" in m else ""
        print(f"{m['workload']} {m['decoding']} {m['method']} over seeds {m['seeds']}: {m['tokens_per_s']:.0f} "
              f"tokens/s on average ({low:.0f}-{high:.0f}){iterations}{versus}")
    print("* projected: measured iteration time x tokens per iteration of the real model (random weights); "
          "pred.: the traffic model's speedup over dense; tail: iterations over those a row of average acceptance "
          "needs (the batch waits for its slowest row)")
    for r in records:
        if "per_rank_peak_memory_GiB" in r:
            peaks = ", ".join(f"{g:.1f}" for g in r["per_rank_peak_memory_GiB"] if g is not None)
            nccl = (f"NCCL {r['nccl_ms_per_iteration']:.2f} ms per iteration ({100 * r['nccl_fraction']:.1f} %)"
                    if "nccl_ms_per_iteration" in r else "")
            chosen = (f", of which the selection's all-reduce {r['selection_all_reduce_ms']:.2f} ms"
                      if "selection_all_reduce_ms" in r else "")
            print(f"{r['model']}:{r['batch']}x{r['prompt_tokens']} {r['method']} under TP = {r['world_size']}: "
                  f"{nccl}{chosen}; peak GiB per rank {peaks}")
    for r in records:
        if "draft_step_x_bound" in r:
            print(f"{r['model']}:{r['batch']}x{r['prompt_tokens']} {r['decoding']} {r['method']}: draft step "
                  f"{r['draft_step_ms']:.3f} ms, {r['draft_step_x_bound']:.2f}x its traffic bound "
                  f"{r['draft_step_bound_ms']:.3f} ms" + _budget_note(r))
    for r in records:
        if r.get("rows") and r["method"] != "dense" and not r.get("projected"):  # random weights: no acceptance
            q, slow = r["rows"]["tokens_per_iteration_quantiles"], r["rows"]["slowest"]
            name = f"{r['model']}:{r['batch']}x{r['prompt_tokens']} {r['decoding']} {r['method']}"
            print(f"{name}: tokens/iteration per row min {q['min']:.2f} p10 {q['p10']:.2f} median {q['median']:.2f} "
                  f"max {q['max']:.2f}; slowest rows "
                  + ", ".join(f"#{s['row']} {s['tokens_per_iteration']:.2f} ({s['prompt_tokens']} prompt tokens)"
                              for s in slow))
    for r in records:
        if "agreement_with_fp32" in r:
            a = r["agreement_with_fp32"]
            first = sorted(a["first_divergence"] + [a["compared_tokens"]] * a["identical_rows"])
            print(f"{r['model']}:{r['batch']}x{r['prompt_tokens']} {r['method']}: greedy tokens identical to vanilla "
                  f"fp32 in {a['identical_rows']} of {a['rows']} rows; first divergence median "
                  f"{first[len(first) // 2]}, p10 {first[len(first) // 10]} (of {a['compared_tokens']} new tokens)")
        if "agreement_with_dense" in r:
            a = r["agreement_with_dense"]
            print(f"{r['model']}:{r['batch']}x{r['prompt_tokens']} {r['method']}: greedy tokens identical to dense in "
                  f"{a['identical_rows']} of {a['rows']} rows; first divergences at new tokens "
                  f"{a['first_divergence']}")
