"""`StepRunner`: the forwards of a Vegas generation, by name, and the CUDA graphs they replay.

    prefill(prompt)          full attention over the prompt; the first selection (eager: prompts vary in length)
    draft(pending)           gamma one-token forwards with sparse attention, each with its token choice; the cache is
                             left as before the draft
    verify(pending, drafts)  the gamma + 1 tokens with full attention; the next selection
    decode(pending)          one token with full attention and no selection (the gamma = 0 path)

Each forward declares its mode to the cache itself. HF's assisted loop runs the verification forward on its own:
for it, `arm_verification` declares it without running it (`hf_vegas.candidate`).
"""

from __future__ import annotations

import torch

from ._compat import internals as compat
from .cache import VegasCache
from .graphs import StepGraphs
from .sampling import LogitsPipeline, choose_draft


class StepRunner:
    r"""
    The forwards of one Vegas generation over a `VegasCache`.

    Args:
        model (`PreTrainedModel`): the model; it drafts with itself in the cache's "draft" mode.
        cache (`VegasCache`): the cache every forward reads and writes.
        logits_processor (`LogitsProcessorList`): the processors the target uses, so draft probabilities are the
            real distribution the drafts are sampled from.
        do_sample (`bool`): sample drafts (speculative sampling) or take the argmax (greedy).
        graphs (`StepGraphs`, *optional*): captured steps over `cache` (`hf_vegas.graphs`); None runs eagerly.
    """

    def __init__(self, model, cache: VegasCache, logits_processor, do_sample: bool, graphs: StepGraphs | None = None):
        self.model = model
        self.cache = cache
        self.gamma = cache.selection.gamma  # `set_gamma` moves it (`gamma="auto"`)
        # The Triton backend also runs top-p (`KernelTopP`) and the draft tokens' race (`race_argmax`) as kernels.
        self.kernels = cache.backend == "triton"
        self.pipeline = LogitsPipeline(logits_processor, kernels=self.kernels)
        self.do_sample = do_sample
        self.graphs = graphs

    def set_gamma(self, gamma: int) -> None:
        """Draft `gamma` tokens from the next iteration on (0: the next steps are dense `decode`s)."""
        self.gamma = gamma
        if gamma > 0:
            self.cache.selection.gamma = gamma

    # -- the forwards --------------------------------------------------------------------------------------------
    def prefill(self, inputs: torch.Tensor, left_pad: torch.Tensor | None = None,
                chunk_size: int | None = None) -> torch.Tensor:
        """Full attention over `inputs` (token ids, or `(B, T, hidden)` embeddings), after what the cache holds;
        `left_pad` counts each row's leading pads. Returns the last position's logits `(B, 1, V)`.

        `chunk_size` (`GenerationConfig.prefill_chunk_size`): forwards of at most that many positions, one after the
        other, so the activations of a long prompt take a chunk's memory, not the prompt's; only the last chunk
        chooses the first selection (it scores the prompt from its last row, as one forward would)."""
        width = inputs.shape[1]
        if chunk_size is None or width <= chunk_size:
            self.cache.begin("prefill", left_pad)
            return self.call_model(inputs, 1, left_pad)
        pads = left_pad if left_pad is not None else torch.zeros(inputs.shape[0], dtype=torch.long,
                                                                 device=inputs.device)
        for begin in range(0, width, chunk_size):
            piece = inputs[:, begin:begin + chunk_size]
            chunk_pad = (pads - begin).clamp(0, piece.shape[1])  # the pads of each row left in this chunk
            self.cache.begin("prefill", chunk_pad, selects=begin + chunk_size >= width)
            logits = self.call_model(piece, 1, chunk_pad)
        return logits

    def draft(self, pending: torch.Tensor, tokens: torch.Tensor, history: list[int],
              start: torch.Tensor | None = None, keep_scores: bool = True):
        """Draft `gamma` tokens after each row's `pending` token (the last token, not yet in the cache).

        Returns `(draft_tokens (B, gamma), draft_scores (B, gamma, V))`, the scores the drafts were chosen from
        after the processors (None when not `keep_scores`: greedy acceptance never reads them). The cache is left as
        before the draft.

        With graphs and processors that can be captured (`LogitsPipeline.capture_key`), the gamma forwards and token
        choices are one CUDA graph, whose outputs are valid until the next draft. Processors that read the history
        get it: the drafts are then written into `tokens` at `history[b] + i` (`start`: `history` on the device, if
        the caller has it) step by step, and each forward is its own graph.
        """
        committed = self.cache.plan.lengths.clone()
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
        self.cache.plan.rollback(committed)
        return drafts, scores

    def verify(self, pending: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """Each row's `pending` token and its `drafts` `(B, gamma)` with full attention, choosing the next draft's
        selection. Returns their logits `(B, gamma + 1, V)` (with graphs: the graph's buffer, valid until the next
        verification)."""
        self.arm_verification()
        return self._replayed(torch.cat([pending[:, None], drafts], dim=1), self.gamma + 1)

    def decode(self, pending: torch.Tensor) -> torch.Tensor:
        """One dense step of each row's `pending` token, no selection. Returns its logits `(B, 1, V)`."""
        self.cache.begin("decode")
        return self._replayed(pending[:, None], 1)

    def arm_verification(self) -> None:
        """Declare the next forward the verification of gamma drafts after each row's cached tokens; its last token
        lands `gamma + 1` slots after them, whatever prefix of the sequence the caller re-feeds (HF's assisted loop
        feeds the whole prompt with its first verification)."""
        self.cache.begin("verify", verify_end=self.cache.plan.lengths + self.gamma + 1)

    # -- running the model ---------------------------------------------------------------------------------------
    def call_model(self, ids: torch.Tensor, logits_to_keep: int, left_pad: torch.Tensor | None = None):
        """The model on `ids` in the cache's current mode (compiled while `graphs` compiles or captures a step)."""
        run = self._run_model if self.graphs is None else self.graphs.compiled(self._run_model)
        return run(ids, logits_to_keep, left_pad)

    def _run_model(self, ids: torch.Tensor, logits_to_keep: int, left_pad: torch.Tensor | None):
        offsets = torch.arange(ids.shape[1], device=ids.device)
        position_ids = self.cache.plan.lengths[:, None] + offsets[None, :]  # read on the device: graph-safe
        if left_pad is not None:
            position_ids = (position_ids - left_pad[:, None]).clamp_min(0)
        # A prefill may start from embeddings (`generate(inputs_embeds=...)`): `(B, T, hidden)` floats.
        inputs = dict(inputs_embeds=ids) if ids.is_floating_point() else dict(input_ids=ids)
        out = self.model(**inputs, position_ids=position_ids, use_cache=True, logits_to_keep=logits_to_keep,
                         **{compat.CACHE_KEYWORD: self.cache})
        # (a model on several devices: the logits come from its last one; the loop runs on the cache's device)
        return out.logits.to(self.cache.device) if self.cache.spread else out.logits

    def _replayed(self, ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        """One forward in the cache's current mode, through its graph when there are graphs."""
        if self.graphs is None:
            return self.call_model(ids, logits_to_keep)
        key = (self.cache.plan.mode, ids.shape[1], logits_to_keep)
        return self.graphs.run(key, lambda static_ids: self.call_model(static_ids, logits_to_keep), ids)

    def _draft_steps(self, pending: torch.Tensor, keep_scores: bool):
        """The gamma forwards and token choices of a draft whose processors never read the history."""
        ids, drafts, scores = pending[:, None], [], []
        for _ in range(self.gamma):
            logits = self.call_model(ids, logits_to_keep=1)[:, -1]
            step_scores = self.pipeline.history_free(logits, keep_dtype=not keep_scores)
            token = choose_draft(step_scores, self.do_sample, self.kernels)
            drafts.append(token)
            scores.append(step_scores)
            ids = token[:, None]
        return torch.stack(drafts, dim=1), torch.stack(scores, dim=1) if keep_scores else None

    def _draft_with_history(self, pending, tokens, history, start, keep_scores: bool):
        rows = self.cache.plan.row_index
        if start is None:
            start = torch.tensor(history, device=tokens.device)
        ids, drafts, scores = pending[:, None], [], []
        for i in range(self.gamma):  # `draft` declared the mode
            logits = self._replayed(ids, 1)[:, -1]
            step_scores = self.pipeline(tokens, [h + i for h in history], logits)
            token = choose_draft(step_scores, self.do_sample, self.kernels)
            tokens[rows, start + i] = token
            drafts.append(token)
            scores.append(step_scores)
            ids = token[:, None]
        return torch.stack(drafts, dim=1), torch.stack(scores, dim=1) if keep_scores else None
