"""Logits processing with each row's own history, token choice, and lossless acceptance.

Rows of a Vegas batch advance by different amounts, so a row's history (what `generate` would pass to a logits
processor as `input_ids`) has its own length. Processors that never look at the history run once for the batch;
any other processor runs once per distinct history length, on exactly the history vanilla `generate` would have
shown it.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from .ops import backend

# Warpers whose output depends on the scores only, never on `input_ids`.
HISTORY_FREE = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)


class KernelTopP(LogitsProcessor):
    """`TopPLogitsWarper` through the Triton threshold search (`hf_vegas_kernels.top_p`): the same kept set without
    sorting the vocabulary (H100, `benchmarks/top_p.py`: 356 us against the sort's 2.76 ms for a verification's 448
    rows of 49K scores shaped like a trained model's).

    `temperature`: a `TemperatureLogitsWarper` just before it, folded in (the kernel divides as that warper does on
    CUDA), so the pair reads the rows once instead of writing a divided copy first. It reads the model's logits in
    their own dtype (the fp32 copy `generate` makes is exact) and returns new fp32 scores."""

    def __init__(self, warper: TopPLogitsWarper, temperature: float | None = None):
        self.top_p, self.filter_value, self.temperature = warper.top_p, warper.filter_value, temperature

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        return backend.kernels().top_p_filter(scores, self.top_p, self.filter_value, self.temperature)


def _kernel_replaces(processor) -> bool:
    return (isinstance(processor, TopPLogitsWarper) and processor.min_tokens_to_keep == 1
            and backend.kernels().top_p.MIN_TOP_P <= processor.top_p < 1.0)


def _with_kernels(processors: LogitsProcessorList) -> LogitsProcessorList:
    """`processors` with each top-p warper that the kernel reproduces as `KernelTopP`, a temperature warper right
    before it folded in."""
    out = []
    for processor in processors:
        if not _kernel_replaces(processor):
            out.append(processor)
        elif out and type(out[-1]) is TemperatureLogitsWarper:
            out.append(KernelTopP(processor, temperature=out.pop().temperature))
        else:
            out.append(KernelTopP(processor))
    return LogitsProcessorList(out)


# History-free processors that run inside a CUDA graph: no host synchronisation, and settings that are plain numbers
# (a graph bakes them in, so they are part of its key). Eta keeps a tensor and builds a validating `Categorical`.
CAPTURABLE = tuple(p for p in HISTORY_FREE if p is not EtaLogitsWarper) + (KernelTopP,)


def _settings(processor) -> tuple | None:
    """A processor's settings as a hashable tuple, or None when one of them is not a plain number."""
    items = sorted(vars(processor).items())
    if not all(value is None or isinstance(value, (bool, int, float)) for _, value in items):
        return None
    return (type(processor).__name__, *items)


class LogitsPipeline:
    """Applies a `LogitsProcessorList` to `(B, V)` logits given each row's history length in `tokens`.

    With `kernels=True` (the Triton backend), top-p filtering runs as `KernelTopP` (with the temperature before it).
    `batched`: no processor reads the history, so one call covers every row and position.
    `capture_key`: when the processors can run inside a CUDA graph (`hf_vegas.graphs`), their settings, which such a
    graph bakes in (None when they cannot).
    """

    def __init__(self, processors: LogitsProcessorList | None, kernels: bool = False):
        processors = processors if processors is not None else LogitsProcessorList()
        if kernels:
            processors = _with_kernels(processors)
        self.processors = processors
        self.batched = all(isinstance(p, (*HISTORY_FREE, KernelTopP)) for p in self.processors)
        # Exact classes only: a subclass may read the history or keep Python state that a replay would not update.
        settings = [_settings(p) if type(p) in CAPTURABLE else None for p in self.processors]
        self.capture_key = None if None in settings else tuple(settings)

    def history_free(self, logits: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """Process `(..., V)` logits of any rows and positions (only for a `batched` pipeline).

        `keep_dtype` (no processors only): return the logits themselves, not vanilla's fp32 copy, for a caller that
        only takes their argmax (the same token: the copy is exact).
        """
        if keep_dtype and len(self.processors) == 0:
            return logits
        shape = logits.shape
        scores = logits.reshape(-1, shape[-1])
        if not (len(self.processors) and isinstance(self.processors[0], KernelTopP)
                and scores.dtype in (torch.float32, torch.bfloat16, torch.float16)):
            # vanilla's fp32 copy (processors may write into their input); `KernelTopP` reads the logits as they
            # are and writes new fp32 scores, so it needs none
            scores = scores.to(dtype=torch.float32, copy=True)
        if len(self.processors):
            scores = self.processors(None, scores)  # history-free processors never read `input_ids`
        return scores.reshape(shape)

    def __call__(self, tokens: torch.Tensor, history: list[int], logits: torch.Tensor) -> torch.Tensor:
        if self.batched:
            return self.history_free(logits)
        # A copy in fp32, as vanilla generate does: some processors write into their input.
        scores = logits.to(dtype=torch.float32, copy=True)
        lengths = sorted(set(history))
        if len(lengths) == 1:
            return self.processors(tokens[:, : history[0]], scores)
        # Processors may keep per-row state sized to the batch (e.g. the repetition penalty's prompt lengths), so
        # each call sees the whole batch at one history length, and only the rows of that length are kept.
        out = torch.empty_like(scores)
        for length in lengths:
            rows = torch.tensor([b for b, h in enumerate(history) if h == length], device=scores.device)
            out[rows] = self.processors(tokens[:, :length], scores.clone())[rows]
        return out

    def positions(self, tokens: torch.Tensor, history: list[int], logits: torch.Tensor,
                  keep_dtype: bool = False) -> torch.Tensor:
        """Process `(B, P, V)` logits where position `i` of row `b` follows history length `history[b] + i`
        (`keep_dtype`: see `history_free`; a batched pipeline reads neither `tokens` nor `history`)."""
        if self.batched:  # one call for every position
            return self.history_free(logits, keep_dtype)
        steps = [self(tokens, [h + i for h in history], logits[:, i]) for i in range(logits.shape[1])]
        return torch.stack(steps, dim=1)


def choose(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """Next token per row from processed scores `(B, V)`, exactly as vanilla `generate` picks it."""
    if do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    return scores.argmax(dim=-1)


def choose_draft(scores: torch.Tensor, do_sample: bool, kernels: bool = False) -> torch.Tensor:
    """A draft token per row: `choose`'s token, from the same draws, without `torch.multinomial`'s checks.

    One sample of `multinomial` is the exponential race `argmax(probs / E)`, `E ~ Exp(1)` drawn by `exponential_`
    on a tensor of the probabilities' shape; this is that race alone. `kernels` (the Triton backend): the race after
    the draws is one launch (`hf_vegas_kernels.race_argmax`, `argmax(scores - log E)`: the softmax's denominator is
    one number per row, so the winner is the same up to rounding and no probability is written) instead of three
    over the `(B, V)` scores (softmax, division, argmax).

    Greedy, `kernels` takes the argmax with `race_argmax` without draws (faster than `torch.argmax` over a draft
    step's logits: see `hf_vegas_kernels.race`); its NaN never wins where `torch.argmax`'s does, which can only
    change what a NaN row drafts.

    The checks it skips (no inf, nan or negative probability, no all-zero row) are four reductions and two asserts
    over the whole `(B, V)` tensor, a sixth of a draft step's sampling on an H100 (`benchmarks/profile_forward.py
    --sample`). A row of NaN draft scores then drafts token 0 instead of raising; its acceptance test
    (`u * q <= p`) fails on the NaN, so the token is rejected and the target resamples: the output stays vanilla's,
    only acceptance drops. The target's scores are still checked: `accept_sampling` draws the next token with
    `multinomial`, which raises on a NaN target row as vanilla does.
    """
    if not do_sample:
        return backend.kernels().race_argmax(scores, None) if kernels else scores.argmax(dim=-1)
    if kernels:
        race = torch.empty_like(scores, dtype=torch.float32).exponential_(1)
        return backend.kernels().race_argmax(scores, race)
    # Eagerly the softmax form is three launches where `naive.race_argmax`'s logarithm form is five.
    probs = torch.softmax(scores, dim=-1)
    race = torch.empty_like(probs).exponential_(1)
    return (probs / race).argmax(dim=-1)


def leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row of a `(B, G)` bool mask."""
    return mask.long().cumprod(dim=-1).sum(dim=-1)


def accept_greedy(draft: torch.Tensor, target_scores: torch.Tensor):
    """Greedy verification. `draft` `(B, G)`, `target_scores` `(B, G+1, V)`.

    Returns `(n, next_token)`: accepted draft count per row and the target's token right after them.
    """
    target = target_scores.argmax(dim=-1)
    n = leading_true(draft == target[:, :-1])
    return n, target.gather(1, n[:, None]).squeeze(1)


def accept_sampling(draft: torch.Tensor, draft_scores: torch.Tensor, target_scores: torch.Tensor):
    """Speculative sampling (Leviathan et al., 2023, Alg. 1) with the real draft distributions.

    `draft_scores` `(B, G, V)` are the processed scores the drafts were sampled from; `target_scores`
    `(B, G+1, V)` the processed verification scores. Draft `i` is kept with probability `min(1, p_i/q_i)`; the first
    rejected position is resampled from `norm(max(p - q, 0))`, and if all are kept the bonus comes from `p_G`.
    """
    q = torch.softmax(draft_scores, dim=-1)
    p = torch.softmax(target_scores, dim=-1)
    q_tok = q.gather(-1, draft[..., None]).squeeze(-1)
    p_tok = p[:, :-1].gather(-1, draft[..., None]).squeeze(-1)
    # u <= p/q written without the division: q_tok > 0 because the draft was sampled from q.
    u = torch.rand(q_tok.shape, device=q_tok.device)
    n = leading_true(u * q_tok <= p_tok)
    rows = torch.arange(draft.shape[0], device=draft.device)
    p_n = p[rows, n]
    # q at the first rejected draft; zero after the last draft (the bonus comes from p_G). Gathered, not padded: a
    # padded copy of q would move the whole (B, G, V) tensor for one position per row.
    drafts = draft.shape[1]
    q_n = torch.where((n < drafts)[:, None], q[rows, n.clamp(max=drafts - 1)], 0.0)
    residual = (p_n - q_n).clamp_min(0)
    total = residual.sum(dim=-1, keepdim=True)
    # p == q leaves nothing to resample from; that position is then never rejected, but keep p to stay defined.
    residual = torch.where(total > 0, residual / total.clamp_min(torch.finfo(total.dtype).tiny), p_n)
    return n, torch.multinomial(residual, num_samples=1).squeeze(1)
