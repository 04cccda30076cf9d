"""The throughput benchmark's timed generations (`throughput.py`): HF's best vanilla generate and ours, on the same
prompts, each warmed up once (compile, capture) and then timed once; their tokens' agreement with a reference."""

from __future__ import annotations

import collections
import time

import torch
import transformers

import hf_vegas
import projection
import workloads
from step_timer import FirstTokenClock, IterationTimes

DECODINGS = {"greedy": dict(do_sample=False), "sample": dict(do_sample=True, temperature=0.6, top_p=0.95, top_k=0)}
# Generation settings every method gets (`--prefill-chunk`: `prefill_chunk_size`, for prompts whose one-shot prefill
# does not fit beside the cache).
COMMON_GENERATE: dict = {}


def run_hf(model, ids, mask, new_tokens, decoding, seed: int = 0) -> tuple[dict, torch.Tensor]:
    common = dict(attention_mask=mask, max_new_tokens=new_tokens, cache_implementation="static", **DECODINGS[decoding],
                  **COMMON_GENERATE)
    model.generate(ids, **common)  # compiles the decode step for this shape
    clock = FirstTokenClock()
    torch.manual_seed(seed)
    torch.cuda.reset_peak_memory_stats()
    out = model.generate(ids, **common, stopping_criteria=transformers.StoppingCriteriaList([clock]))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - clock.first
    steps = new_tokens - 1
    # what HF actually ran: its attention, and whether generate compiled the decode step (private attribute)
    ran = dict(attn_implementation=model.config._attn_implementation,
               compiled=getattr(model, "_compiled_call", None) is not None)
    return dict(decode_seconds=seconds, step_ms=seconds / steps * 1e3, new_tokens=out.shape[1] - ids.shape[1],
                hf=ran, **_peak_memory()), out


def run_ours(model, ids, mask, new_tokens, decoding, config: hf_vegas.VegasConfig, history: list[str] | None = None,
             seed: int = 0) -> dict:
    """Our warm-up and timed generation (sampling draws from torch's generator seeded with `seed`); `history`: a
    real run's rows' rejections its selections note instead of its own (`projection.replaying`)."""
    common = dict(attention_mask=mask, max_new_tokens=new_tokens, custom_generate="vegas", vegas_config=config,
                  return_dict_in_generate=True, **DECODINGS[decoding], **COMMON_GENERATE)
    with projection.replaying(history):
        model.generate(ids, **common)  # warm-up: Triton compiles, graphs captured (kept for the timed call)
        timer = IterationTimes()
        torch.manual_seed(seed)
        torch.cuda.reset_peak_memory_stats()
        with timer.record():
            out = model.generate(ids, **common)
    accepted = out.accepted[out.accepted >= 0]
    steps = hf_vegas.graphs.pooled_graphs(model)  # how the steps ran: captured graphs, or eagerly and why
    graphs = dict(captures=steps.captures, replays=steps.replays,
                  eager_reason=steps.disabled_reason) if steps else dict(eager_reason="not pooled")
    return dict(graphs=graphs, decode_seconds=timer.decode_seconds(), step_ms=timer.median_ms()["wall"],
                split_ms=timer.median_ms(), iterations=out.accepted.shape[1],
                tokens_per_iteration=float((accepted + 1).float().mean()),
                gammas_run={str(g): n for g, n in sorted(collections.Counter(out.gammas.tolist()).items())},
                rows=row_acceptance(out.accepted, mask, new_tokens), new_tokens=out.sequences.shape[1] - ids.shape[1],
                **projection.budget_fields(out, config, history),
                **_peak_memory()), out.sequences


def row_acceptance(accepted: torch.Tensor, mask: torch.Tensor, budget: int) -> dict:
    """Per-row tokens per iteration (quantiles), and the slowest rows with their prompt lengths: the batch runs until
    its slowest row is done, so whether the stragglers share a trait (short, padded prompts) or not matters. A row's
    last iteration may accept more than the `budget` of new tokens leaves room for (the first new token came from the
    prefill): only the budget counts."""
    active = accepted >= 0
    produced = ((accepted + 1) * active).sum(dim=1).clamp_max(budget - 1)
    rate = produced.float() / active.sum(dim=1).clamp_min(1).float()
    quantiles = torch.quantile(rate, torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], device=rate.device)).tolist()
    prompt = mask.sum(dim=1)
    slowest = rate.argsort()[:4].tolist()
    return dict(tokens_per_iteration_quantiles=dict(zip(("min", "p10", "median", "p90", "max"), quantiles)),
                slowest=[dict(row=r, tokens_per_iteration=float(rate[r]), iterations=int(active[r].sum()),
                              prompt_tokens=int(prompt[r])) for r in slowest],
                prompt_tokens_range=[int(prompt.min()), int(prompt.max())])


def fp32_greedy(workload, ids, mask, new_tokens) -> torch.Tensor:
    """Vanilla greedy `generate` with the workload's model loaded in fp32 (HF's default cache and attention): the
    reference bf16 methods' drift is measured from."""
    hf_vegas.release_graphs()
    model, _ = workloads.load_model(workload.model, ids.shape[1] + new_tokens, torch.float32)
    try:
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, **COMMON_GENERATE)
    finally:
        del model
        torch.cuda.empty_cache()


def agreement(sequences: torch.Tensor, reference: torch.Tensor, prompt_width: int) -> dict:
    """How far greedy tokens agree with another method's on the same prompts: bf16 kernels that round differently
    (sparse drafts never change greedy tokens; verification and dense kernels may) let rows drift apart."""
    new, ref = sequences[:, prompt_width:], reference[:, prompt_width:]
    width = min(new.shape[1], ref.shape[1])
    differs = new[:, :width] != ref[:, :width]
    first = torch.where(differs.any(dim=1), differs.float().argmax(dim=1), width)
    return dict(rows=int(new.shape[0]), identical_rows=int((first == width).sum()),
                first_divergence=sorted(int(f) for f in first[first < width]), compared_tokens=width)


def _peak_memory() -> dict:
    """Peak GPU memory of the timed call (its prefill included; the weights and, for ours, the pooled cache that the
    warm-up left are part of it) and what stays allocated after it."""
    torch.cuda.synchronize()
    return dict(peak_memory_GiB=torch.cuda.max_memory_allocated() / 2**30,
                memory_after_GiB=torch.cuda.memory_allocated() / 2**30)
