"""`SelectionState`: which prefix slots the next draft reads, per (sparse layer, row), and its budget.

A prefill or verification forward chooses them (`prepare` at its layer 0, then the attention function of each sparse
layer, by the policy of `hf_vegas.selection`): row `b` keeps `sel_idx[layer, b, :sel_count[layer, b]]` of the
candidate slots `[cand_start[layer, b], sel_end[b])`, and the next draft attends to those plus every slot from
`sel_end[b]` on. The candidates are the whole prefix for a full-attention layer, and for a sliding-window layer that
drafts sparsely (`hf_vegas.cache.sparse_layers`) the `window - 1` slots before `sel_end`: what the window of the
next draft's first query (at slot `sel_end`) holds of the prefix. Its drafts also keep to their window.

Static state. The buffers are sized once for the largest budget any row can get (`VegasConfig.max_budget`) and only
written in place, as CUDA graphs require (see `hf_vegas.step_plan`).
"""

from __future__ import annotations

import torch

from . import selection
from .config import VegasConfig
from .step_plan import StepPlan


class SelectionState:
    """The selection of a batch of `batch_size` rows of `capacity` slots, for the sparse layers of `num_layers`:
    `windows` maps each to the window its drafts stay inside (None: full attention). Other layers select nothing.
    `own_layers`: the layers on this state's device, for a model on several devices (`hf_vegas.placement`); the
    state selects for those of the sparse layers (budgets and candidates are still computed for every layer)."""

    def __init__(self, config: VegasConfig, num_layers: int, windows: dict[int, int | None], batch_size: int,
                 capacity: int, device: torch.device, own_layers: set[int] | None = None):
        self.config = config
        self.policy = selection.policy(config.policy)
        self.device = device
        long = dict(dtype=torch.long, device=device)
        # Largest budget any row can need (boosted): the selection buffers are sized once, so no step reallocates.
        self.max_selected = config.max_budget(capacity)
        self.capacity = capacity
        # A draft reads the selection plus the tail since `sel_end`: at most gamma accepted tokens and gamma drafts
        # (+1 for prefill's pending token). Kernels size their splits with it; it is a hint, never a cut.
        tail = 2 * config.max_gamma + 1
        self.draft_list_len = self.max_selected + tail
        # With a boost, no split of a draft's attention takes more than an unboosted list, so the boosted rows' longer
        # lists run in more programs rather than longer ones (the kernel lasts as long as its longest program).
        self.draft_split_len = config.budget(capacity) + tail if config.budget_boost > 1 else None
        self.sel_idx = torch.zeros(num_layers, batch_size, self.max_selected, **long)
        # Per layer: how far back from `sel_end` its candidates reach (a window's `window - 1` slots, or the whole
        # buffer), and its rows' budgets and first candidates (a window's budget counts its candidates only).
        self.windows = {i: w for i, w in windows.items() if own_layers is None or i in own_layers}
        self.span = torch.tensor([(windows.get(i) or capacity + 2) - 1 for i in range(num_layers)], **long)
        self.sel_count = torch.zeros(num_layers, batch_size, **long)
        self.cand_start = torch.zeros(num_layers, batch_size, **long)
        self.sel_end = torch.zeros(batch_size, **long)
        self.has_selection = False
        # The draft length of the current iteration (fixed, or moved by `gamma="auto"` through `StepRunner.set_gamma`).
        self.gamma = config.max_gamma
        # Per row, a running average of "the last verification rejected a draft", which scales its budget.
        self.rejection = torch.zeros(batch_size, dtype=torch.float32, device=device)
        # The query rows whose scores rank the candidates in this forward (None: not selecting, or by position).
        self.score_rows: torch.Tensor | None = None
        self._score_rows_by_shape: dict[tuple[str, int], torch.Tensor | None] = {}  # built outside any capture
        self._followed_rows: dict[int, torch.Tensor] = {}  # a copy's (`follow`): the main state's, by identity
        # A deferring policy (`last_token`): head-averaged scores of every scored verify row, until acceptance.
        self.row_scores: dict[int, torch.Tensor] = {}
        self._layer_scores: torch.Tensor | None = None
        self.sparse_layers = sorted(self.windows)
        self.sparse_layer_index = torch.tensor(self.sparse_layers, **long)
        # Sparse layers whose scores wait in `layer_scores`: all select together at the forward's last sparse layer.
        self.scored_layers: list[int] = []
        # Layers that already chose their selection in this forward (a layer may attend twice: DiffLlama).
        self.selected_layers: set[int] = set()
        # Whether the current forward chooses the next draft's slots (`prepare`).
        self.choosing = False
        # `selection_heads="all"` under tensor parallelism: the group whose ranks average their scores (`pool`).
        self.group = None
        self._group_size = 1

    def selecting(self, mode: str) -> bool:
        """Whether a forward of `mode` chooses the next draft's slots (prefill and verify, when drafting at all)."""
        return mode in ("prefill", "verify") and self.config.gamma != 0

    def prepare(self, plan: StepPlan, num_tokens: int) -> None:
        """At layer 0, after `plan.lay_out`: the candidates, budget and scored rows of this forward, if it selects.
        Verification rates the prefix plus the pending token's slot (the slots every verify row sees); prefill rates
        the whole prompt, from its last row."""
        self.scored_layers = []
        self.selected_layers = set()
        self.score_rows = None
        self.choosing = self.selecting(plan.mode) and plan.selects
        if not self.choosing:
            return
        pending_row = max(num_tokens - self.gamma - 1, 0)
        if plan.mode == "prefill":
            self.sel_end.copy_(plan.lengths)
        else:
            self.sel_end.copy_(plan.write_start + pending_row + 1)
        candidates = torch.minimum(self.sel_end[None, :], self.span[:, None])  # (L, B): a window's slots at most
        self.sel_count.copy_(budget_tensor(candidates, self.config, self.rejection))
        self.cand_start.copy_(self.sel_end[None, :] - candidates)
        key = (plan.mode, num_tokens)
        if key not in self._score_rows_by_shape:  # a host list made a device tensor once per shape
            rows = self.policy.score_rows(plan.mode, num_tokens, pending_row)
            self._score_rows_by_shape[key] = None if rows is None else torch.tensor(rows, device=self.device)
        self.score_rows = self._score_rows_by_shape[key]

    def follow(self, main: SelectionState) -> None:
        """Take what `main.prepare` set for this forward, copied to this state's device (the selection of the layers
        on another device, refreshed at the first of them a forward reaches)."""
        self.gamma = main.gamma
        self.scored_layers = []
        self.selected_layers = set()
        self.choosing = main.choosing
        rows = main.score_rows  # one tensor per forward shape, kept by `main`: copied once per shape
        if rows is not None and id(rows) not in self._followed_rows:
            self._followed_rows[id(rows)] = rows.to(self.device, copy=True)
        self.score_rows = None if rows is None else self._followed_rows[id(rows)]
        if self.choosing:
            self.sel_end.copy_(main.sel_end)
            self.sel_count.copy_(main.sel_count)
            self.cand_start.copy_(main.cand_start)

    def pool_over(self, group) -> None:
        """Average every selection's scores over the ranks of `group` from now on (None: each rank its own)."""
        self.group = group
        self._group_size = 1 if group is None else torch.distributed.get_world_size(group)

    def pool(self, scores: torch.Tensor) -> torch.Tensor:
        """`scores` (head means over this rank's query heads) averaged in place over the ranks of `group`: the mean
        over every head, as each rank holds as many. Candidates are the same on every rank, so a slot outside them is
        -inf on all. Returns `scores`."""
        if self.group is not None:
            torch.distributed.all_reduce(scores, group=self.group)
            scores.div_(self._group_size)
        return scores

    def select(self, ops, scores: torch.Tensor, layer: int | None = None, layers: torch.Tensor | None = None) -> None:
        """Keep each row's budget of top-scored candidates as the next draft's slots: `scores` `(B, slots)` for
        `layer`, or `(L, B, slots)` for the `layers` listed, through `ops.select_topk`.

        The scores are cut to the slots that can be candidates: the cache's last slot is the pads' scratch slot,
        never one. A selection over a power-of-two capacity then keeps each row in one register block (SmolLM2 at
        64 x 7.5K on an H100: verification 7.36 -> 7.00 ms, README "Fewer, overlapped launches")."""
        scores = scores[..., :self.capacity]
        if layer is not None:
            ops.select_topk(scores, self.sel_count[layer], self.sel_end, self.buffer()[layer])
        else:
            ops.select_topk(scores, self.sel_count, self.sel_end, self.buffer(), layers=layers)

    def store(self, layer_idx: int, indices: torch.Tensor) -> None:
        self.sel_idx[layer_idx].copy_(indices)
        self.has_selection = True

    def buffer(self) -> torch.Tensor:
        """`sel_idx` `(L, B, max_selected)`, for ops that write the selection in place."""
        self.has_selection = True
        return self.sel_idx

    def layer_scores(self, num_slots: int) -> torch.Tensor:
        """`(L, B, num_slots)` fp32 scratch where a prefill or verification leaves each sparse layer's scores."""
        if self._layer_scores is None:
            layers, batch, _ = self.sel_idx.shape
            self._layer_scores = torch.empty(layers, batch, num_slots, dtype=torch.float32, device=self.device)
        return self._layer_scores

    def note_acceptance(self, accepted: torch.Tensor, active: torch.Tensor) -> None:
        """After a verification: fold whether each active row rejected a draft into its `rejection` average (the
        budget boost reads it). A no-op without a boost."""
        if self.config.budget_boost > 1:
            self.rejection.copy_(updated_rejection(self.rejection, accepted, self.gamma, active))

    def restart(self) -> None:
        """No selection, no history, for a new generation over the same buffers."""
        self.has_selection = False
        self.rejection.zero_()
        self.row_scores.clear()
        self.scored_layers = []


