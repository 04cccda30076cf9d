#!/usr/bin/env bash
# vegas_gamma="auto" against every fixed gamma and the dense path (issue "Self-tuning": auto within 5 % of the best
# fixed gamma, never more than 3 % slower than dense), greedy, one throughput.py call per gamma on the same prompts.
#     OUT=/tmp/sweep bash benchmarks/gamma_sweep.sh smollm2:1x7500 smollm2:16x7500 smollm2:64x7500
#     EXTRA=--compile bash benchmarks/gamma_sweep.sh ...      (extra throughput.py arguments, e.g. --compile)
set -u
OUT=${OUT:-/tmp/gamma_sweep}
mkdir -p "$OUT"
workloads=("$@")
[ ${#workloads[@]} -gt 0 ] || workloads=(smollm2:1x7500 smollm2:16x7500 smollm2:64x7500)
run() {
    python3 benchmarks/throughput.py --workloads "${workloads[@]}" --decodings greedy --no-progress \
        --out "$OUT/gamma_sweep.jsonl" ${EXTRA:-} "$@" >> "$OUT/gamma_sweep_log.txt" 2>&1 || echo "failed: $*"
}
run --methods dense
for gamma in 2 4 6 8 auto; do
    run --methods vegas --gamma "$gamma"
done
python3 - "$OUT/gamma_sweep.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
table = {}
for r in rows:
    if "error" in r:
        continue
    name = "dense" if r["method"] == "dense" else f"g{r['config']['gamma']}"
    table.setdefault(f"{r['batch']}x{r['prompt_tokens']}", {})[name] = (r["tokens_per_s"], r.get("gammas_run"))
for workload, runs in table.items():
    fixed = {k: v[0] for k, v in runs.items() if k not in ("gauto",)}
    best = max(fixed, key=fixed.get)
    auto = runs.get("gauto", (float("nan"), None))
    print(workload, " ".join(f"{k} {v:.0f}" for k, v in fixed.items()),
          f"| auto {auto[0]:.0f} = {auto[0] / fixed[best]:.3f} of best ({best}), "
          f"{auto[0] / fixed.get('dense', float('nan')):.3f} of dense; ran {auto[1]}")
PY
