"""A draft token per row from its processed scores and a row of exponential draws, in one launch.

`torch.multinomial(softmax(scores), 1)` is the race `argmax(softmax(scores) / E)`, `E ~ Exp(1)`. The softmax's
denominator is the same for the whole row, so the winner is `argmax(scores - log E)`, and no probability has to be
written: `hf_vegas.sampling.choose_draft` draws `E` with `exponential_` (the generator moves as multinomial moves it)
and this kernel runs the race. Eagerly that is three launches over the `(B, V)` scores (softmax, division, argmax).

A program owns one chunk of one row and finds its winner (ties: the lowest index, as `torch.argmax`); the last
program of a row to finish, counted by an atomic ticket it zeroes again (`_launch.tickets`), merges the chunks'
winners. A NaN key (a NaN score, or a filtered `-inf` score against a draw of 0) never wins; a row with no finite
key drafts token 0, which the acceptance then rejects. Semantics: `naive.race_argmax`.

Without draws it is a greedy draft's argmax, in the logits' own dtype: over a SmolLM2 draft step's `(64, 49152)`
bf16 logits torch's argmax took 13.3 us on an H100, this launch 4.8 us (`benchmarks/profile_forward.py
--random-weights --compile`, 8eaac62 and dc9a8c6).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch

TUNING = {"chunk": 4096, "block": 1024, "num_warps": 4}
_CPU_TUNING = {"chunk": 256, "block": 64, "num_warps": 4}


@triton.jit
def _race_argmax(Scores, Race, Best, BestIdx, Tickets, Out, vocab, stride_s, stride_r, num_chunks,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, USE_GDC: tl.constexpr,
                 HAS_RACE: tl.constexpr):
    if USE_GDC:  # programmatic dependent launch (`_launch.pdl`): the draws (or, without, the scores) are the
        # previous kernel's output
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, tl.int32)
    for v0 in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        i = v0 + tl.arange(0, BLOCK)
        valid = i < vocab
        x = tl.load(Scores + row * stride_s + i, mask=valid, other=float("-inf")).to(tl.float32)
        if HAS_RACE:
            e = tl.load(Race + row * stride_r + i, mask=valid, other=1.0).to(tl.float32)
            key = x - tl.log(e)
        else:
            key = x
        key = tl.where(key == key, key, float("-inf"))  # NaN never wins
        better = key > best  # each lane sees increasing indices: a tie keeps the earlier one
        best_idx = tl.where(better, i, best_idx)
        best = tl.where(better, key, best)
    top = tl.max(best, axis=0)
    top_idx = tl.min(tl.where(best == top, best_idx, 2147483647), axis=0)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(Best + row * num_chunks + chunk, top)
    tl.store(BestIdx + row * num_chunks + chunk, top_idx)
    # The last chunk of the row to finish merges the others' winners (stores, barrier, then the ticket's release;
    # the winner reads past L1 after its acquire).
    tl.debug_barrier()
    ticket = tl.atomic_add(Tickets + row, 1, sem="acq_rel", scope="gpu")
    if ticket == num_chunks - 1:
        c = tl.arange(0, BLOCK_C)
        ok = c < num_chunks
        chunk_best = tl.load(Best + row * num_chunks + c, mask=ok, other=float("-inf"), cache_modifier=".cg")
        chunk_idx = tl.load(BestIdx + row * num_chunks + c, mask=ok, other=2147483647, cache_modifier=".cg")
        winner = tl.max(chunk_best, axis=0)
        token = tl.min(tl.where(ok & (chunk_best == winner), chunk_idx, 2147483647), axis=0)
        # Only a row without a finite key has no winner below the vocabulary: it drafts token 0.
        tl.store(Out + row, tl.where(token < vocab, token, 0).to(tl.int64))
        tl.atomic_xchg(Tickets + row, 0, sem="relaxed", scope="gpu")


def race_argmax(scores: torch.Tensor, race: torch.Tensor | None) -> torch.Tensor:
    """`argmax(scores - log(race))` per row of `(B, V)` `scores` and positive draws `race`, or `argmax(scores)` where
    `race` is None (NaN keys lose; a row with no finite key gives 0). Returns `(B,)` int64."""
    if scores.dim() != 2 or (race is not None and race.shape != scores.shape):
        raise ValueError(f"race_argmax: scores and race must be one (B, V) shape, got {tuple(scores.shape)} and "
                         f"{None if race is None else tuple(race.shape)}")
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    if race is not None:
        race = race if race.stride(-1) == 1 else race.contiguous()
    rows, vocab = scores.shape
    device = scores.device
    tuning = TUNING if device.type == "cuda" else _CPU_TUNING
    chunk = min(tuning["chunk"], max(triton.next_power_of_2(vocab), tuning["block"]))
    block = min(tuning["block"], chunk)
    num_chunks = triton.cdiv(vocab, chunk)
    best = _launch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    best_idx = _launch.empty(rows, num_chunks, dtype=torch.int32, device=device)
    out = _launch.empty(rows, dtype=torch.int64, device=device)
    _race_argmax[(rows, num_chunks)](
        scores, race if race is not None else scores, best, best_idx, _launch.tickets(rows, device), out, vocab,
        scores.stride(0), race.stride(0) if race is not None else 0, num_chunks, CHUNK=chunk, BLOCK=block,
        BLOCK_C=max(2, triton.next_power_of_2(num_chunks)), USE_GDC=_launch.pdl(device), HAS_RACE=race is not None,
        num_warps=tuning["num_warps"], **_launch.pdl_launch(device),
    )
    return out
