"""CPU benchmark: vanilla `generate`, our dense path and Vegas on SmolLM2-135M-Instruct (fp32), in one run.

    python benchmarks/cpu_throughput.py                                  # 1x4000, 1x7500, 4x4000; 128 new tokens
    python benchmarks/cpu_throughput.py --workloads 1x2000 --new-tokens 32 --threads 2

Methods, on the same real-text chat prompts in one process, greedy:
  vanilla  HF `generate` as a user calls it (its default dynamic cache, SDPA attention)
  dense    hf_vegas with gamma = 0 (one token per step over the Vegas cache: the CPU path, `hf_vegas/ops/eager.py`)
  vegas    hf_vegas with its defaults (gamma 6, sparsity 0.07, at least 256 tokens, weights scores)
Every row generates exactly --new-tokens (EOS off). Decode tokens/s = batch x (new tokens - 1) / the time from the
first token (after the prefill, timed by a stopping criterion both loops call) to the last; the prefill, the same
work for every method, is recorded apart. Greedy tokens of dense and Vegas are compared with vanilla's.

Beside each figure, the traffic model's prediction: the bytes a step must read (`hf_vegas/traffic.py`) over the read
bandwidth this run measures. On a CPU a verification of gamma + 1 tokens is partly compute-bound, which the traffic
model does not see; the records hold the measured step times too. Records go to --out (JSONL), a table ends the run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import os
import platform
import re
import time
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

import hf_vegas
from hf_vegas import traffic
from provenance import commit, dirty, tree
from results_io import append_records
from step_timer import FirstTokenClock
from workloads import Workload, prompts

METHODS = ("vanilla", "dense", "vegas")
DEFAULT_WORKLOADS = ("1x4000", "1x7500", "4x4000")


def parse_workload(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if match is None:
        raise ValueError(f"A workload is BATCHxPROMPT_TOKENS (e.g. 4x4000), got {text!r}.")
    return int(match.group(1)), int(match.group(2))


def read_bandwidth() -> float:
    """Bytes/s of a pure read (a sum over 512 MiB of written memory), the best of three."""
    data = torch.rand(2**27)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * data.element_size() / best


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@contextlib.contextmanager
def forward_times():
    """Wall time of hf_vegas' model forwards by kind (prefill / draft / verify / decode): where an iteration goes.
    On the CPU every op is synchronous, so a forward's wall time is its cost. A draft is gamma forwards, each with
    its token choice: its time counts as gamma forwards."""
    from hf_vegas.runner import StepRunner

    seconds, calls = collections.defaultdict(float), collections.Counter()
    originals = {kind: getattr(StepRunner, kind) for kind in ("prefill", "draft", "verify", "decode")}

    def timed(kind, original):
        def step(self, *args, **kwargs):
            start = time.perf_counter()
            out = original(self, *args, **kwargs)
            seconds[kind] += time.perf_counter() - start
            calls[kind] += self.gamma if kind == "draft" else 1
            return out
        return step

    for kind, original in originals.items():
        setattr(StepRunner, kind, timed(kind, original))
    try:
        yield seconds, calls
    finally:
        for kind, original in originals.items():
            setattr(StepRunner, kind, original)


def method_config(method: str) -> hf_vegas.VegasConfig | None:
    """What hf_vegas runs for `method` (None: vanilla); the records hold it."""
    return {"vanilla": None, "dense": hf_vegas.VegasConfig(gamma=0), "vegas": hf_vegas.VegasConfig()}[method]


def run(model, ids, mask, new_tokens: int, method: str) -> tuple[dict, torch.Tensor]:
    clock = FirstTokenClock()
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                  stopping_criteria=transformers.StoppingCriteriaList([clock]))
    if method != "vanilla":
        kwargs.update(custom_generate="vegas", return_dict_in_generate=True, vegas_config=method_config(method))
    with forward_times() as (seconds, calls):
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        end = time.perf_counter()
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    measured = dict(prefill_seconds=clock.first - start, decode_seconds=end - clock.first,
                    total_seconds=end - start, new_tokens=sequences.shape[1] - ids.shape[1])
    if calls:  # hf_vegas: mean forward time per kind
        measured["forward_ms"] = {kind: seconds[kind] / calls[kind] * 1e3 for kind in calls}
        measured["forward_calls"] = dict(calls)
    if method == "vegas":
        measured.update(iterations=out.accepted.shape[1], tokens_per_iteration=out.tokens_per_iteration)
    return measured, sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS), help="BATCHxPROMPT_TOKENS")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--data-files", help="local file of prompt texts for `datasets` (default: Python's docs)")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_throughput.jsonl"))
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    plan = [parse_workload(w) for w in args.workloads]  # bad input fails before any work
    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2 (decode time runs from the first token to the last).")
    torch.set_num_threads(args.threads)

    from prompts import load_texts

    from hf_vegas.real_models import load_smollm2

    model, tokenizer = load_smollm2(torch.float32, "cpu")
    model.generation_config.eos_token_id = None  # fixed-length generation
    texts = load_texts(args.data_files, args.text_column)
    bandwidth = read_bandwidth()
    base = dict(device="cpu", cpu=cpu_name(), cores=os.cpu_count(), threads=args.threads, torch=torch.__version__,
                transformers=transformers.__version__, hf_vegas=hf_vegas.__version__, commit=args.commit or commit(),
                dirty=dirty(), tree=tree(), python=platform.python_version(), platform=platform.platform(),
                time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                corpus=args.data_files or "python docs (pydoc_data)", text_column=args.text_column,
                model="smollm2", dtype="float32", decoding="greedy", read_bandwidth_GBps=bandwidth / 1e9)
    # One short call per method first: one-time costs (lazy imports, first allocations) stay out of the timings.
    warm_ids, warm_mask = prompts(Workload("smollm2", 1, 64), tokenizer, texts, device="cpu")
    for method in args.methods:
        run(model, warm_ids, warm_mask, 4, method)
    records = []
    jobs = [(w, m) for w in plan for m in args.methods]
    bar = tqdm(jobs, desc="cpu throughput", dynamic_ncols=True, disable=args.no_progress)
    vanilla_tokens = {}
    for (batch, prompt_tokens), method in bar:
        bar.set_postfix_str(f"{batch}x{prompt_tokens} {method}")
        ids, mask = prompts(Workload("smollm2", batch, prompt_tokens), tokenizer, texts, device="cpu")
        measured, sequences = run(model, ids, mask, args.new_tokens, method)
        config = method_config(method)
        record = dict(base, batch=batch, prompt_tokens=int(mask.sum(dim=1).max()),
                      row_prompt_tokens=mask.sum(dim=1).tolist(), method=method,
                      config=config.to_dict() if config else {}, **measured)
        record["tokens_per_s"] = batch * (args.new_tokens - 1) / record["decode_seconds"]
        record["step_ms"] = record["decode_seconds"] / (record.get("iterations") or args.new_tokens - 1) * 1e3
        _add_bound(record, model, args.new_tokens, bandwidth)
        key = (batch, prompt_tokens)
        if method == "vanilla":
            vanilla_tokens[key] = sequences
        elif key in vanilla_tokens:
            record["identical_to_vanilla"] = bool(torch.equal(sequences, vanilla_tokens[key]))
        _add_ratios(record, records)
        records.append(record)
        append_records(args.out, [record])
    print_table(records)


def _add_bound(record: dict, model, new_tokens: int, bandwidth: float) -> None:
    """Traffic bound at the mean context of the decode (prompt + half the new tokens)."""
    context, batch = record["prompt_tokens"] + new_tokens // 2, record["batch"]
    if record["method"] == "vegas":
        config = method_config("vegas")
        step_bytes = traffic.vegas_iteration_bytes(model, batch, context, config)
        tokens = batch * record["tokens_per_iteration"]
    else:
        step_bytes, tokens = traffic.dense_step_bytes(model, batch, context), batch
    record.update(bound_step_bytes=step_bytes, bound_tokens_per_s=tokens * bandwidth / step_bytes)


def _add_ratios(record: dict, records: list[dict]) -> None:
    """Speedups over vanilla and dense measured in this run, and the traffic model's predicted ones."""
    for other in records:
        if (other["batch"], other["prompt_tokens"]) != (record["batch"], record["prompt_tokens"]):
            continue
        name = other["method"]
        record[f"x_{name}"] = record["tokens_per_s"] / other["tokens_per_s"]
        record[f"predicted_x_{name}"] = record["bound_tokens_per_s"] / other["bound_tokens_per_s"]


