"""One Vegas generation's loop: the rows' state on the device and on the host, and the iterations that advance it.

    prefill -> first token; repeat: draft gamma tokens -> verify them -> accept per row -> stop inside the chunk ->
    roll the cache back to what was kept

`hf_vegas.decoding.generate` checks the call, builds the cache and the step graphs, and runs a `DecodeLoop`. Each row
keeps its own history length, cache length and pending token (the last token, whose KV is not cached yet). The row
state lives on the device, with a host copy refreshed by the one host synchronisation of each iteration (it reads how
many tokens each row kept); everything else is queued without waiting, and where it can the next iteration's draft
is queued before that synchronisation returns, so the GPU runs the steps back to back.
"""

from __future__ import annotations

import torch

from . import prompt_cache
from ._compat import internals as compat
from .attention import select_from_rows
from .auto_gamma import GammaController
from .config import AUTO_GAMMAS
from .output import StepRecorder
from .runner import StepRunner
from .sampling import accept_greedy, accept_sampling, choose
from .stopping import ChunkStopper


def _rng_state(device: torch.device) -> torch.Tensor:
    """The default generator's state on `device` (host side: no synchronisation)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class DecodeLoop:
    """Per-row state of one Vegas generation and the steps that advance it."""

    def __init__(self, model, cache, step_graphs, input_ids, left_pad, max_new, processors, stopping_criteria,
                 gen_config, streamer, recorder: StepRecorder):
        self.cache, self.streamer, self.recorder = cache, streamer, recorder
        config = cache.vegas_config
        self.do_sample = bool(gen_config.do_sample)
        self.prefill_chunk_size = getattr(gen_config, "prefill_chunk_size", None)
        self.runner = StepRunner(model, cache, processors, self.do_sample, graphs=step_graphs)
        # `gamma="auto"`: a controller picks each iteration's gamma (`hf_vegas.auto_gamma`); `gammas` records them.
        # Its times carry over to the next call of the same bucket and decoding (the graphs' keys say which).
        decoding = (self.do_sample, self.runner.pipeline.capture_key, recorder.want_scores)
        self.auto = (GammaController(AUTO_GAMMAS, input_ids.shape[0], input_ids.device, pool_key=step_graphs,
                                     decoding=decoding) if config.gamma == "auto" else None)
        self.gammas: list[int] = []
        self.pipeline = self.runner.pipeline
        self.stopper = ChunkStopper(stopping_criteria, compat.eos_token_tensor(gen_config), input_ids.device)
        self.pad_id = compat.pad_token_tensor(gen_config)
        self.input_ids, self.left_pad, self.max_new = input_ids, left_pad, max_new
        batch, width = input_ids.shape
        device = input_ids.device
        # Every row's history in vanilla's layout (left pads, prompt, generated) plus room for one chunk.
        self.tokens = torch.zeros(batch, width + max_new + config.max_gamma + 1, dtype=input_ids.dtype,
                                  device=device)
        self.tokens[:, :width] = input_ids
        # Row state on the device (what the steps read) and its host copy (what the loop's decisions read), both
        # advanced by the same `keep` counts in `_commit`.
        self.history_t = torch.full((batch,), width, dtype=torch.long, device=device)
        self.generated_t = torch.zeros(batch, dtype=torch.long, device=device)
        self.finished_t = torch.zeros(batch, dtype=torch.bool, device=device)
        self.history = [width] * batch
        self.generated = [0] * batch
        self.finished = [False] * batch
        # Without EOS, vanilla stops the whole batch at the step where its last row first stops, and every row runs
        # to that length. Rows here advance by chunks and may run past it: each row's count at its first stop is
        # kept so the batch's length is vanilla's, not that of a row that ran ahead.
        self.first_stop: list[int | None] = [None] * batch
        self.target_len: int | None = None  # set when every row has stopped but finished rows are not padded
        self.ahead = None  # the next iteration's (drafts, draft scores, marks) when queued early (`_draft_ahead`)
        self.draft_marks = None  # `gamma="auto"`: the marks around the draft the iteration verifies
        self.rng_before_ahead = None  # the generator's state before that draft's draws (sampling)
        self._pinned: torch.Tensor | None = None  # host buffer of the kept counts and stops (CUDA)

    def run(self, inputs_embeds=None, prefix=None):
        """Prefill (from `inputs_embeds` instead of `input_ids` if given, after the positions a user's `prefix` cache
        holds), then iterate until every row has stopped. Returns `(sequences, accepted per iteration)`."""
        prompt = self.input_ids if inputs_embeds is None else inputs_embeds
        cached = 0
        if prefix is not None:
            cached = prefix.get_seq_length()
            prompt_cache.load(self.cache, prefix, self.left_pad)
        remaining_pad = (self.left_pad - cached).clamp_min(0)
        logits = self.runner.prefill(prompt[:, cached:], left_pad=remaining_pad, chunk_size=self.prefill_chunk_size)
        scores = self.pipeline(self.tokens, self.history, logits[:, -1])
        first = choose(scores, self.do_sample)
        self.pending = first
        everyone = torch.ones(first.shape[0], dtype=torch.bool, device=first.device)
        budget = self.max_new - self.generated_t
        keep, stopped = ChunkStopper.vectorised(first[:, None], torch.ones_like(first), budget, self.stopper.eos)
        keep, stopped = self._commit(first[:, None], keep, stopped, everyone)
        self._follow_on_host(first[:, None], self._to_host(keep, stopped))
        if self.recorder.active:
            self.recorder.add(scores[:, None], logits[:, -1:], self.kept)
        accepted = []
        if self.auto is not None:
            self.auto.start_clock()
        while any(active_host := self._active()):
            active = self._active_on_device()
            self.cache.plan.row_active.copy_(active)
            if self.auto is None:
                accepted.append(torch.where(active, self._iterate(active), -1))
                continue
            if self.ahead is None:  # else the draft queued ahead fixed this iteration's gamma
                self.runner.set_gamma(self.auto.gamma)
            prepared, ran = self._preparations(), self.runner.gamma
            accepted.append(torch.where(active, self._iterate(active), -1))
            self.auto.observe(self._observed(active_host), timed=self._preparations() == prepared,
                              remaining=self._remaining(self._active()), gamma=ran, draft=self.draft_marks,
                              queued=None if self.ahead is None else self.ahead[2])
        if self.ahead is not None and self.rng_before_ahead is not None:
            # A draft queued for a batch that then stopped is wasted; its draws must not move the generator, or the
            # user's next call would sample other tokens than without it.
            _set_rng_state(first.device, self.rng_before_ahead)
        stats = torch.stack(accepted, dim=1) if accepted else first.new_zeros(first.shape[0], 0)
        return self._sequences(self.input_ids.shape[1]), stats

    def _remaining(self, active: list[bool]) -> float | None:
        """Tokens an active row still generates at most, on average (None when no row is active)."""
        limit = self._limit()
        left = [limit - generated for live, generated in zip(active, self.generated) if live]
        return sum(left) / len(left) if left else None

    def _preparations(self) -> int:
        return 0 if self.runner.graphs is None else self.runner.graphs.preparations

    def _observed(self, active: list[bool]) -> list[int | None]:
        """Drafts each row accepted in the last iteration, from its kept count (None where a stop or the length
        budget may have cut the chunk, or the row was inactive)."""
        limit = self._limit()
        return [kept - 1 if live and not stopped and generated < limit else None
                for live, kept, stopped, generated in zip(active, self.kept, self.stopped_now, self.generated)]

    def _limit(self) -> int:
        """Tokens a row generates before it stops decoding (without EOS, finished rows go on to the longest row)."""
        if self.target_len is None and not self.stopper.has_eos and all(self.finished):
            self.target_len = max(self.first_stop)
        return self.max_new if self.target_len is None else self.target_len

    def _active(self) -> list[bool]:
        """Rows that still decode. Rows finished while others run on either pad (EOS set) or keep decoding."""
        limit = self._limit()
        if self.stopper.has_eos:
            return [not f and g < limit for f, g in zip(self.finished, self.generated)]
        return [g < limit for g in self.generated]

    def _active_on_device(self) -> torch.Tensor:
        """`_active` computed from the device copy of the row state (no host-to-device copy, so no wait)."""
        running = self.generated_t < self._limit()
        return running & ~self.finished_t if self.stopper.has_eos else running

    def _iterate(self, active: torch.Tensor) -> torch.Tensor:
        cache, gamma = self.cache, self.runner.gamma  # the runner's: `gamma="auto"` moves it
        self.gammas.append(gamma)
        committed = cache.plan.lengths.clone()
        if gamma == 0:  # dense decoding: one token, picked exactly as vanilla picks it
            drafts = draft_scores = self.draft_marks = None
            logits = self.runner.decode(self.pending)
        else:
            if self.ahead is not None:  # launched while the previous iteration synchronised
                drafts, draft_scores, self.draft_marks = self.ahead
                self.ahead = None
            else:
                drafts, draft_scores, self.draft_marks = self._draft()
            logits = self.runner.verify(self.pending, drafts)
        budget = self.max_new - self.generated_t
        graphs, key = self.runner.graphs, self.pipeline.capture_key
        if graphs is not None and key is not None and not self.stopper.others:
            eos = self.stopper.eos
            key = ("accept", gamma, self.do_sample, self.recorder.want_scores, key, None if eos is None else eos.shape)
            n, chunk, scores, keep, stopped = graphs.run(key, self._accept, logits, drafts, draft_scores, budget, eos)
        else:
            n, chunk, scores, keep, stopped = self._accept(logits, drafts, draft_scores, budget, self.stopper.eos)
        if self.cache.holds_row_scores():  # `last_token` policy selects from the row that produced the kept token
            select_from_rows(self.cache, n)
        if drafts is not None:
            cache.selection.note_acceptance(n, active)  # the next selection's budget (`VegasConfig.budget_boost`)
        keep, stopped = self._commit(chunk, keep, stopped, active)  # keep: 0 for inactive rows
        # The pending token and the kept tokens before the last have exact KV; the last kept token is the next
        # pending one. Usually keep = n + 1 (the cache keeps the accepted drafts, `nxt` is pending); a row cut by a
        # stopping criterion that goes on decoding (no EOS) resumes right after the cut, as vanilla does.
        cache.plan.rollback(committed + keep)
        last = chunk.gather(1, (keep - 1).clamp_min(0)[:, None]).squeeze(1)
        self.pending = torch.where(keep > 0, last, self.pending)
        copied = self._to_host(keep, stopped)
        following = gamma if self.auto is None else self.auto.gamma  # the controller's latest choice
        if gamma > 0 and following > 0 and self._may_draft_ahead(gamma):  # this iteration adds up to gamma + 1
            if following != gamma:  # this iteration's steps are queued: the next ones draft `following`
                self.runner.set_gamma(following)
            self.ahead = self._draft_ahead()
        self._follow_on_host(chunk, copied)
        if self.recorder.active:
            self.recorder.add(scores, logits, self.kept)
        return n

    def _draft(self):
        """`(drafts, draft scores, marks)`: marks around the draft's steps for `gamma="auto"`'s timing, else None."""
        start = self.auto.mark() if self.auto is not None else None
        drafts, scores = self.runner.draft(self.pending, self.tokens, self.history, start=self.history_t,
                                           keep_scores=self.do_sample)
        return drafts, scores, None if start is None else (start, self.auto.mark())

    def _may_draft_ahead(self, gamma: int) -> bool:
        """Whether to queue the next iteration's draft before this iteration's synchronisation returns, so that the
        GPU does not idle while Python reads the kept counts and updates the rows (0.3-0.8 ms per iteration on an
        H100). With `gamma="auto"` the draft takes the controller's choice as of the last synchronisation (decisions
        act one iteration later). Only when the draft reads nothing but device state (no history-reading processor),
        no streamer waits for the tokens, and the batch surely goes on: a row gains at most gamma + 1 tokens per
        iteration, so one far enough from its length limit (the host counts are one iteration old) still decodes,
        unless EOS or another stopping criterion ends it; then two such rows are asked for, since a draft queued for
        a batch that has stopped is wasted (GPU time only: `run` puts the generator back where it was before it).
        On the CPU it gains nothing but runs the same, so the CPU tests cover it."""
        graphs, key = self.runner.graphs, self.pipeline.capture_key
        from_device = (graphs is not None and key is not None) or (graphs is None and self.pipeline.batched)
        if self.streamer is not None or not from_device:
            return False
        limit = self._limit()
        going_on = sum(not f and limit - g > gamma + 1 for f, g in zip(self.finished, self.generated))
        return going_on >= (2 if self.stopper.has_eos or self.stopper.others else 1)

    def _draft_ahead(self):
        """The next iteration's draft, queued now: on the rows that may still decode (from the device state, so a
        row that stopped in this iteration drafts nothing). Verification and acceptance come after the host has
        caught up, on the rows it then finds active; the draft only proposes tokens, so what it assumed about the
        rows can never change the output."""
        self.cache.plan.row_active.copy_(self._active_on_device())
        self.rng_before_ahead = _rng_state(self.pending.device) if self.do_sample else None
        return self._draft()

    def _to_host(self, keep: torch.Tensor, stopped: torch.Tensor):
        """Queue the copy of the kept counts and stops to the host (pinned memory, no wait on CUDA)."""
        both = torch.stack([keep, stopped.long()])
        if not both.is_cuda:
            return both
        if self._pinned is None:
            self._pinned = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        self._pinned.copy_(both, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return done

    def _accept(self, logits, drafts, draft_scores, budget, eos):
        """Process the verification's logits `(B, gamma + 1, V)`, accept drafts and cut the chunk at the length budget
        and EOS. A function of its inputs (and, for history-reading processors, of the host history), so the graphs
        can capture it. Returns `(n accepted, chunk (B, gamma + 1), target scores, keep, stopped)`: the chunk holds the
        accepted drafts then the target's next token at position n (later positions are unused); the scores are
        the verification's at each chunk position; `keep` and `stopped` are `ChunkStopper.vectorised`'s."""
        # Greedy choice without outputs that show the scores only takes an argmax: vanilla's fp32 copy would not
        # change it (the copy is exact), so it is skipped.
        argmax_only = not self.do_sample and not self.recorder.want_scores
        scores = self.pipeline.positions(self.tokens, self.history, logits, keep_dtype=argmax_only)
        if drafts is None:  # dense decoding
            chunk = choose(scores[:, 0], self.do_sample)[:, None]
            n = torch.zeros_like(chunk[:, 0])
        else:
            if self.do_sample:
                n, nxt = accept_sampling(drafts, draft_scores, scores)
            else:
                n, nxt = accept_greedy(drafts, scores)
            chunk = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], dim=1)
            chunk.scatter_(1, n[:, None], nxt[:, None])
        keep, stopped = ChunkStopper.vectorised(chunk, n + 1, budget, eos)
        return n, chunk, scores, keep, stopped

    def _commit(self, chunk: torch.Tensor, keep: torch.Tensor, stopped: torch.Tensor, active: torch.Tensor):
        """Append each active row's chunk on the device, cut where vanilla generate would have stopped: `keep`/
        `stopped` as the length budget and EOS cut it, then the other stopping criteria. Returns them, 0 and False for
        inactive rows (`_follow_on_host` brings the host copy of the rows along)."""
        cols = self.history_t[:, None] + torch.arange(chunk.shape[1], device=chunk.device)[None, :]
        rows = self.cache.plan.row_index[:, None]
        old = self.tokens[rows, cols]
        self.tokens[rows, cols] = torch.where(active[:, None], chunk, old)
        keep, stopped = torch.where(active, keep, 0), stopped & active
        if self.stopper.others:  # they read the tokens just written
            keep, stopped = self.stopper.check_others(self.tokens, self.history, keep, stopped)
        self.history_t += keep
        self.generated_t += keep
        self.finished_t |= stopped
        return keep, stopped

    def _follow_on_host(self, chunk: torch.Tensor, copied) -> None:
        """The iteration's one synchronisation: read the kept counts and stops `_to_host` queued, and advance the
        host copy of the rows."""
        if isinstance(copied, torch.Tensor):
            keep_host, stopped_host = copied.tolist()
        else:
            copied.synchronize()
            keep_host, stopped_host = self._pinned.tolist()
        if self.streamer is not None and keep_host[0]:
            self.streamer.put(chunk[0, : keep_host[0]].cpu())
        self.history = [h + k for h, k in zip(self.history, keep_host)]
        self.generated = [g + k for g, k in zip(self.generated, keep_host)]
        self.finished = [f or bool(s) for f, s in zip(self.finished, stopped_host)]
        self.first_stop = [g if first is None and f else first
                           for first, g, f in zip(self.first_stop, self.generated, self.finished)]
        self.kept, self.stopped_now = keep_host, stopped_host

    def _sequences(self, width: int) -> torch.Tensor:
        length = self.target_len if self.target_len is not None else max(self.generated)
        out = self.tokens[:, : width + length].clone()
        if self.pad_id is not None:
            ends = self.history_t
            beyond = torch.arange(out.shape[1], device=out.device)[None, :] >= ends[:, None]
            out = torch.where(beyond, self.pad_id.to(out), out)
        return out
