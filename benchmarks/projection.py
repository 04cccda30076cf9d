"""Vegas on random-weight shapes, projected from a real model's run of the same policy and decoding.

Random weights give near-tied logits: every iteration rejects the drafts, so their acceptance means nothing. Two
things of the real model's run stand in for it:

- tokens per iteration: the projected throughput is the real run's net tokens per iteration (its new tokens over
  its iterations) over this run's mean iteration time;
- the draft budget: `budget_boost` scales each row's budget by its running rejection average, so rows of random
  weights, which reject every draft, would draft at the full boost, where the real model's rows, which mostly
  accept, draft closer to the plain budget. With `--projected-budget matched` (the default) the shape is timed with
  `budget_boost` set to the real run's mean draft budget scale (`budget_scale`, `draft_budget_scales`), the scale
  rows that always reject settle at; `config` times it at the configured boost. Either way the record holds the
  scale its own drafts ran at and the real run's.
"""

from __future__ import annotations

import dataclasses
import math

import hf_vegas
from hf_vegas.selection_state import draft_budget_scales

BUDGETS = ("matched", "config")


def budget_fields(out, config: hf_vegas.VegasConfig) -> dict:
    """A finished Vegas generation's mean draft budget scale over the (row, iteration) pairs that drafted, and the
    share of those whose verification rejected a draft."""
    scales = draft_budget_scales(out.accepted, out.gammas, config)
    drafted = ~scales.isnan()
    if not drafted.any():
        return {}
    rejected = out.accepted < out.gammas.to(out.accepted.device)[None, :]
    return dict(budget_scale=float(scales[drafted].mean()), rejection_share=float(rejected[drafted].float().mean()))


def source(records: list[dict], policy: str, decoding: str) -> dict | None:
    """The real-model record of `policy` and `decoding` with the largest batch (the latest of those), or None."""
    real = [r for r in records if r["real_weights"] and r["method"] == policy and r["decoding"] == decoding
            and "tokens_per_iteration" in r]
    return max(reversed(real), key=lambda r: r["batch"]) if real else None  # (max keeps the first of equals)


def timed_config(config: hf_vegas.VegasConfig, real: dict | None, budget: str
                 ) -> tuple[hf_vegas.VegasConfig, dict]:
    """The config a random-weight shape is timed with, and what the record should say about it."""
    if budget not in BUDGETS:
        raise ValueError(f"projected budget must be one of {BUDGETS}, got {budget!r}")
    if real is None or budget == "config" or config.budget_boost <= 1:
        return config, {}
    if "budget_scale" not in real:
        print(f"note: the projection's source ({real['model']} batch {real['batch']}, {real.get('commit')}) has no "
              "budget_scale; timing at the configured budget_boost, which rows of random weights always reach")
        return config, {}
    scale = min(real["budget_scale"], config.budget_boost)
    return dataclasses.replace(config, budget_boost=scale), dict(projected_budget_boost=scale,
                                                                 configured_budget_boost=config.budget_boost)


def project(record: dict, real: dict | None) -> float:
    """Mark `record` (a random-weight shape's Vegas run) as projected from `real` and return the tokens per iteration
    its bound should use; without a real record, its own."""
    if real is None:
        record["projected"] = False
        return record["tokens_per_iteration"]
    record.update(projected=True, projected_from=f"{real['model']} batch {real['batch']} {real['decoding']}",
                  measured_tokens_per_iteration=record["tokens_per_iteration"],
                  tokens_per_iteration=real["tokens_per_iteration"],
                  projected_net_tokens_per_iteration=(real["new_tokens"] - 1) / real["iterations"],
                  **({"projected_budget_scale": real["budget_scale"]} if "budget_scale" in real else {}))
    return real["tokens_per_iteration"]


def rejection(record: dict, config: hf_vegas.VegasConfig) -> float:
    """The rejection average at which `config`'s boost equals the record's mean draft budget scale: what the traffic
    bounds read (0 without a boost or a measured scale: the plain budget)."""
    boost = float(config.budget_boost)
    if boost <= 1 or "budget_scale" not in record or not math.isfinite(record["budget_scale"]):
        return 0.0
    return min(max((record["budget_scale"] - 1) / (boost - 1), 0.0), 1.0)
