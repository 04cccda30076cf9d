"""CUDA graphs for the draft, verify and dense-decode forwards, and the pool that keeps them between `generate` calls.

A Vegas iteration is gamma one-token forwards and one (gamma + 1)-token forward. Run eagerly, each costs the
Python and launch time of a whole HF forward (hundreds of kernel launches), which for long batches is several times
the time its memory traffic needs. Captured once and replayed, a forward costs one launch.

What makes capture possible: every forward reads its per-row state from `VegasCache` tensors that are only ever
written in place, takes its positions from `cache.lengths` on the device, and never synchronises with the host (the
kernels get host-side sizes from the cache's capacity, never from the data). Each step kind, keyed by
`(cache mode, tokens, logits kept)`, goes through three stages:

    1st call   eager: its real result, and the warm-up (Triton compiles, lazily built buffers get allocated)
    2nd call   capture (records the forward, executes nothing), then replay
    later      copy the input ids into the graph's static buffer, replay

Graphs capture the addresses of the cache buffers and the model's weights, so the cache they were captured over is
kept, per model, for the next `generate` call of the same bucket (batch, capacity rounded up, config, weight
addresses, autocast); `release_graphs()` frees it. What the bucket cannot see needs a `release_graphs(model)` before
the next call: weights changed by swapping modules (adapters switched on or off), new forward hooks, config edits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import weakref

import torch

from . import selection
from .cache import VegasCache, layer_types
from .config import VegasConfig

logger = logging.getLogger(__name__)

# Capacities are rounded up to this many slots, so prompts of similar lengths share a cache and its graphs.
CAPACITY_BUCKET = 1024

_LOGGED: set[str] = set()


def _log_once(level: int, message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.log(level, message)


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # static input, copied into before each replay
    logits: torch.Tensor  # static output, overwritten by each replay


# Stages of a step kind before its capture: ran eagerly once; (with `compile`) ran compiled once, which compiles.
_WARM, _COMPILED = object(), object()


class StepGraphs:
    """The captured forwards of one `VegasCache`. Graphs share one memory pool: their steps never overlap.

    With `compile`, each forward is `torch.compile`d before its capture (the cache update and the attention stay
    eager, see `torch.compiler.disable` on them): inductor fuses the norms, rotary embedding, activations and residual
    adds of every layer, which otherwise cost one small kernel each (about 1 200 per SmolLM2 forward).
    """

    def __init__(self, compile: bool = False):
        self.compile = compile
        self.pool = None  # made at the first capture
        self._steps: dict[tuple, object] = {}
        self.disabled_reason: str | None = None
        self.captures = 0
        self.replays = 0

    def run(self, key: tuple, ids: torch.Tensor, forward) -> torch.Tensor:
        """`forward(ids)` (eager, returns logits) through the step kind `key`'s graph.

        A replay returns the graph's static logits: read them before the next `run`.
        """
        if self.disabled_reason is not None:
            return forward(ids)
        step = self._steps.get(key)
        if step is None:
            self._steps[key] = _WARM
            return forward(ids)
        if step is _WARM and self.compile:  # compiling runs and benchmarks kernels: never inside a capture
            self._steps[key] = _COMPILED
            with _dynamo_settings():
                return self._compiled(forward)(ids)
        if step is _WARM or step is _COMPILED:
            step = self._capture(key, ids, self._compiled(forward) if self.compile else forward)
            if step is None:
                return forward(ids)
        step.ids.copy_(ids)
        step.graph.replay()
        self.replays += 1
        return step.logits

    @staticmethod
    def _compiled(forward):
        # dynamo caches by code object: every step closure of a shape reuses one compilation
        return torch.compile(forward, dynamic=False)

    def _capture(self, key: tuple, ids: torch.Tensor, forward) -> _Captured | None:
        static_ids = ids.clone()
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with _dynamo_settings(), torch.cuda.graph(graph, pool=self.pool):
                logits = forward(static_ids)
        except Exception as error:  # noqa: BLE001  (any op of any model may refuse capture; eager always works)
            self.disabled_reason = f"capturing the {key[0]} forward failed ({type(error).__name__}: {error})"
            _log_once(logging.WARNING, f"hf_vegas runs its steps eagerly: {self.disabled_reason}")
            return None
        captured = _Captured(graph, static_ids, logits)
        self._steps[key] = captured
        self.captures += 1
        return captured


def _dynamo_settings():
    """Dynamo limits while a step compiles or is captured (a context manager; replays never enter dynamo).

    Every layer's attention passes its own `layer_idx` to the (eager) cache update, so dynamo compiles that frame
    once per layer, per step shape and per batch: past its default limit (8) it would run the other layers uncompiled.
    Each compilation happens once, so a high limit only bounds what a process can accumulate.
    """
    return torch._dynamo.config.patch(recompile_limit=4096, accumulated_recompile_limit=16384)


@dataclasses.dataclass
class _PoolEntry:
    key: tuple
    cache: VegasCache
    graphs: StepGraphs
    busy: bool = False  # a generation is using the cache


_POOL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def no_graph_reason(config: VegasConfig, device: torch.device) -> str | None:
    """Why this generation's steps cannot be captured, or None when they can."""
    if not config.cuda_graphs:
        return "vegas_cuda_graphs=False"
    if torch.device(device).type != "cuda":
        return f"CUDA graphs need a CUDA device, the model is on {torch.device(device).type}"
    return selection.policy(config.policy).no_graph_reason


