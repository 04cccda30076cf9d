"""`hf_vegas.generate`: the Vegas decoding entry point, a `custom_generate` callable for `model.generate`.

It checks the call (every bad input raises before any forward), builds or reuses the cache and the step graphs,
swaps the model's attention for the Vegas dispatch while it runs, and hands the rows to `hf_vegas.loop.DecodeLoop`:

    prefill (full attention, first selection from the last prompt row)
    repeat: draft gamma tokens (sparse attention) -> verify gamma + 1 rows (full attention, next selection)
            -> accept per row (greedy match / speculative sampling) -> stop inside the chunk -> roll back the cache

With `gamma = 0` the same loop decodes one token per step with dense attention and no selection: vanilla decoding
over the Vegas cache, kernels and graphs (the dense baseline the benchmarks compare against).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging

import torch

from . import graphs, placement, prompt_cache, symmetric_all_reduce, tensor_parallel, validation
from ._compat import internals as compat
from .attention import active_cache, vegas_attention
from .backward_hooks import backward_hooks_set_aside
from .config import VegasConfig, resolve_config
from .cpu_linears import weights_left_linears
from .fused_layers import fused_steps
from .rotary_tables import rotary_tables_once
from .symmetric_all_reduce import symmetric_all_reduces
from .ops import backend
from .output import StepRecorder, VegasGenerateOutput
from .loop import DecodeLoop


# Set by `checks_only`: `generate` runs every check, then returns before any forward.
_CHECKS_ONLY: contextvars.ContextVar = contextvars.ContextVar("hf_vegas_checks_only", default=False)


@contextlib.contextmanager
def checks_only():
    """Inside the block, `generate` validates its inputs (raising what it would raise) and returns without running
    the model: the string entry point checks a call this way before token healing runs its own forwards."""
    token = _CHECKS_ONLY.set(True)
    try:
        yield
    finally:
        _CHECKS_ONLY.reset(token)


@torch.no_grad()
def generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    synced_gpus: bool | None = None,
    streamer=None,
    vegas_config: VegasConfig | dict | None = None,
    vegas_gamma: int | None = None,
    vegas_sparsity: float | None = None,
    vegas_min_tokens: int | None = None,
    vegas_budget_boost: float | None = None,
    vegas_score: str | None = None,
    vegas_policy: str | None = None,
    vegas_selection_heads: str | None = None,
    vegas_tp_all_reduce: str | None = None,
    vegas_backend: str | None = None,
    vegas_cuda_graphs: bool | None = None,
    vegas_compile: bool | None = None,
    vegas_fuse_projections: bool | None = None,
    **model_kwargs,
):
    r"""
    Vegas self-speculative decoding loop. Pass it to `generate` as `custom_generate=hf_vegas.generate`; transformers
    prepares the inputs, logits processors and stopping criteria, then hands the decoding over to this function.

    Args:
        vegas_config (`VegasConfig` or `dict`, *optional*): all Vegas settings at once.
        vegas_gamma, vegas_sparsity, vegas_min_tokens, vegas_budget_boost, vegas_score, vegas_policy,
            vegas_selection_heads, vegas_tp_all_reduce, vegas_backend, vegas_cuda_graphs, vegas_compile,
            vegas_fuse_projections (*optional*):
            override single fields of `vegas_config` (see [`VegasConfig`]).

    Returns:
        `torch.LongTensor` of shape `(batch, length)`, or a [`VegasGenerateOutput`] with
        `return_dict_in_generate=True`.
    """
    config = resolve_config(
        vegas_config, vegas_gamma=vegas_gamma, vegas_sparsity=vegas_sparsity, vegas_min_tokens=vegas_min_tokens,
        vegas_budget_boost=vegas_budget_boost, vegas_score=vegas_score, vegas_policy=vegas_policy,
        vegas_selection_heads=vegas_selection_heads, vegas_tp_all_reduce=vegas_tp_all_reduce,
        vegas_backend=vegas_backend, vegas_cuda_graphs=vegas_cuda_graphs,
        vegas_compile=vegas_compile, vegas_fuse_projections=vegas_fuse_projections,
    )
    # transformers does not forward `streamer` or `synced_gpus` to custom_generate callables; take them from its
    # generate call.
    if streamer is None:
        streamer = compat.generate_call_argument("streamer")
    if synced_gpus is None:
        synced_gpus = compat.generate_call_argument("synced_gpus")
    validation.check_synced_gpus(model, synced_gpus)
    validation.check_model(model)
    validation.check_generation_config(generation_config, logits_processor)
    validation.check_model_kwargs(model_kwargs)
    # The prompt is `input_ids`, or `inputs_embeds` (then `input_ids` holds only what the history starts with,
    # usually nothing, as in vanilla); a user's prefilled cache (`compat.CACHE_KEYWORD`) covers its first positions.
    inputs_embeds = model_kwargs.get("inputs_embeds")
    prompt = input_ids if inputs_embeds is None else inputs_embeds[..., 0]
    left_pad = validation.left_padding(prompt, model_kwargs.get("attention_mask"))
    validation.check_position_ids(model_kwargs.get("position_ids"), left_pad, prompt.shape[1])
    prefix = prompt_cache.checked(model_kwargs.get(compat.CACHE_KEYWORD), prompt.shape[1], input_ids.shape[0])
    validation.check_streamer(streamer, input_ids.shape[0])
    backend_name = backend.resolve_backend(config.backend, input_ids.device, model.dtype)

    max_new = generation_config.max_length - input_ids.shape[1]
    if max_new <= 0:
        return _finish(input_ids, None, generation_config, streamer)
    real_len = prompt.shape[1] - left_pad
    # A row ends at most at prompt + max_new + gamma committed slots (it can stop inside its last chunk) and rows
    # that ended keep being drafted and verified, gamma + 1 slots further, until the whole batch ends.
    capacity = int(real_len.max()) + max_new + 2 * config.max_gamma + 1
    validation.check_layers(model, capacity, config)
    group = tensor_parallel.score_group(model) if config.selection_heads == "all" else None
    symmetric = config.tp_all_reduce == "symmetric_memory"
    if symmetric:
        symmetric_all_reduce.check(model, input_ids.device)
    if _CHECKS_ONLY.get():
        return input_ids
    # Layers on several devices (`device_map`): each device's layers read their copy of the plan and selection.
    devices = placement.layer_devices(model)
    pooled = graphs.cache_for(model, input_ids.shape[0], capacity, config, input_ids.device, backend_name, devices)
    fusing = backend_name == "triton" and config.fuse_projections and not _spread(devices, input_ids.device, config)
    recorder = StepRecorder(
        scores=bool(generation_config.return_dict_in_generate and generation_config.output_scores),
        logits=bool(generation_config.return_dict_in_generate and generation_config.output_logits),
    )
    with (placement.device_guard(input_ids.device), pooled as (cache, step_graphs), vegas_attention(model),
          active_cache(cache),
          symmetric_all_reduces(model, input_ids.shape[0] * (config.max_gamma + 1), input_ids.device, symmetric,
                                draft_rows=input_ids.shape[0] if fusing else 0) as exchange,
          fused_steps(model, cache, fusing, exchange) as fused_layers,
          rotary_tables_once(model, enabled=config.compile,
                             skip=lambda: fused_layers > 0 and cache.plan.mode == "draft"),
          weights_left_linears(model, enabled=cache.eager_ops),
          backward_hooks_set_aside(model, enabled=config.compile)):
        cache.selection.pool_over(group)
        loop = DecodeLoop(model, cache, step_graphs, input_ids, left_pad, max_new, logits_processor, stopping_criteria,
                     generation_config, streamer, recorder)
        sequences, accepted = loop.run(inputs_embeds, prefix)
        gammas = torch.tensor(loop.gammas, dtype=torch.long, device=accepted.device)
    new_tokens = sequences.shape[1] - input_ids.shape[1]
    scores, logits = recorder.tuples(new_tokens, compat.pad_token_tensor(generation_config))
    # A pooled cache (CUDA graphs) belongs to the pool: the next generate call of its bucket overwrites it, and an
    # output that held it would keep gigabytes alive beside the next bucket's cache. Only an own cache is returned.
    own_cache = cache if step_graphs is None else None
    output = VegasGenerateOutput(sequences=sequences, scores=scores, logits=logits, accepted=accepted, gammas=gammas,
                                 **{compat.CACHE_KEYWORD: own_cache})
    return _finish(sequences, output, generation_config, streamer)


def _spread(devices, main, config: VegasConfig) -> bool:
    """Whether some layer sits on another device than the inputs (`main`); says once that the projections are not
    fused there (their fused layers and one-launch kernels assume one device)."""
    reason = placement.spread_reason(devices, main)
    if reason is not None and config.fuse_projections:
        graphs.log_once(logging.INFO, f"hf_vegas runs the model's own projections: {reason}.")
    return reason is not None


def _finish(sequences, output, generation_config, streamer):
    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        if output is None:  # nothing to generate
            output = VegasGenerateOutput(sequences=sequences, accepted=sequences.new_zeros(sequences.shape[0], 0),
                                         gammas=torch.zeros(0, dtype=torch.long, device=sequences.device),
                                         scores=() if generation_config.output_scores else None,
                                         logits=() if generation_config.output_logits else None)
        return output
    return sequences