def updated_rejection(rejection: torch.Tensor, accepted: torch.Tensor, gamma: int, active: torch.Tensor
                      ) -> torch.Tensor:
    """Each row's running average of "the verification rejected a draft" after one more verification (half-life
    one iteration); inactive rows keep theirs."""
    rejected = (accepted < gamma).to(rejection.dtype)
    return torch.where(active, 0.5 * (rejection + rejected), rejection)


def draft_budget_scales(accepted: torch.Tensor, gammas: torch.Tensor, config: VegasConfig) -> torch.Tensor:
    """`(B, iterations)`: the boost `1 + (budget_boost - 1) * r` each row's budget was scaled by (before the budget's
    rounding up and its cap at the candidates) in the drafts of each iteration of a finished generation (its output's
    `accepted` and `gammas`), NaN where the row drafted nothing (finished, or a dense step of `gamma="auto"`, which
    neither selects nor notes an acceptance). Replays the running average `note_acceptance` keeps: an iteration's
    drafts read the selection of the drafting iteration before it, made before that iteration's acceptance was
    noted, so the first two drafting iterations read selections made at rejection 0."""
    rejection = torch.zeros(accepted.shape[0], dtype=torch.float32, device=accepted.device)  # (the library's dtype)
    scales = torch.full(accepted.shape, float("nan"), dtype=torch.float64, device=accepted.device)
    used = rejection.clone()  # the average the current iteration's selection was made with
    for k, gamma in enumerate(gammas.tolist()):  # (one copy to the host, not one per iteration)
        active = accepted[:, k] >= 0
        if gamma > 0:
            scales[:, k] = torch.where(active, config.boost(used.double()), float("nan"))
            used = rejection.clone()  # the next iteration's selection is made before this one's acceptance is noted
            rejection = updated_rejection(rejection, accepted[:, k], gamma, active)
    return scales


def budget_tensor(candidates: torch.Tensor, config: VegasConfig, rejection: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Per-row budget `clamp(ceil(sparsity * n), min_tokens, n)`; float64 so it equals `VegasConfig.budget`. With a
    `budget_boost` and each row's `rejection` average, scaled by `1 + (boost - 1) * rejection` (at most `n`)."""
    n = candidates.to(torch.float64)
    budget = torch.ceil(config.sparsity * n).clamp_min(config.min_tokens)
    if rejection is not None and config.budget_boost > 1:
        budget = torch.ceil(budget * config.boost(rejection.to(torch.float64)))
    return torch.minimum(budget, n).to(torch.long)
