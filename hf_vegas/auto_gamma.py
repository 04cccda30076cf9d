"""`vegas_gamma="auto"`: the draft length chosen during the generation, from its acceptance and measured step times.

Which gamma pays depends on the model, the batch, the context and the text: longer drafts yield more tokens per
iteration while their acceptance holds and cost one draft step each, and when a draft step costs nearly what a
dense step does (a small batch on a small model), drafting does not pay at all. The controller predicts, for every
arm of `AUTO_GAMMAS` and for the dense path (gamma 0), the tokens per second it would give, and moves to the best:

- acceptance: per row and per draft position, a running estimate of the chance that the draft at that position is
  accepted once those before it were (a row that accepted n of g drafts was tried at positions 1..min(n + 1, g)
  and accepted at 1..n). Acceptance usually falls with depth, as the selection ages: a single per-token rate would
  make short arms over-predict long ones. A position never tried borrows the estimate of the one before it. A row
  then expects `1 + a1 + a1 a2 + ... + a1...ag` tokens from an iteration of g drafts; the batch's expectation is
  the mean over its active rows;
- time: an iteration of g drafts costs `g * draft_step + rest` (verification, acceptance, host), a dense one
  `dense_step`. The draft step is timed (CUDA events on the model's stream, or the host clock off CUDA) and shared
  by every arm, and so is `rest`: the current arm's (it barely depends on g, and another arm's goes stale while it
  does not run); before the current arm is timed, the nearest timed one's.
  Until it is timed, the dense step is taken to cost a draft step (a dense step reads what a draft step reads and
  more): so the dense path is tried, and timed, only when it could win.

Not timed: iterations that compiled or captured a graph, and the first iteration of each arm in a generation (its
kernels may compile then, graphs or not). The arm changes when another one's prediction beats it by `MARGIN` at two
decisions in a row (`DECIDE_EVERY` iterations apart). An arm whose steps were never timed in this bucket may need its
graphs prepared (warm-up, compilation, capture): it qualifies only when the time its predicted rate saves over the
tokens the rows still have to generate exceeds what preparing an arm costs (a running average of the untimed
iterations each preparation took, the fresh bucket's first one, with its eager warm-up, included; nothing holds a
move back before any was measured). At a few hundred new tokens a capture can cost more than a slightly better gamma
saves. The step times of a pooled bucket (same batch, capacity and config, `hf_vegas.graphs`) and decoding (greedy
or sampling, the same processors) carry over to its next `generate` call, which starts on the arm the last one ended
on. Any arm is lossless: drafts never decide the output.
"""

from __future__ import annotations

import logging
import time
import weakref

import torch

logger = logging.getLogger("hf_vegas")

DECIDE_EVERY = 2  # iterations between decisions (a move takes two: at least 4 iterations)
MARGIN = 0.03  # the predicted gain that moves the arm (at two decisions in a row)
DECAY = 0.7  # weight of the past in the running step times (per timed iteration)
ACCEPTANCE_DECAY = 0.9  # weight of the past in a row's acceptance counts (per verification: ~10 remembered)
PRIOR_ACCEPTANCE, PRIOR_TRIALS = 0.8, 1.0  # the first position's acceptance before a row has drafted
START = 6  # the arm a generation without pooled times starts on (the nearest of AUTO_GAMMAS and 0)

# pooled graphs -> {decoding key: the times measured with them}
_MEMORY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def expected_tokens(acceptance: list[float], gamma: int) -> float:
    """Tokens one iteration of `gamma` drafts yields when the draft at position i (1-based) is accepted with chance
    `acceptance[i - 1]` once those before it were: accepted drafts + 1 (positions beyond the list reuse its last)."""
    total, reach = 1.0, 1.0
    for i in range(gamma):
        reach *= acceptance[min(i, len(acceptance) - 1)]
        total += reach
    return total


class _Times:
    """Running step times in seconds: the draft step, the rest of a drafting iteration per gamma, the dense step."""

    def __init__(self):
        self.draft_step: float | None = None
        self.rest: dict[int, float] = {}
        self.dense: float | None = None
        self.last_gamma: int | None = None
        self.prepare: float | None = None  # seconds of the untimed iterations that prepared an arm's graphs

    @staticmethod
    def mix(old: float | None, new: float) -> float:
        return new if old is None else DECAY * old + (1 - DECAY) * new