@contextlib.contextmanager
def cache_for(model, batch: int, capacity: int, config: VegasConfig, device, backend: str):
    """`(cache, graphs)` for one generation, held for the block: the pooled pair of this bucket, or a new one.

    `graphs` is None (eager) when the steps cannot be captured (the reason is logged once), and also while another
    generation on the same model holds the pooled cache (a streamer or thread calling `generate` again).
    """
    reason = no_graph_reason(config, device)
    entry = _POOL.get(model)
    if reason is None and entry is not None and entry.busy:
        reason = "another generate call on this model holds its pooled cache"
    if reason is not None:
        if config.compile:
            _log_once(logging.WARNING, f"vegas_compile=True has no effect: {reason}.")
        elif config.cuda_graphs:
            _log_once(logging.INFO, f"hf_vegas runs its steps eagerly: {reason}.")
        if entry is not None and not entry.busy:
            del entry
            release_graphs(model)  # an idle pooled cache would hold its memory next to this one
        yield VegasCache(model.config, batch, capacity, config, device=device, backend=backend), None
        return
    reach, capacity = capacity, math.ceil(capacity / CAPACITY_BUCKET) * CAPACITY_BUCKET
    autocast = torch.is_autocast_enabled(torch.device(device).type)  # captured kernels bake in the dtypes
    # Which sliding windows count as full attention depends on this generation's reach, not on the bucket.
    types = tuple(layer_types(model.config.get_text_config(decoder=True), reach))
    key = (batch, capacity, types, config, backend, str(torch.device(device)), model.dtype, autocast,
           _weights_fingerprint(model))
    if entry is None or entry.key != key:
        del entry  # the last reference: the previous bucket's memory is freed before this one is allocated
        release_graphs(model)
        cache = VegasCache(model.config, batch, capacity, config, device=device, backend=backend, reach=reach)
        _POOL[model] = _PoolEntry(key, cache, StepGraphs(compile=config.compile))
        entry = _POOL[model]
    else:
        entry.cache.restart()
    entry.busy = True
    try:
        yield entry.cache, entry.graphs
    finally:
        entry.busy = False


def pooled_graphs(model) -> StepGraphs | None:
    """The step graphs kept for `model` (their `captures`, `replays`, `disabled_reason`), or None."""
    entry = _POOL.get(model)
    return entry.graphs if entry is not None else None


def pooled_cache(model) -> VegasCache | None:
    """The cache kept for `model`'s next generation of its bucket (outputs do not hold it), or None."""
    entry = _POOL.get(model)
    return entry.cache if entry is not None else None


def _weights_fingerprint(model) -> tuple[int, ...]:
    """Addresses of every parameter and buffer: graphs read them, so moved weights (`.to`, reloading) need new ones."""
    return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))


def release_graphs(model=None) -> None:
    r"""
    Free the cache and CUDA graphs kept for `model`'s next `generate` call (for every model when `model` is None).

    Vegas keeps them so that the next call of the same shape bucket replays without capturing again; the cache of a
    batch-64 long-context generation can be many gigabytes.
    """
    if model is None:
        _POOL.clear()
    elif _POOL.pop(model, None) is None:
        return
    gc.collect()  # a cache and its layers reference each other: only the collector frees them
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
