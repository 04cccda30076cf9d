"""`vegas_gamma="auto"`: the draft length chosen during the generation, from its acceptance and measured step times.

Which gamma pays depends on the model, the batch, the context and the text: longer drafts yield more tokens per
iteration while their acceptance holds and cost one draft step each, and when a draft step costs nearly what a
dense step does (a small batch on a small model), drafting does not pay at all. The controller predicts, for every
arm of `AUTO_GAMMAS` and for the dense path (gamma 0), the tokens per second it would give, and moves to the best:

- acceptance: per row, a running estimate of the per-token acceptance `a` (a row that accepted n of g drafts saw
  n acceptances in n + [n < g] trials). A row then expects `1 + a + ... + a^g` tokens from an iteration of g drafts;
  the batch's expectation is the mean over its active rows;
- time: an iteration of g drafts costs `g * draft_step + rest(g)` (verification, acceptance, host), a dense one
  `dense_step`. The draft step is timed (CUDA events, or the host clock off CUDA) and shared by every arm; `rest`
  and `dense_step` are timed per arm, and an arm not yet timed borrows the nearest timed one. Until it is timed,
  the dense step is taken to cost a draft step (a dense step reads what a draft step reads and more): so the dense
  path is tried, and timed, only when it could win.

Iterations that compiled or captured a graph are not timed. The arm changes only when the prediction beats the
current arm's by `MARGIN`, at most every `DECIDE_EVERY` iterations. The step times of a pooled bucket (same batch,
capacity and config, `hf_vegas.graphs`) carry over to its next `generate` call, which starts on the arm the last
one ended on. Any arm is lossless: drafts never decide the output.
"""

from __future__ import annotations

import logging
import time
import weakref

import torch

logger = logging.getLogger("hf_vegas")

DECIDE_EVERY = 4  # iterations between decisions
MARGIN = 0.03  # the predicted gain that moves the arm
DECAY = 0.7  # weight of the past in the running acceptance and times (per observation)
PRIOR_ACCEPTANCE, PRIOR_TRIALS = 0.8, 2.0  # a row's acceptance before it has drafted
START = 6

_MEMORY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pooled graphs -> the times measured with them


def expected_tokens(acceptance: float, gamma: int) -> float:
    """Tokens one iteration of `gamma` drafts yields at per-token acceptance `acceptance`: accepted drafts + 1."""
    return sum(acceptance**i for i in range(gamma + 1))


class _Times:
    """Running step times in seconds: the draft step, the rest of a drafting iteration per gamma, the dense step."""

    def __init__(self):
        self.draft_step: float | None = None
        self.rest: dict[int, float] = {}
        self.dense: float | None = None
        self.last_gamma: int | None = None

    @staticmethod
    def _mix(old: float | None, new: float) -> float:
        return new if old is None else DECAY * old + (1 - DECAY) * new


class GammaController:
    """Chooses each iteration's gamma among `gammas` and 0 (see the module doc) for a batch of `batch` rows."""

    def __init__(self, gammas: tuple[int, ...], batch: int, device: torch.device, pool_key=None):
        self.gammas = tuple(sorted(gammas))
        self.device = device
        self.times = _MEMORY.setdefault(pool_key, _Times()) if pool_key is not None else _Times()
        start = self.times.last_gamma
        self.gamma = start if start is not None else min(self.gammas, key=lambda g: abs(g - START))
        self.successes = [PRIOR_ACCEPTANCE * PRIOR_TRIALS] * batch
        self.trials = [PRIOR_TRIALS] * batch
        self.since_decision = 0
        self.said_dense = False
        self._events = device.type == "cuda"
        self._draft_start = self._draft_end = None
        self._last_sync: float | None = None

    # -- measuring -------------------------------------------------------------------------------------------------
    def draft_starts(self) -> None:
        self._draft_start = self._mark()

    def draft_ends(self) -> None:
        self._draft_end = self._mark()

    def _mark(self):
        if self._events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _draft_seconds(self) -> float:
        if self._events:
            return self._draft_start.elapsed_time(self._draft_end) / 1000  # both done: the iteration has synced
        return self._draft_end - self._draft_start

    def observe(self, accepted: list[int | None], timed: bool) -> None:
        """After the iteration's host synchronisation: `accepted[b]` drafts row `b` accepted (None: the row was
        inactive or its chunk was cut by a stop, which says nothing of its acceptance); `timed` is False when the
        iteration compiled or captured a graph."""
        now = time.perf_counter()
        gamma, times = self.gamma, self.times
        if timed and self._last_sync is not None:
            seconds = now - self._last_sync
            if gamma == 0:
                times.dense = times._mix(times.dense, seconds)
            else:
                draft = self._draft_seconds()
                times.draft_step = times._mix(times.draft_step, draft / gamma)
                times.rest[gamma] = times._mix(times.rest.get(gamma), max(seconds - draft, 0.0))
        self._last_sync = now
        if gamma > 0:
            for row, n in enumerate(accepted):
                if n is not None:
                    self.successes[row] = DECAY * self.successes[row] + n
                    self.trials[row] = DECAY * self.trials[row] + n + (n < gamma)
        self.since_decision += 1
        if self.since_decision >= DECIDE_EVERY:
            self.since_decision = 0
            self._decide([n is not None for n in accepted])
        times.last_gamma = self.gamma

    # -- deciding --------------------------------------------------------------------------------------------------
    def rates(self, rows: list[bool] | None = None) -> dict[int, float] | None:
        """Predicted tokens per second per row for every arm (0: dense), or None before a drafting iteration is
        timed. `rows` picks the rows whose acceptance counts (default: all)."""
        times = self.times
        if times.draft_step is None or not times.rest:
            return None
        chosen = [r for r, use in enumerate(rows) if use] if rows is not None else []
        chosen = chosen or list(range(len(self.trials)))
        acceptance = [self.successes[r] / self.trials[r] for r in chosen]
        rates = {}
        for gamma in self.gammas:
            expected = sum(expected_tokens(a, gamma) for a in acceptance) / len(acceptance)
            rates[gamma] = expected / (gamma * times.draft_step + self._rest(gamma))
        dense = times.dense if times.dense is not None else times.draft_step
        rates[0] = 1.0 / max(dense, 1e-9)
        return rates

    def _rest(self, gamma: int) -> float:
        timed = self.times.rest
        return timed[gamma] if gamma in timed else timed[min(timed, key=lambda g: (abs(g - gamma), g))]

    def _decide(self, rows: list[bool]) -> None:
        rates = self.rates(rows)
        if rates is None:
            return
        best = max(rates, key=rates.get)
        if best != self.gamma and rates[best] > (1 + MARGIN) * rates[self.gamma]:
            self.gamma = best
            if best == 0 and not self.said_dense:
                self.said_dense = True
                drafting = max((g for g in self.gammas), key=rates.get)
                logger.info("vegas_gamma='auto' decodes densely (gamma 0): drafting is predicted at %.2fx the dense "
                            "path here (best gamma %d); the output's `gammas` records each iteration's choice.",
                            rates[drafting] / rates[0], drafting)
