"""Vegas on random-weight shapes, projected from a real model's run of the same decoding and selection settings.

Random weights give near-tied logits: every iteration rejects the drafts, so their acceptance means nothing. Two
things of the real model's run stand in for it:

- tokens per iteration: the projected throughput is the real run's net tokens per iteration (its new tokens over
  its iterations) over this run's mean iteration time;
- the draft budgets: `budget_boost` scales each row's budget by its running rejection average, so rows of random
  weights, which reject every draft, would draft at the full boost, where the real model's rows, which mostly
  accept, draft near the plain budget, a few boosted at a time. With `--projected-budget rows` (the default) each
  verification notes, for each row, whether a row of the real run rejected a draft at that iteration
  (`rejected_rows`, `replayed_rejections`) instead of what it did itself: the rows' budgets then follow the real
  rows' iteration by iteration, their spread included, which matters because the draft attention lasts as long
  as its longest program (`_launch.TUNING`'s `balance`). `config` lets the rows' own rejections count.
  The record holds the mean scale its drafts ran at (`budget_scale`) and the real run's. A shape's run replays the
  first of the real run's iterations only (a 32-token shape: 31 of SmolLM2's 45), so its scale may differ from the
  real run's whole-run mean.

(936660c..3eb2212 timed them otherwise: 936660c set `budget_boost` to the real run's mean scale, which also sized the
draft attention's split hint (`SelectionState.draft_list_len`) shorter than the configured boost gives; ceee970 held
every row at the mean, which leaves out the few boosted rows that set a balanced kernel's time.)
"""

from __future__ import annotations

import contextlib

import torch

import hf_vegas
from hf_vegas.selection_state import SelectionState, draft_budget_scales

BUDGETS = ("rows", "config")
# The selection settings a projection's source must share with the shape it projects (`selection_heads` is left out:
# it matters under tensor parallelism only, and the real-model sources run on one GPU).
SELECTION_SETTINGS = ("gamma", "sparsity", "min_tokens", "budget_boost", "score", "policy")


def rejected_rows(out) -> list[str]:
    """Per row of a finished Vegas generation, one character per drafting iteration: "1" its verification rejected a
    draft, "0" it accepted them all, "-" the row had finished."""
    drafting = out.gammas > 0
    accepted, gammas = out.accepted[:, drafting.to(out.accepted.device)], out.gammas[drafting]
    marks = torch.where(accepted < 0, 2, (accepted < gammas.to(accepted.device)[None, :]).long())
    return ["".join("01-"[int(m)] for m in row) for row in marks.tolist()]


def replayed_rejections(history: list[str], batch: int, iterations: int, gamma: int) -> torch.Tensor:
    """`(batch, iterations)` accepted counts that reject where the real run's rows did: row `b` follows real row
    `b * R // batch` (R rows), iteration `k` its `k`-th drafting iteration (cycling past its end; a finished real row
    counts as accepting). 0 rejects, `gamma` accepts all."""
    rows = (history[b * len(history) // batch] for b in range(batch))
    return torch.tensor([[0 if row[k % len(row)] == "1" else gamma for k in range(iterations)] for row in rows],
                        dtype=torch.long).reshape(batch, iterations)


def budget_fields(out, config: hf_vegas.VegasConfig, history: list[str] | None = None) -> dict:
    """A finished Vegas generation's mean draft budget scale over the (row, iteration) pairs that drafted, the share of
    those whose verification rejected a draft, and each row's rejections (`rejected_rows`). `history`: the real rows'
    rejections its selections noted instead of its own (`replaying`)."""
    if not bool((out.gammas > 0).any()):
        return {}
    noted = out.accepted
    if history is not None:  # what the replay made each selection note, in the drafting iterations
        drafting = (out.gammas > 0).nonzero().flatten().tolist()
        gamma = int(out.gammas.max())
        replay = replayed_rejections(history, out.accepted.shape[0], len(drafting), gamma).to(noted.device)
        noted = noted.clone()
        noted[:, drafting] = torch.where(out.accepted[:, drafting] >= 0, replay, -1)
    scales = draft_budget_scales(noted, out.gammas, config)
    drafted = ~scales.isnan()
    if not drafted.any():
        return {}
    rejected = out.accepted < out.gammas.to(out.accepted.device)[None, :]
    return dict(budget_scale=float(scales[drafted].mean()), rejection_share=float(rejected[drafted].float().mean()),
                rejected_rows=rejected_rows(out))


def source(records: list[dict], config: hf_vegas.VegasConfig, decoding: str) -> dict | None:
    """The latest real-model record with `config`'s selection settings and `decoding` at the largest batch, or None."""
    wanted = config.to_dict()
    real = [r for r in records if r["real_weights"] and r["decoding"] == decoding and "tokens_per_iteration" in r
            and all(r["config"].get(k) == wanted[k] for k in SELECTION_SETTINGS)]
    return max(reversed(real), key=lambda r: r["batch"]) if real else None  # (max keeps the first of equals)


def history(config: hf_vegas.VegasConfig, real: dict | None, budget: str) -> tuple[list[str] | None, dict]:
    """The real rows' rejections a random-weight shape's selections should note (None: their own), and what the
    record should say about it."""
    if budget not in BUDGETS:
        raise ValueError(f"projected budget must be one of {BUDGETS}, got {budget!r}")
    if real is None or config.budget_boost <= 1:
        return None, {}
    if budget == "config":
        return None, dict(projected_budget="config")
    if not real.get("rejected_rows"):
        print(f"note: the projection's source ({real['model']} {real['batch']}x{real['prompt_tokens']}, "
              f"{real.get('commit')}) has no rejected_rows; the rows' own rejections count, and rows of random "
              "weights reject every draft (the full budget_boost)")
        return None, dict(projected_budget="config (the source has no rejected_rows)")
    return real["rejected_rows"], dict(projected_budget="rows",
                                       replayed_rejections_from=f"{real['model']} {real['batch']}x"
                                                                f"{real['prompt_tokens']} ({real.get('commit')})")


@contextlib.contextmanager
def replaying(history: list[str] | None):
    """While open, each verification's `SelectionState.note_acceptance` notes the real rows' rejections
    (`replayed_rejections`) instead of what its rows accepted, through the library's own update; a new generation
    starts the history over. None: nothing changes. Put back on exit."""
    if history is None:
        yield
        return
    note, restart = SelectionState.note_acceptance, SelectionState.restart
    length = max(len(row) for row in history)

    def note_acceptance(self, accepted, active):
        k = getattr(self, "_replayed_iterations", 0)
        self._replayed_iterations = k + 1
        if getattr(self, "_replayed", None) is None:  # on the device once: no copy, so no sync, per iteration
            rejects = replayed_rejections(history, accepted.shape[0], length, 1) == 0
            self._replayed = rejects.pin_memory().to(accepted.device, non_blocking=True) if accepted.is_cuda \
                else rejects
        note(self, torch.where(self._replayed[:, k % length], 0, self.gamma).to(accepted.dtype), active)

    def restarted(self):  # a new generation: the history from its start, built for this batch
        self._replayed_iterations, self._replayed = 0, None
        restart(self)

    SelectionState.note_acceptance, SelectionState.restart = note_acceptance, restarted
    try:
        yield
    finally:
        SelectionState.note_acceptance, SelectionState.restart = note, restart


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
    if boost <= 1 or "budget_scale" not in record:
        return 0.0
    return min(max((record["budget_scale"] - 1) / (boost - 1), 0.0), 1.0)
