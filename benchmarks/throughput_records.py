"""What a throughput record derives from its measurement (`throughput.py`): tokens/s, the memory-traffic bounds
(`hf_vegas/traffic.py`, over the read bandwidth measured in the same run), one draft step against its own bound, and
the speedups over the HF and dense records of the same run."""

from __future__ import annotations

import dataclasses

import hf_vegas
from hf_vegas import traffic
import projection

SPECULATIVE = ("vegas", "vegas-all", "streaming")


def bound(model, workload, method, new_tokens, config, tokens_per_iteration, bandwidth, rejection=0.0) -> dict:
    """Traffic bound at the mean context of the decode (prompt + half the new tokens); Vegas' drafts read budgets
    boosted as at the rejection average `rejection`."""
    context = workload.prompt_tokens + new_tokens // 2
    if method in ("hf", "dense"):
        step_bytes, tokens = traffic.dense_step_bytes(model, workload.batch, context), workload.batch
    else:
        step_bytes = traffic.vegas_iteration_bytes(model, workload.batch, context, config, rejection)
        tokens = workload.batch * tokens_per_iteration
    seconds = step_bytes / bandwidth
    return dict(bound_step_bytes=step_bytes, bound_step_ms=seconds * 1e3, bound_tokens_per_s=tokens / seconds)


def draft_step(model, workload, new_tokens, config, split_ms, bandwidth, rejection=0.0) -> dict:
    """One draft step's measured time (the iteration's draft time over gamma) against its own traffic bound (the
    weights and the sparse KV it reads, at the decode's mean context): the issue's "draft step near its bound"."""
    context = workload.prompt_tokens + new_tokens // 2
    draft_bytes = (traffic.vegas_iteration_bytes(model, workload.batch, context, config, rejection)
                   - traffic.dense_step_bytes(model, workload.batch, context + config.gamma + 1)) / config.gamma
    bound_ms = draft_bytes / bandwidth * 1e3
    step_ms = split_ms["draft"] / config.gamma
    return dict(draft_step_ms=step_ms, draft_step_bound_ms=bound_ms, draft_step_x_bound=step_ms / bound_ms)


def add_throughput(record, model, workload, method, new_tokens, config, real, bandwidth) -> None:
    """Tokens/s, bounds and the draft step of a run; `real`: the real-model record a random-weight shape's Vegas run
    is projected from (`projection.source`)."""
    if config is not None and config.gamma == "auto":  # the bound of the gamma that ran most (0: the dense path)
        ran = as_run(config, record)
        config, method = (ran, method) if ran else (None, "dense")
    speculative = method in SPECULATIVE
    if speculative and not workload.real_weights:  # acceptance of random weights means nothing: project
        tpi = projection.project(record, real)
    else:
        tpi = record.get("tokens_per_iteration", 1.0)
    rejection = projection.rejection(record, config) if speculative else 0.0
    record.update(bound(model, workload, method, new_tokens, config, tpi, bandwidth, rejection))
    if speculative and record.get("split_ms"):
        record.update(draft_step(model, workload, new_tokens, config, record["split_ms"], bandwidth, rejection))
    if record.get("projected"):
        # as the real model's rows: its tokens per iteration net of the ends of rows and batch (new tokens over
        # iterations), over this run's mean iteration time
        record["measured_tokens_per_s"] = workload.batch * (new_tokens - 1) / record["decode_seconds"]
        mean_iteration = record["decode_seconds"] / record["iterations"]
        record["tokens_per_s"] = workload.batch * record["projected_net_tokens_per_iteration"] / mean_iteration
    else:
        record["tokens_per_s"] = workload.batch * (new_tokens - 1) / record["decode_seconds"]
    record["fraction_of_bound"] = record["tokens_per_s"] / record["bound_tokens_per_s"]
    if record.get("iterations") and not record.get("projected"):
        # The batch runs until its slowest row is done: iterations over what a row of average acceptance needs.
        # 1 for the dense path; the gap between Vegas' per-iteration rate and its tokens/s.
        record["straggler_tail"] = record["iterations"] * tpi / (new_tokens - 1)


def as_run(config: hf_vegas.VegasConfig, record: dict) -> hf_vegas.VegasConfig | int:
    """`config` with the gamma a `gamma="auto"` run ran most, or 0 where that was its dense path; else `config`."""
    if config.gamma != "auto":
        return config
    ran = record["gammas_run"]
    gamma = int(max(ran, key=ran.get))
    return dataclasses.replace(config, gamma=gamma) if gamma else 0


def add_ratios(record, records) -> None:
    """Speedups over HF and our dense path measured in this run, and the traffic model's over dense (the ratio of
    the two bounds: what the bytes alone would allow at this workload and the measured tokens per iteration). With
    `--seeds`, a sampled call is compared with the other method's call of the same seed."""
    def comparable(other) -> bool:
        return (all(other.get(k) == record[k] for k in ("model", "batch", "prompt_tokens", "decoding"))
                and other.get("repeat") == record.get("repeat")  # (`--repeats`: within one pass)
                and "tokens_per_s" in other and other["method"] in ("hf", "dense")
                and other["method"] != record["method"]
                # (an A/B of launch settings: each against dense under its own)
                and (other["method"] != "dense" or other.get("tuning_set") == record.get("tuning_set")))

    candidates = [other for other in records if comparable(other)]
    for other in candidates:
        if other.get("seed") != record.get("seed") and any(
                o["method"] == other["method"] and o.get("seed") == record.get("seed") for o in candidates):
            continue
        record[f"x_{other['method']}"] = record["tokens_per_s"] / other["tokens_per_s"]
        if other["method"] == "dense":
            record["predicted_x_dense"] = record["bound_tokens_per_s"] / other["bound_tokens_per_s"]
