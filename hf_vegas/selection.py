"""Draft-selection policies: which prefix slots the next draft reads. One class per policy.

After a prefill or a verification, every sparse layer keeps `sel_count[layer, b]` of the candidate slots
`[cand_start[layer, b], sel_end[b])` of row `b` (the whole prefix, or a sliding window's last slots; the budget is the
same for every policy, `VegasConfig.budget`); the next draft attends to those plus every slot from `sel_end[b]` on.
A policy says how that choice is made, by answering what the cache and the attention function ask:

- `score_rows(mode, num_tokens, pending_row)`: the query rows of a prefill/verify forward whose attention scores it
  ranks the candidates by (head-averaged logits or softmax weights, `VegasConfig.score`, then the mean over the
  rows); None when it selects from positions alone (`select_by_position` is then called instead);
- `deferred(mode)`: whether it keeps each scored row's scores until acceptance says which row to use (the loop then
  calls `attention.select_from_rows` with the kept row of each sequence);
- `no_graph_reason`: why its steps cannot be captured as CUDA graphs, or None;
- `selects_while_drafting`: whether each draft step chooses its own slots instead (the oracle): prefill and
  verification then only set the candidates and the budget.

A new policy is a new class in `POLICIES`; `VegasConfig(policy=...)` accepts its name.
"""

from __future__ import annotations

import torch
from hf_vegas_kernels import naive


class Collect2Query:
    """Vegas (paper §3.2): the first draft row (the pending token's) and the bonus row of the verification."""

    name = "vegas"
    no_graph_reason = None
    selects_while_drafting = False

    def score_rows(self, mode: str, num_tokens: int, pending_row: int) -> list[int] | None:
        return [num_tokens - 1] if mode == "prefill" else sorted({pending_row, num_tokens - 1})

    def deferred(self, mode: str) -> bool:
        return False


class LastToken:
    """SpecExtend-style baseline: the verification row of each sequence's last accepted token, known only after
    acceptance, so every row from the pending token's on is scored and the choice waits."""

    name = "last_token"
    no_graph_reason = "policy 'last_token' selects after acceptance, outside the captured verify forward"
    selects_while_drafting = False

    def score_rows(self, mode: str, num_tokens: int, pending_row: int) -> list[int] | None:
        return [num_tokens - 1] if mode == "prefill" else list(range(pending_row, num_tokens))

    def deferred(self, mode: str) -> bool:
        return mode == "verify"


class Streaming:
    """StreamingLLM baseline: a few attention-sink slots at the start plus the most recent candidates."""

    name = "streaming"
    no_graph_reason = None
    selects_while_drafting = False
    sink_tokens = 4

    def score_rows(self, mode: str, num_tokens: int, pending_row: int) -> list[int] | None:
        return None

    def deferred(self, mode: str) -> bool:
        return False

    def select_by_position(self, sel_count: torch.Tensor, sel_end: torch.Tensor, k_max: int,
                           windowed: bool = False) -> torch.Tensor:
        """`windowed`: a sliding window's candidates hold no attention sink (its queries no longer see the first
        slots, and the window's own first slots leave it as the drafts advance), so all are the most recent."""
        return naive.streaming_select(sel_count, sel_end, k_max, 0 if windowed else self.sink_tokens)


class Oracle:
    """The upper bound every policy is judged against (an acceptance study, not a speed-up): at each draft step,
    every sparse layer reads the budget's worth of candidates its own draft query attends to most (softmax
    weights averaged over query heads, computed exactly over the whole prefix, so the draft reads all of it to
    choose). No policy that chooses before the draft knows those queries."""

    name = "oracle"
    no_graph_reason = "policy 'oracle' scores the whole prefix at every draft step (an acceptance study, run eagerly)"
    selects_while_drafting = True

    def score_rows(self, mode: str, num_tokens: int, pending_row: int) -> list[int] | None:
        return None

    def deferred(self, mode: str) -> bool:
        return False


POLICIES = {policy.name: policy for policy in (Collect2Query(), Streaming(), LastToken(), Oracle())}


def policy(name: str):
    """The policy called `name` (one of `POLICIES`)."""
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {list(POLICIES)}, got {name!r}")
    return POLICIES[name]