def print_table(records: list[dict]) -> None:
    nan = float("nan")
    print(f"\n{'workload':<10} {'method':<8} {'prefill s':>9} {'decode s':>8} {'tok/s':>7} {'step ms':>8} "
          f"{'tok/iter':>8} {'x vanilla':>9} {'pred.':>6} {'x dense':>7} {'pred.':>6}  identical")
    for r in records:
        print(f"{r['batch']}x{r['prompt_tokens']:<8} {r['method']:<8} {r['prefill_seconds']:>9.1f} "
              f"{r['decode_seconds']:>8.1f} {r['tokens_per_s']:>7.2f} {r['step_ms']:>8.1f} "
              f"{r.get('tokens_per_iteration', 1.0):>8.2f} {r.get('x_vanilla', nan):>9.2f} "
              f"{r.get('predicted_x_vanilla', nan):>6.2f} {r.get('x_dense', nan):>7.2f} "
              f"{r.get('predicted_x_dense', nan):>6.2f}  {r.get('identical_to_vanilla', '')}")
    for r in records:
        if "forward_ms" in r:
            parts = ", ".join(f"{kind} {ms:.1f}" for kind, ms in r["forward_ms"].items() if kind != "prefill")
            print(f"{r['batch']}x{r['prompt_tokens']} {r['method']}: ms per forward: {parts}")
    print("pred.: the traffic model's speedup (bytes a step must read at this run's read bandwidth); step ms: one "
          "decode step, or one Vegas iteration (gamma drafts + one verification)")


if __name__ == "__main__":
    main()
