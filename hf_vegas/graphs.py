"""CUDA graphs for the steps of a Vegas iteration, and the pool that keeps them between `generate` calls.

A Vegas iteration is gamma one-token forwards, each followed by processing its logits and choosing a token, one
(gamma + 1)-token forward, and the acceptance. Run eagerly, each forward costs the Python and launch time of a whole
HF forward (hundreds of kernel launches), and each token choice or acceptance tens of launches more, which for long
batches is several times what their memory traffic needs. Captured once and replayed, a step costs one launch:

    draft    gamma forwards and token choices, sampling included (`StepRunner.draft`)
    verify   the verification forward (dense decoding: the one-token "decode" forward)
    accept   logits processing, acceptance and the length/EOS cut (`loop.DecodeLoop._accept`)

Processors that read the history (a repetition penalty) and stopping criteria other than length and EOS need the
host: with them a draft is gamma one-forward graphs and the acceptance runs eagerly.

What makes capture possible: every forward reads its per-row state from `VegasCache` tensors that are only ever
written in place, takes its positions from the step plan's `lengths` on the device, and never synchronises with the
host (the kernels get host-side sizes from the cache's capacity, never from the data); sampling draws from the
default CUDA generator, whose Philox offsets a replay advances as the eager ops would. Each step kind, keyed by what
it bakes in (cache mode, tokens, logits kept, processor settings, ...), goes through three stages:

    1st call   eager: its real result, and the warm-up (Triton compiles, lazily built buffers get allocated)
    2nd call   (with `compile`) compiled forwards, which compiles them; else straight to the capture
    next call  capture (records the step, executes nothing), then replay
    later      copy the inputs into the graph's static buffers (not those that are another graph's outputs), replay

Graphs capture the addresses of the cache buffers and the model's weights, so the cache they were captured over is
kept, per model, for the next `generate` call of the same bucket (batch, capacity rounded up, config, weight
addresses, autocast); `release_graphs()` frees it. What the bucket cannot see needs a `release_graphs(model)` before
the next call: weights changed by swapping modules (adapters switched on or off), new forward hooks, config edits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import math
import types
import weakref

import torch

from . import placement, selection, symmetric_all_reduce
from .cache import VegasCache, layer_types
from .config import VegasConfig

logger = logging.getLogger(__name__)

# Inductor computes a fused kernel's intermediates in fp32 and, by default, skips the rounding a cast to bf16 between
# two fused ops would do in eager PyTorch. The verification (gamma + 1 tokens) and the dense decode (1 token) compile
# into different fusions, so their bf16 logits then round apart: on an H100, SmolLM2 at 64 x 7.5K greedy, Vegas kept
# our dense path's tokens in 23 to 26 of 64 rows. Rounding where eager rounds brings it back to 64 of 64 at the same
# iteration time (17.26 ms against 17.07-17.15, `benchmarks/results/throughput.jsonl`).
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}

# Capacities are rounded up to this many slots, so prompts of similar lengths share a cache and its graphs.
CAPACITY_BUCKET = 1024

_LOGGED: set[str] = set()


def log_once(level: int, message: str) -> None:
    """Log `message` on the `hf_vegas` logger once per process (a reason something is off, not per call)."""
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.log(level, message)


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple  # static inputs, copied into before each replay (unless the caller passes them themselves)
    outputs: object  # static outputs (a tensor or a tuple of tensors and Nones), overwritten by each replay


# Stages of a step kind before its capture: ran eagerly once; (with `compile`) ran compiled once, which compiles.
_WARM, _COMPILED = object(), object()


class StepGraphs:
    """The captured steps of one `VegasCache`, each in a memory pool of its own.

    A shared pool needs, at the least, the graphs to replay in the order they were captured: the memory a graph frees
    during its capture (its intermediates) may hold the outputs of a graph captured after it, and each replay of the
    earlier graph writes over them. A later `generate` call of the same bucket breaks that order: sampling after
    greedy decoding captures its draft step after the verification that both share, and the verification then
    overwrote the drafts and their scores before the acceptance read them (seen on an H100 as out-of-range draft
    tokens, and as every draft accepted). Private pools cost each graph its own intermediates (the peak memory of
    `benchmarks/throughput.py` records includes them) and keep every output intact until its own graph replays.

    A step is a function of tensors that returns a tensor or a tuple of them: a single forward (verify, dense
    decode), the gamma forwards of a draft with their token choices, or the acceptance of a verification.
    With `compile`, each model forward inside a step is `torch.compile`d before the capture (`compiling` tells the
    step when), whole: the cache update, the attention and the selection are traced too, their kernels as custom
    ops (`hf_vegas_kernels.ops`). Inductor fuses the norms, rotary embedding, activations and residual adds of every
    layer, which otherwise cost one small kernel each (about 1 200 per SmolLM2 forward). A step kind compiles once:
    the forward holds no graph break, so no layer recompiles it; a bucket compiles its draft, verification (per
    gamma) and dense forwards, within dynamo's default recompile limit (see `compiled`).

    What a graph reads must outlive it: the pooled cache, the model's weights and the step's static inputs. Anything
    else a step bakes in (a processor's temperature, a generation's length budget) must be in its key or an input.
    """

    def __init__(self, compile: bool = False):
        self.compile = compile
        self.compiling = False  # True while a step runs for its compilation or its capture
        self._compiled = None  # this bucket's compiled forward (`compiled`)
        self._steps: dict[tuple, object] = {}
        self._outputs: set[int] = set()  # ids of the captured steps' output tensors (static, alive with their step)
        self.disabled_reason: str | None = None
        self.captures = 0
        self.replays = 0
        # Steps run on their way to a graph (the eager warm-up, the compilation, the capture): their times are not a
        # replay's (`gamma="auto"` times only iterations without them).
        self.preparations = 0

    def run(self, key: tuple, step, *inputs):
        """`step(*inputs)` through the graph of the step kind `key`.

        A replay returns the graph's static outputs: read them before the step kind runs again. An input that is
        another step's static output is read in place; any other is copied into the graph's own buffer.
        """
        if self.disabled_reason is not None:
            return step(*inputs)
        state = self._steps.get(key)
        if not isinstance(state, _Captured):
            self.preparations += 1
        if state is None:
            self._steps[key] = _WARM
            return step(*inputs)
        if state is _WARM and self.compile:  # compiling runs and benchmarks kernels: never inside a capture
            self._steps[key] = _COMPILED
            with self._compiling():
                return step(*inputs)
        if state is _WARM or state is _COMPILED:
            state = self._capture(key, step, inputs)
            if state is None:
                return step(*inputs)
        for static, given in zip(state.inputs, inputs):
            if static is not given and given is not None:
                static.copy_(given)
        state.graph.replay()
        self.replays += 1
        return state.outputs

    def compiled(self, forward):
        """`forward` (a bound method) compiled while a step compiles or is captured with `compile` on, else itself.

        Dynamo keeps its compilations, and its recompile limit (8), per code object: one function shared by every
        bucket would stop compiling after a few buckets (each compiles its draft, verification per gamma and dense
        forwards). So each `StepGraphs` (one bucket) compiles its own copy of the function's code.
        """
        if not (self.compile and self.compiling):
            return forward
        if self._compiled is None:
            function = forward.__func__
            copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                                      function.__defaults__, function.__closure__)
            self._compiled = torch.compile(copy, dynamic=False, options=INDUCTOR_OPTIONS)
        return functools.partial(self._compiled, forward.__self__)

    @contextlib.contextmanager
    def _compiling(self):
        self.compiling = True
        try:
            yield
        finally:
            self.compiling = False

    def _capture(self, key: tuple, step, inputs: tuple) -> _Captured | None:
        static = tuple(t if t is None or id(t) in self._outputs else t.clone() for t in inputs)
        try:
            graph = torch.cuda.CUDAGraph()
            with self._compiling(), torch.cuda.graph(graph):  # a private pool: see the class docstring
                outputs = step(*static)
        except Exception as error:  # noqa: BLE001  (any op of any model may refuse capture; eager always works)
            _release_the_random_generator()
            self.disabled_reason = f"capturing the {key[0]} step failed ({type(error).__name__}: {error})"
            log_once(logging.WARNING, f"hf_vegas runs its steps eagerly: {self.disabled_reason}")
            return None
        captured = _Captured(graph, static, outputs)
        self._outputs.update(id(t) for t in (outputs if isinstance(outputs, tuple) else (outputs,)) if t is not None)
        self._steps[key] = captured
        self.captures += 1
        return captured


def _release_the_random_generator() -> None:
    """Put CUDA's default random generator back after a capture that failed midway.

    A capture marks the generator as capturing when it begins and unmarks it only when it ends cleanly: after a
    failed one, every later random op of the process (the eager steps' sampling, and the user's own code) raises
    "Offset increment outside graph capture encountered unexpectedly". One clean capture of a no-op unmarks it.
    """
    if not torch.cuda.is_available():  # nothing was captured (the CPU tests drive the fallback with a fake failure)
        return
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.zeros(1, device="cuda")
        del graph
    except Exception as error:  # noqa: BLE001  (the steps still run eagerly; only random ops would be refused)
        log_once(logging.WARNING, f"hf_vegas could not reset CUDA's random generator after the failed capture "
                  f"({type(error).__name__}: {error}); random ops of this process may raise")


@dataclasses.dataclass
class _PoolEntry:
    key: tuple
    cache: VegasCache
    graphs: StepGraphs
    busy: bool = False  # a generation is using the cache


_POOL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def no_graph_reason(config: VegasConfig, device: torch.device, layer_devices=None) -> str | None:
    """Why this generation's steps cannot be captured, or None when they can (`layer_devices`: each layer's, for a
    model on several devices)."""
    if not config.cuda_graphs:
        return "vegas_cuda_graphs=False"
    if torch.device(device).type != "cuda":
        return f"CUDA graphs need a CUDA device, the model is on {torch.device(device).type}"
    return placement.spread_reason(layer_devices, device) or selection.policy(config.policy).no_graph_reason


@contextlib.contextmanager
def cache_for(model, batch: int, capacity: int, config: VegasConfig, device, backend: str, layer_devices=None):
    """`(cache, graphs)` for one generation, held for the block: the pooled pair of this bucket, or a new one
    (`layer_devices`: each layer's device, for a model on several devices, whose steps run eagerly).

    `graphs` is None (eager) when the steps cannot be captured (the reason is logged once), and also while another
    generation on the same model holds the pooled cache (a streamer or thread calling `generate` again).
    """
    reason = no_graph_reason(config, device, layer_devices)
    entry = _POOL.get(model)
    if reason is None and entry is not None and entry.busy:
        reason = "another generate call on this model holds its pooled cache"
    if reason is not None:
        if config.compile:
            log_once(logging.WARNING, f"vegas_compile=True has no effect: {reason}.")
        elif config.cuda_graphs:
            log_once(logging.INFO, f"hf_vegas runs its steps eagerly: {reason}.")
        if entry is not None and not entry.busy:
            del entry
            release_graphs(model)  # an idle pooled cache would hold its memory next to this one
        yield VegasCache(model.config, batch, capacity, config, device=device, backend=backend,
                         layer_devices=layer_devices), None
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
    """Addresses of every parameter and buffer: graphs read them, so moved weights (`.to`, reloading) need new ones.
    Under tensor parallelism a parameter is a `DTensor`, whose own `data_ptr()` is 0: its rank's shard is read."""
    return tuple(_local(t).data_ptr() for t in (*model.parameters(), *model.buffers()))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor (torch.distributed.tensor)
    return to_local() if to_local is not None else tensor


def release_graphs(model=None) -> None:
    r"""
    Free the cache and CUDA graphs kept for `model`'s next `generate` call (for every model when `model` is None).

    Vegas keeps them so that the next call of the same shape bucket replays without capturing again; the cache of a
    batch-64 long-context generation can be many gigabytes. Graphs replay the kernels as they were launched at
    capture: after changing the kernels' launch settings (`hf_vegas_kernels._launch`, as the benchmarks' `--tuning`
    does), release them so that the next call captures its steps again. Without `model` it also frees the buffers
    that `vegas_tp_all_reduce="symmetric_memory"` keeps for the graphs: under tensor parallelism call it on every
    rank before `destroy_process_group`.
    """
    if model is None:
        _POOL.clear()
        symmetric_all_reduce.release_buffers()
    elif _POOL.pop(model, None) is None:
        return
    gc.collect()  # whatever of the released generation sits in a reference cycle (the cache itself holds none)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
