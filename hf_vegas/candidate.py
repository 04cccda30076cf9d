"""`VegasCandidateGenerator`: the Vegas drafter as a `transformers` `CandidateGenerator`.

`get_candidates` / `update_candidate_strategy` are the interface HF's own assisted-decoding loop calls (batch 1, see
`hf_vegas.assisted`); the drafting itself is `StepRunner.draft`, the same as in `hf_vegas.generate`'s loop. HF's loop
then runs the verification forward itself, which `arm_verification` declares to the cache.
"""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from .attention import select_from_rows
from .cache import VegasCache
from .runner import StepRunner


class VegasCandidateGenerator(CandidateGenerator):
    r"""
    Self-speculative drafter over a shared `VegasCache`, for HF's assisted-decoding loop.

    Args:
        model (`PreTrainedModel`): the model; it drafts with itself in the cache's "draft" mode.
        cache (`VegasCache`): the cache HF's verification forwards also use.
        logits_processor (`LogitsProcessorList`): the same processors the target uses, so draft probabilities are
            the real distribution the drafts are sampled from.
        do_sample (`bool`): sample drafts (speculative sampling) or take the argmax (greedy).
    """

    def __init__(self, model, cache: VegasCache, logits_processor, do_sample: bool):
        if cache.vegas_config.gamma == "auto":
            raise ValueError("`vegas_gamma='auto'` runs in hf_vegas.generate; HF's assisted loop drafts a fixed "
                             "number of tokens: give the cache an integer gamma >= 1.")
        self.cache = cache
        self.runner = StepRunner(model, cache, logits_processor, do_sample)

    @property
    def num_drafting_tokens(self) -> int:
        """Tokens drafted per iteration (gamma). transformers 5.25's assisted loop reads it to size what the cache
        records for rollback; a `VegasCache` needs none of that (it crops by per-row lengths)."""
        return self.runner.gamma

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        if input_ids.shape[0] != 1:
            raise ValueError("HF's assisted decoding runs batch 1 only; use hf_vegas.generate for batches.")
        cached = self.cache.get_seq_length()
        if cached < input_ids.shape[1] - 1:
            # HF feeds the prompt with the first verification; the drafter needs it cached (and a selection).
            self.runner.prefill(input_ids[:, cached:-1])
        width = input_ids.shape[1]
        tokens = torch.cat([input_ids, input_ids.new_zeros(1, self.runner.gamma)], dim=1)
        drafts, scores = self.runner.draft(input_ids[:, -1], tokens, [width])
        self.runner.arm_verification()
        return torch.cat([input_ids, drafts], dim=1), scores

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        accepted = torch.tensor([num_matches], device=self.cache.device)
        if self.cache.holds_row_scores():  # `last_token` policy: the row that produced the kept token
            select_from_rows(self.cache, accepted)
        # the next selection's budget (`VegasConfig.budget_boost`), as in hf_vegas' own loop
        self.cache.selection.note_acceptance(accepted, torch.ones(1, dtype=torch.bool, device=self.cache.device))
