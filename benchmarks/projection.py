"""Vegas on random-weight shapes, projected from a real model's run of the same decoding and selection settings.

Random weights give near-tied logits: every iteration rejects the drafts, so their acceptance means nothing. Two
things of the real model's run stand in for it:

- tokens per iteration: the projected throughput is the real run's net tokens per iteration (its new tokens over
  its iterations) over this run's mean iteration time;
- the draft budget: `budget_boost` scales each row's budget by its running rejection average, so rows of random
  weights, which reject every draft, would draft at the full boost, where the real model's rows, which mostly
  accept, draft closer to the plain budget. With `--projected-budget matched` (the default) each verification sets
  every row's average to the value whose boost is the real run's mean draft budget scale (`budget_scale`, from
  `draft_budget_scales`) instead of folding in the rejection (`pinned_rejection`), so the drafts read as many slots as
  the real run's did on average; `budget_boost` itself keeps its configured value, because it also sizes the draft
  attention's splits (`SelectionState.draft_split_len`). `config` lets the rows' rejections count, as before 936660c.
  Either way the record holds the scale its own drafts ran at and the real run's.

(936660c..a608a8c set `budget_boost` to the real run's scale instead: its drafts read the right number of slots, but
in shorter splits than the configured boost gives, so the draft attention ran faster than it would.)
"""

from __future__ import annotations

import contextlib
import math

import torch

import hf_vegas
from hf_vegas.selection_state import SelectionState, draft_budget_scales

BUDGETS = ("matched", "config")


# The selection settings a projection's source must share with the shape it projects.
SELECTION_SETTINGS = ("gamma", "sparsity", "min_tokens", "budget_boost", "score", "policy")


def budget_fields(out, config: hf_vegas.VegasConfig, pinned: float | None = None) -> dict:
    """A finished Vegas generation's mean draft budget scale over the (row, iteration) pairs that drafted, and the
    share of those whose verification rejected a draft; `pinned`: the average `pinned_rejection` held."""
    update = None if pinned is None else _held(pinned)
    scales = draft_budget_scales(out.accepted, out.gammas, config, **({"update": update} if update else {}))
    drafted = ~scales.isnan()
    if not drafted.any():
        return {}
    rejected = out.accepted < out.gammas.to(out.accepted.device)[None, :]
    return dict(budget_scale=float(scales[drafted].mean()), rejection_share=float(rejected[drafted].float().mean()))


def source(records: list[dict], config: hf_vegas.VegasConfig, decoding: str) -> dict | None:
    """The latest real-model record with `config`'s selection settings and `decoding` at the largest batch, or None."""
    wanted = config.to_dict()
    real = [r for r in records if r["real_weights"] and r["decoding"] == decoding and "tokens_per_iteration" in r
            and all(r["config"].get(k) == wanted[k] for k in SELECTION_SETTINGS)]
    return max(reversed(real), key=lambda r: r["batch"]) if real else None  # (max keeps the first of equals)


def held_rejection(config: hf_vegas.VegasConfig, real: dict | None, budget: str) -> tuple[float | None, dict]:
    """The rejection average to hold a random-weight shape's rows at (None: let their rejections count), and what the
    record should say about it."""
    if budget not in BUDGETS:
        raise ValueError(f"projected budget must be one of {BUDGETS}, got {budget!r}")
    if real is None or budget == "config" or config.budget_boost <= 1:
        return None, {}
    if "budget_scale" not in real:
        print(f"note: the projection's source ({real['model']} batch {real['batch']}, {real.get('commit')}) has no "
              "budget_scale; its rows' rejections count, and rows of random weights reject every draft")
        return None, {}
    held = min(max((real["budget_scale"] - 1) / (config.budget_boost - 1), 0.0), 1.0)
    return held, dict(held_rejection=held)


def _held(value: float):
    """An update of the rows' rejection averages (as `updated_rejection`) that sets every active row's to `value`."""
    def update(rejection, accepted, gamma, active):
        return torch.where(active, torch.full_like(rejection, value), rejection)
    return update


@contextlib.contextmanager
def pinned_rejection(value: float | None):
    """While open, each verification sets its active rows' rejection averages to `value` instead of folding in whether
    they rejected a draft (`SelectionState.note_acceptance`); None: nothing changes. Put back on exit."""
    if value is None:
        yield
        return
    original, update = SelectionState.note_acceptance, _held(value)

    def note_acceptance(self, accepted, active):
        if self.config.budget_boost > 1:
            self.rejection.copy_(update(self.rejection, accepted, self.gamma, active))

    SelectionState.note_acceptance = note_acceptance
    try:
        yield
    finally:
        SelectionState.note_acceptance = original


def project(record: dict, real: dict | None) -> float:
    """Mark `record` (a random-weight shape's Vegas run) as projected from `real` and return the tokens per iteration
    its bound should use; without a real record, its own."""
    if real is None:
        record["projected"] = False
        return record["tokens_per_iteration"]
    record.update(projected=True, projected_from=(f"{real['model']} {real['batch']}x{real['prompt_tokens']} "
                                                  f"{real['decoding']} ({real.get('commit')})"),
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