class GammaController:
    """Chooses each iteration's gamma among `gammas` and 0 (see the module doc) for a batch of `batch` rows.

    `pool_key` (the pooled graphs, or None) and `decoding` (hashable: what the graphs' keys say of the decoding) pick
    the step times that earlier calls measured."""

    def __init__(self, gammas: tuple[int, ...], batch: int, device: torch.device, pool_key=None, decoding=None):
        self.gammas = tuple(sorted(gammas))
        self.device = device
        memory = _MEMORY.setdefault(pool_key, {}) if pool_key is not None else {}
        self.times = memory.setdefault(decoding, _Times())
        start = self.times.last_gamma
        self.gamma = start if start is not None else min((*self.gammas, 0), key=lambda g: abs(g - START))
        depth = max(self.gammas)
        self.successes = [[0.0] * depth for _ in range(batch)]
        self.trials = [[0.0] * depth for _ in range(batch)]
        self.since_decision = 0
        self.challenger: int | None = None  # the arm that won the last decision, if not the current one
        self.visited: set[int] = set()  # arms run in this generation (their first iteration is not timed)
        self.said_dense = False
        self._events = device.type == "cuda"
        self._last_sync: float | None = None
        self._preparing = 0.0  # seconds of the untimed (preparing) iterations since the last timed one

    # -- measuring -------------------------------------------------------------------------------------------------
    def start_clock(self) -> None:
        """Before the first iteration, after a synchronisation (the prefill's tokens were read on the host): that
        iteration's time counts, so a fresh bucket's first preparation (its eager warm-up) is measured whole."""
        self._last_sync = time.perf_counter()

    def mark(self):
        """A point in the stream's work (a CUDA event recorded now) or, off CUDA, the host clock: a draft's start and
        end marks go to `observe` with the iteration that verifies that draft."""
        if self._events:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def _seconds(self, marks) -> float:
        start, end = marks
        if self._events:
            return start.elapsed_time(end) / 1000  # both done: the iteration that verified the draft has synced
        return end - start

    def observe(self, accepted: list[int | None], timed: bool, remaining: float | None = None,
                gamma: int | None = None, draft=None, queued=None) -> None:
        """After the iteration's host synchronisation: `accepted[b]` drafts row `b` accepted (None: the row was
        inactive or its chunk was cut by a stop, which says nothing of its acceptance); `timed` is False when the
        iteration compiled or captured a graph; `remaining`: tokens an active row still generates, on average (None:
        unknown, which never holds a move back). `gamma`: the arm the iteration ran (default: the current one; a
        draft queued ahead runs the arm chosen when it was queued, one decision behind); `draft`: the `mark`s around
        its draft (None for a dense step); `queued`: those of the draft this iteration queued for the next one. On
        the GPU that draft runs after this synchronisation, in the next iteration's time; on the host clock it ran
        before it, so its time moves to the next iteration, which it belongs to."""
        now = time.perf_counter()
        gamma, times = self.gamma if gamma is None else gamma, self.times
        moved = self._seconds(queued) if queued is not None and not self._events else 0.0
        seconds = None if self._last_sync is None else now - self._last_sync - moved
        if not timed and seconds is not None:
            self._preparing += seconds
        elif timed and self._preparing:
            times.prepare = times.mix(times.prepare, self._preparing)
            self._preparing = 0.0
        if timed and gamma in self.visited and seconds is not None:
            if gamma == 0:
                times.dense = times.mix(times.dense, seconds)
            elif draft is not None:
                draft = self._seconds(draft)
                times.draft_step = times.mix(times.draft_step, draft / gamma)
                times.rest[gamma] = times.mix(times.rest.get(gamma), max(seconds - draft, 0.0))
        self.visited.add(gamma)
        self._last_sync = now - moved
        if gamma > 0:
            for row, n in enumerate(accepted):
                if n is not None:
                    self._count(row, n, gamma)
        self.since_decision += 1
        if self.since_decision >= DECIDE_EVERY:
            self.since_decision = 0
            self._decide([n is not None for n in accepted], remaining)
        times.last_gamma = self.gamma

    def _count(self, row: int, accepted: int, gamma: int) -> None:
        successes, trials = self.successes[row], self.trials[row]
        for position in range(min(accepted + 1, gamma)):  # tried there; accepted at the first `accepted`
            trials[position] = ACCEPTANCE_DECAY * trials[position] + 1
            successes[position] = ACCEPTANCE_DECAY * successes[position] + (position < accepted)

    def acceptance(self, row: int) -> list[float]:
        """Row `row`'s estimated acceptance per draft position (each shrunk towards the position before it)."""
        estimates, prior = [], PRIOR_ACCEPTANCE
        for successes, trials in zip(self.successes[row], self.trials[row]):
            prior = (successes + prior * PRIOR_TRIALS) / (trials + PRIOR_TRIALS)
            estimates.append(prior)
        return estimates

    # -- deciding --------------------------------------------------------------------------------------------------
    def rates(self, rows: list[bool] | None = None) -> dict[int, float] | None:
        """Predicted tokens per second per row for every arm (0: dense), or None before a drafting iteration is
        timed. `rows` picks the rows whose acceptance counts (default: all)."""
        times = self.times
        if times.draft_step is None or not times.rest:
            return None
        chosen = [r for r, use in enumerate(rows) if use] if rows is not None else []
        acceptance = [self.acceptance(r) for r in (chosen or range(len(self.trials)))]
        rates = {}
        for gamma in self.gammas:
            expected = sum(expected_tokens(a, gamma) for a in acceptance) / len(acceptance)
            rates[gamma] = expected / (gamma * times.draft_step + self._rest(gamma))
        dense = times.dense if times.dense is not None else times.draft_step
        rates[0] = 1.0 / max(dense, 1e-9)
        return rates

    def _rest(self, gamma: int) -> float:
        """The rest of an iteration (verification, acceptance, host) of any arm: the current arm's, timed last. It
        barely depends on gamma (a verification of gamma + 1 tokens reads what one of 7 does), and an arm's own time
        goes stale while another runs: at batch 1 a stale, slower time kept gamma 6 from being tried again."""
        timed = self.times.rest
        if self.gamma in timed:
            return timed[self.gamma]
        return timed[gamma] if gamma in timed else timed[min(timed, key=lambda g: (abs(g - gamma), g))]

    def _prepared(self, gamma: int) -> bool:
        """Whether `gamma`'s steps ran timed in this bucket and decoding (so their graphs, if any, exist)."""
        return self.times.dense is not None if gamma == 0 else gamma in self.times.rest

    def _worth_preparing(self, gamma: int, rates: dict[int, float], remaining: float | None) -> bool:
        """Whether moving to `gamma` pays for preparing its steps over the tokens the rows still generate."""
        if gamma == self.gamma or self._prepared(gamma) or remaining is None or self.times.prepare is None:
            return True
        saved = remaining * (1 / rates[self.gamma] - 1 / rates[gamma])  # seconds, at the predicted rates
        return saved > self.times.prepare

    def _decide(self, rows: list[bool], remaining: float | None = None) -> None:
        rates = self.rates(rows)
        if rates is None:
            return
        best = max((g for g in rates if self._worth_preparing(g, rates, remaining)), key=rates.get)
        if best == self.gamma or rates[best] <= (1 + MARGIN) * rates[self.gamma]:
            self.challenger = None
            return
        if self.challenger != best:  # a first win: wait for the next decision to confirm it
            self.challenger = best
            return
        self.gamma, self.challenger = best, None
        if best == 0 and not self.said_dense:
            self.said_dense = True
            drafting = max(self.gammas, key=rates.get)
            logger.info("vegas_gamma='auto' decodes densely (gamma 0): drafting is predicted at %.2fx the dense "
                        "path here (best gamma %d); the output's `gammas` records each iteration's choice.",
                        rates[drafting] / rates[0], drafting)
