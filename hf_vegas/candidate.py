"""`VegasCandidateGenerator`: drafts `gamma` tokens with the model itself, attending sparsely.

`draft` is what `hf_vegas.generate` calls for a whole batch. `get_candidates` / `update_candidate_strategy` are the
`transformers` `CandidateGenerator` interface, so the same drafter also runs inside HF's own assisted-decoding loop
(batch 1, see `hf_vegas.assisted`).
"""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from .attention import select_from_rows
from .cache import VegasCache
from .graphs import StepGraphs
from .sampling import LogitsPipeline, choose


class VegasCandidateGenerator(CandidateGenerator):
    r"""
    Self-speculative drafter over a shared `VegasCache`.

    Args:
        model (`PreTrainedModel`): the model; it drafts with itself in the cache's "draft" mode.
        cache (`VegasCache`): the cache the verification forwards also use.
        logits_processor (`LogitsProcessorList`): the same processors the target uses, so draft probabilities are
            the real distribution the drafts are sampled from.
        do_sample (`bool`): sample drafts (speculative sampling) or take the argmax (greedy).
        graphs (`StepGraphs`, *optional*): captured forwards over `cache` (`hf_vegas.graphs`); None runs eagerly.
    """

    def __init__(self, model, cache: VegasCache, logits_processor, do_sample: bool, graphs: StepGraphs | None = None):
        self.model = model
        self.cache = cache
        self.gamma = cache.vegas_config.gamma
        self.pipeline = LogitsPipeline(logits_processor, kernels=cache.backend == "triton")
        self.do_sample = do_sample
        self.graphs = graphs

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int, mode: str | None = None, left_pad=None):
        """One model forward of `input_ids` (or, for a prefill, embeddings); positions continue each row's cache.
        Returns the kept logits.

        `mode` declares the forward to the cache; `None` keeps what the cache was told last (after `draft`, the
        verification of its drafts). Verify and decode forwards replay CUDA graphs when `graphs` is set; their
        logits are then the graph's output buffer, valid until the next forward of that kind.
        """
        if mode is not None:
            self.cache.begin(mode, left_pad)
        if self.graphs is None or self.cache.mode == "prefill":  # prefills vary in length: always eager
            return self.call_model(input_ids, logits_to_keep, left_pad)
        key = (self.cache.mode, input_ids.shape[1], logits_to_keep)
        return self.graphs.run(key, lambda ids: self.call_model(ids, logits_to_keep), input_ids)

    def call_model(self, ids: torch.Tensor, logits_to_keep: int, left_pad: torch.Tensor | None = None):
        """The model on `ids` in the cache's current mode (compiled while `graphs` compiles or captures a step)."""
        run = self._run_model if self.graphs is None else self.graphs.compiled(self._run_model)
        return run(ids, logits_to_keep, left_pad)

    def _run_model(self, ids: torch.Tensor, logits_to_keep: int, left_pad: torch.Tensor | None):
        offsets = torch.arange(ids.shape[1], device=ids.device)
        position_ids = self.cache.lengths[:, None] + offsets[None, :]  # read on the device: graph-safe
        if left_pad is not None:
            position_ids = (position_ids - left_pad[:, None]).clamp_min(0)
        # A prefill may start from embeddings (`generate(inputs_embeds=...)`): `(B, T, hidden)` floats.
        inputs = dict(inputs_embeds=ids) if ids.is_floating_point() else dict(input_ids=ids)
        out = self.model(**inputs, position_ids=position_ids, past_key_values=self.cache, use_cache=True,
                         logits_to_keep=logits_to_keep)
        return out.logits

    def draft(self, pending: torch.Tensor, tokens: torch.Tensor, history: list[int],
              start: torch.Tensor | None = None, keep_scores: bool = True):
        """Draft `gamma` tokens after each row's `pending` token (the last token, not yet in the cache).

        Returns `(draft_tokens (B, gamma), draft_scores (B, gamma, V))`, the scores the drafts were chosen from
        after the processors (None when not `keep_scores`: greedy acceptance never reads them). The cache is left as
        before the draft, set up for the verification.

        With graphs and processors that can be captured (`LogitsPipeline.capture_key`), the gamma forwards and token
        choices are one CUDA graph, whose outputs are valid until the next draft. Processors that read the history
        get it: the drafts are then written into `tokens` at `history[b] + i` (`start`: `history` on the device, if
        the caller has it) step by step, and each forward is its own graph.
        """
        committed = self.cache.lengths.clone()
        self.cache.begin("draft")
        key = self.pipeline.capture_key

        def steps(ids):
            return self._draft_steps(ids, keep_scores)

        if self.graphs is not None and key is not None:
            drafts, scores = self.graphs.run(("draft", self.gamma, self.do_sample, keep_scores, key), steps, pending)
        elif self.graphs is None and self.pipeline.batched:
            drafts, scores = steps(pending)
        else:
            drafts, scores = self._draft_with_history(pending, tokens, history, start, keep_scores)
        self.cache.rollback(committed)
        self.cache.begin("verify", verify_end=committed + self.gamma + 1)
        return drafts, scores

    def _draft_steps(self, pending: torch.Tensor, keep_scores: bool):
        """The gamma forwards and token choices of a draft whose processors never read the history."""
        ids, drafts, scores = pending[:, None], [], []
        for _ in range(self.gamma):
            logits = self.call_model(ids, logits_to_keep=1)[:, -1]
            step_scores = self.pipeline.history_free(logits, keep_dtype=not keep_scores)
            token = choose(step_scores, self.do_sample)
            drafts.append(token)
            scores.append(step_scores)
            ids = token[:, None]
        return torch.stack(drafts, dim=1), torch.stack(scores, dim=1) if keep_scores else None

    def _draft_with_history(self, pending, tokens, history, start, keep_scores: bool):
        rows = self.cache.row_index
        if start is None:
            start = torch.tensor(history, device=tokens.device)
        ids, drafts, scores = pending[:, None], [], []
        for i in range(self.gamma):
            logits = self.forward(ids, logits_to_keep=1, mode="draft")[:, -1]
            step_scores = self.pipeline(tokens, [h + i for h in history], logits)
            token = choose(step_scores, self.do_sample)
            tokens[rows, start + i] = token
            drafts.append(token)
            scores.append(step_scores)
            ids = token[:, None]
        return torch.stack(drafts, dim=1), torch.stack(scores, dim=1) if keep_scores else None

    # -- transformers CandidateGenerator interface (HF's assisted loop, batch 1) ---------------------------------
    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        if input_ids.shape[0] != 1:
            raise ValueError("HF's assisted decoding runs batch 1 only; use hf_vegas.generate for batches.")
        cached = self.cache.get_seq_length()
        if cached < input_ids.shape[1] - 1:
            # HF feeds the prompt with the first verification; the drafter needs it cached (and a selection).
            self.forward(input_ids[:, cached:-1], logits_to_keep=1, mode="prefill")
        width = input_ids.shape[1]
        tokens = torch.cat([input_ids, input_ids.new_zeros(1, self.gamma)], dim=1)
        drafts, scores = self.draft(input_ids[:, -1], tokens, [width])
        return torch.cat([input_ids, drafts], dim=1), scores

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        if self.cache.row_scores:  # `last_token` policy: the row that produced the kept token
            select_from_rows(self.cache, torch.tensor([num_matches], device=self.cache.device))
