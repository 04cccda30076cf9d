"""What `generate` returns with `return_dict_in_generate=True`: HF's usual output plus acceptance statistics."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput


@dataclass
class VegasGenerateOutput(GenerateDecoderOnlyOutput):
    r"""
    [`~generation.GenerateDecoderOnlyOutput`] plus Vegas statistics. `cache` (`past_key_values` before transformers
    5.24) is the generation's own `VegasCache`, or None when the cache was pooled for the next call (CUDA graphs, see
    `hf_vegas.graphs`).

    Args:
        accepted (`torch.LongTensor` of shape `(batch_size, num_iterations)`):
            Draft tokens accepted by each row in each draft/verify iteration; `-1` where the row had already
            finished. Each active iteration also yields one more token (the correction or bonus token).
        gammas (`torch.LongTensor` of shape `(num_iterations,)`):
            The draft length each iteration ran (0: a dense step); with `vegas_gamma="auto"`, what the controller
            chose (`hf_vegas.auto_gamma`).
    """

    accepted: torch.LongTensor | None = None
    gammas: torch.LongTensor | None = None

    @property
    def tokens_per_iteration(self) -> float:
        """Mean tokens produced per active (row, iteration): accepted drafts + the bonus/correction token."""
        active = self.accepted[self.accepted >= 0]
        return float((active + 1).float().mean()) if active.numel() else float("nan")


class StepRecorder:
    """The processed scores and raw logits of every token a row kept, laid out as vanilla's per-step tuples.

    Vanilla `generate` records one `(batch, vocab)` tensor per generated step. Vegas rows advance by chunks of
    different lengths, so each forward's candidate positions are kept with the count each row accepted, and the
    per-step tensors are gathered once at the end. A row that finished on EOS while others went on has no scores or
    logits for the later steps: vanilla computes them by feeding pad tokens, hf_vegas runs no forward for the row.
    Those steps hold a pad-certain row instead (0 at the pad token, -inf elsewhere), in `scores` and `logits` alike,
    so `compute_transition_scores` gives them 0 (vanilla gives the model's score of the pad token there). This is the
    one place the output differs from vanilla's; the tokens and every live step's values are vanilla's.
    """

    def __init__(self, scores: bool, logits: bool):
        self.want_scores, self.want_logits = scores, logits
        self.scores: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.kept: list[list[int]] = []

    @property
    def active(self) -> bool:
        return self.want_scores or self.want_logits

    def add(self, scores: torch.Tensor, logits: torch.Tensor, kept: list[int]) -> None:
        """`scores`, `logits` `(B, P, V)`: the candidate positions of one forward; `kept[b]` of them are row b's."""
        width = max(kept)
        if width == 0:
            return
        if self.want_scores:
            self.scores.append(scores[:, :width].clone())
        if self.want_logits:  # fp32, as vanilla returns them; copied: the next graph replay overwrites its outputs
            self.logits.append(logits[:, :width].to(dtype=torch.float32, copy=True))
        self.kept.append(kept)

    def tuples(self, steps: int, pad_token_id: torch.Tensor | None):
        """`(scores, logits)`: tuples of `steps` `(B, V)` tensors (None for what was not asked)."""
        scores = self._gather(self.scores, steps, pad_token_id) if self.want_scores else None
        logits = self._gather(self.logits, steps, pad_token_id) if self.want_logits else None
        return scores, logits

    def _gather(self, chunks: list[torch.Tensor], steps: int, pad_token_id) -> tuple:
        if not chunks or steps == 0:
            return ()
        flat = torch.cat(chunks, dim=1)  # (B, sum of widths, V)
        batch, vocab = flat.shape[0], flat.shape[-1]
        index = torch.zeros(batch, steps, dtype=torch.long)
        present = torch.zeros(batch, steps, dtype=torch.bool)
        for b in range(batch):
            positions, offset = [], 0
            for chunk, kept in zip(chunks, self.kept):
                positions += range(offset, offset + kept[b])
                offset += chunk.shape[1]
            positions = positions[:steps]
            index[b, : len(positions)] = torch.tensor(positions, dtype=torch.long)
            present[b, : len(positions)] = True
        index, present = index.to(flat.device), present.to(flat.device)
        out = flat.gather(1, index[:, :, None].expand(batch, steps, vocab))
        if not bool(present.all()):
            if pad_token_id is None:
                raise RuntimeError("A row finished early without a pad token: nothing to fill its later steps with.")
            filler = torch.full((vocab,), float("-inf"), device=flat.device)
            filler[int(pad_token_id)] = 0.0
            out = torch.where(present[:, :, None], out, filler)
        return tuple(out.unbind(dim=1))
