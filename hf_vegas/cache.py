"""`VegasCache`: a static, preallocated KV cache for batched Vegas decoding.

Layout. Every attention layer owns `keys`/`values` of shape `(batch, capacity + 1, kv_heads, head_dim)` ("NHD":
one token's keys for all KV heads are contiguous, which is what a gather of selected tokens wants); `update` hands
transformers the `(batch, kv_heads, slots, head_dim)` view it documents. On the CPU (`ops.eager`) the same view sits
over heads-first storage, so a head's slots are contiguous for SDPA as in vanilla's cache. Row `b` holds
its real tokens in slots `[0, lengths[b])`, with no padding: a token's slot is its position. The extra last slot is
a scratch sink for the left-padding of a batched prefill.

The cache stores; two objects it holds say what to store and read. `plan` (`hf_vegas.step_plan.StepPlan`): the rows'
lengths and the current forward's layout, declared with `begin` before each forward and laid out at layer 0's
`update`. `selection` (`hf_vegas.selection_state.SelectionState`): the slots each sparse layer's next draft
reads. After acceptance the generate loop rolls rows back with `plan.rollback(new_lengths)`; HF's assisted loop
uses `crop`. A model whose layers sit on several devices (`hf_vegas.placement`) gets a copy of both per other device,
which follows the cache's own at the first of that device's layers each forward reaches; `state(layer)` says which a
layer reads.
"""

from __future__ import annotations

import torch
from hf_vegas_kernels import naive
from transformers.cache_utils import Cache, CacheLayerMixin

from . import placement
from .config import VegasConfig
from .ops import backend as backends, eager
from .selection_state import SelectionState
from .step_plan import StepPlan

# Forwards of at most this many tokens per row write their keys and values with the Triton kernel (Triton backend).
KERNEL_WRITE_TOKENS = 64


class VegasLayer(CacheLayerMixin):
    """One layer's static key/value buffers. It reads the rows' layout from the step plan it shares with the other
    layers (and holds no reference to the cache, so a cache is freed as soon as it is dropped)."""

    is_compileable = True
    is_croppable = True

    def __init__(self, plan: StepPlan, is_sliding: bool, heads_first: bool, ops):
        super().__init__()
        self.plan = plan
        self.is_sliding = is_sliding
        self.heads_first = heads_first  # storage order of the CPU path (`ops.eager`)
        self.ops = ops  # the cache's ops (`VegasCache.ops`): the kernels write decode-sized forwards in one launch

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, head_dim = key_states.shape
        if batch != self.plan.batch_size:
            raise ValueError(f"VegasCache was built for batch {self.plan.batch_size}, got a forward of batch {batch}.")
        slots = self.plan.capacity + 1

        def buffer(like: torch.Tensor) -> torch.Tensor:
            if self.heads_first:
                # Stored heads-first, `(B, H, S, D)`, behind the same `(B, S, H, D)` view: the CPU path reads a head's
                # slots as one contiguous run, as SDPA and vanilla's cache do.
                stored = torch.zeros(batch, heads, slots, like.shape[-1], dtype=like.dtype, device=like.device)
                return stored.transpose(1, 2)
            return torch.zeros(batch, slots, heads, like.shape[-1], dtype=like.dtype, device=like.device)

        self.keys, self.values = buffer(key_states), buffer(value_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # (B, T) slots; pads point at the scratch slot. Decode-sized forwards write with one kernel for K and V;
        # a prefill (once per generation) keeps the two index_put kernels.
        ops = self.ops if key_states.shape[2] <= KERNEL_WRITE_TOKENS else naive
        ops.write_kv(self.keys, self.values, key_states, value_states, self.plan.write_slots)
        # Transformers' documented layout, `(batch, kv_heads, slots, head_dim)`, as a view of the storage: models that
        # work on the keys or values between `update` and attention (DiffLlama splits the value heads) see what
        # they expect, and the "vegas" attention turns the view back without a copy.
        return self.keys.transpose(1, 2), self.values.transpose(1, 2)

    def get_seq_length(self) -> int:
        return int(self.plan.lengths.max().item())

    def get_max_length(self) -> int:
        return self.plan.capacity

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.plan.capacity + 1, 0

    def crop(self, tokens_to_remove: int) -> None:  # rows are cropped once, by the cache
        pass

    def reset(self) -> None:
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()


class VegasCache(Cache):
    r"""
    Static KV cache for Vegas self-speculative decoding.

    Args:
        config (`PretrainedConfig`): the model config (its text config is used for the layer count and types).
        batch_size (`int`): number of rows.
        capacity (`int`): slots per row: the longest prompt + max_new_tokens + 2 * gamma + 1 (see `hf_vegas.decoding`).
        vegas_config (`VegasConfig`): selection policy and budget.
        device (`torch.device`): where the row bookkeeping lives (the KV buffers follow the model's tensors).
        backend (`str`, *optional*, defaults to `"torch"`): the resolved attention ops, `"torch"` (naive) or
            `"triton"` (see `hf_vegas.ops.backend.resolve_backend`).
        reach (`int`, *optional*, defaults to `capacity`): positions the generation can reach; sliding windows at least
            this long are treated as full attention.
        layer_devices (`list[torch.device]`, *optional*): each layer's device, for a model whose layers sit on several
            devices (`hf_vegas.placement.layer_devices`); by default every layer is on `device`.
    """

    def __init__(self, config, batch_size: int, capacity: int, vegas_config: VegasConfig, device=None,
                 backend: str = "torch", reach: int | None = None, layer_devices=None):
        if backend not in ("torch", "triton"):
            raise ValueError(
                f"VegasCache backend must be 'torch' or 'triton' (resolve 'auto' first), got {backend!r}."
            )
        text_config = config.get_text_config(decoder=True)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.backend = backend
        self.eager_ops = uses_eager_ops(backend, self.device)
        # The ops every forward runs (one signature for all, `hf_vegas.ops.backend`): the kernels, or the plain-PyTorch
        # ops that also run what the kernels do not take (`torch_ops`: forwards too wide for their tiles).
        self.torch_ops = eager if self.eager_ops else naive
        self.ops = backends.kernels() if self.backend == "triton" else self.torch_ops
        # Positions this generation reaches: a sliding window at least as long is full attention (`layer_types`).
        self.reach = reach if reach is not None else capacity
        types = layer_types(text_config, self.reach)
        self.capacity = capacity
        self.vegas_config = vegas_config
        # The layers that draft sparsely and select: full attention, and windows long enough to pay (the others
        # draft with their whole window).
        windows = sparse_layers(text_config, vegas_config, self.reach)
        devices = [torch.device(d) for d in layer_devices] if layer_devices is not None else [self.device] * len(types)
        if len(devices) != len(types):
            raise ValueError(f"layer_devices names {len(devices)} devices for {len(types)} layers.")
        self.layer_devices = devices

        def state(device: torch.device) -> tuple[StepPlan, SelectionState]:
            mine = {i for i, d in enumerate(devices) if d == device}
            return StepPlan(batch_size, capacity, device), SelectionState(
                vegas_config, len(types), windows, batch_size, capacity, device, own_layers=mine)

        self.plan, self.selection = state(self.device)
        # Other devices' copies, each refreshed at the first of its layers a forward reaches (`begin_layer`: not a
        # fixed layer, as a model may skip some layers' cache, e.g. Mllama's cross-attention without images).
        copies = {d: state(d) for d in dict.fromkeys(devices) if d != self.device}
        self._states = [(self.plan, self.selection), *copies.values()]
        self._layer_state = [copies.get(d, self._states[0]) for d in devices]
        self._copy_of_layer = {i: copies[d] for i, d in enumerate(devices) if d in copies}
        # The copies that have not yet followed the current forward. Host state touched only for a spread model, whose
        # steps run eagerly: a counter bumped every forward would fail dynamo's guards and recompile every compiled
        # step.
        self._behind: list[tuple[StepPlan, SelectionState]] = []
        super().__init__(layers=[VegasLayer(self._layer_state[i][0], t == "sliding_attention", self.eager_ops,
                                            self.ops) for i, t in enumerate(types)])

    # -- step protocol -------------------------------------------------------------------------------------------
    def begin(self, mode: str, left_pad: torch.Tensor | None = None, verify_end: torch.Tensor | None = None,
              selects: bool = True) -> None:
        """Declare what the next forward is (`StepPlan.begin`); a draft needs a selection to read."""
        if mode == "draft" and not any(sel.has_selection for _, sel in self._states):
            raise RuntimeError("A draft forward needs a selection: run a prefill or verify forward first.")
        self.plan.begin(mode, left_pad, verify_end, selects)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self.begin_layer(layer_idx, key_states.shape[2])
        if not self._copy_of_layer:
            return self.layers[layer_idx].update(key_states, value_states)
        with self.device_guard(layer_idx):
            return self.layers[layer_idx].update(key_states, value_states)

    def begin_layer(self, layer_idx: int, num_tokens: int) -> None:
        """Before a layer writes its keys: layer 0 lays out the forward's `num_tokens` tokens for every layer (and what
        it selects from). A fused layer (`hf_vegas.fused_layers`), which writes its keys itself, calls it in place of
        `update`."""
        if layer_idx == 0:
            self.plan.lay_out(num_tokens)
            self.selection.prepare(self.plan, num_tokens)
        if not self._copy_of_layer:
            return
        if layer_idx == 0:
            self._behind = list(self._states[1:])
        copy = self._copy_of_layer.get(layer_idx)
        if copy in self._behind:  # its device's first layer this forward reached (copies compare by identity)
            copy[0].follow(self.plan)
            copy[1].follow(self.selection)
            self._behind.remove(copy)

    # -- layers on several devices (`hf_vegas.placement`) --------------------------------------------------------
    @property
    def spread(self) -> bool:
        """Whether some layer sits on another device than the cache's own (the inputs')."""
        return bool(self._copy_of_layer)

    def state(self, layer_idx: int) -> tuple[StepPlan, SelectionState]:
        """The step plan and selection that layer `layer_idx` reads (on its device)."""
        return self._layer_state[layer_idx]

    def states(self) -> list[tuple[StepPlan, SelectionState]]:
        """Every device's step plan and selection, this cache's own first."""
        return self._states

    def holds_row_scores(self) -> bool:
        """Whether a deferring policy's verification left each scored row's scores for acceptance to choose from
        (`attention.select_from_rows`)."""
        return any(sel.row_scores for _, sel in self._states)

    def device_guard(self, layer_idx: int):
        """Layer `layer_idx`'s device made current, so that its kernels launch there."""
        return placement.device_guard(self.layer_devices[layer_idx])

    # -- transformers Cache API ----------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        # HF's own loops (batch 1) slice their inputs with this; it is the longest row.
        return int(self.plan.lengths.max().item())

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.capacity + 1, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def crop(self, tokens_to_remove: int) -> None:
        self.plan.crop(tokens_to_remove)

    def activate_past_recording(self, **options) -> None:
        # Every slot stays in the buffer until overwritten, so rollback never needs a recording. transformers 5.25's
        # assisted loop passes `recurrent_states_to_keep` (for recurrent layers' states: a VegasCache holds none).
        pass

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.restart()

    def restart(self) -> None:
        """Empty every row for a new generation, keeping the buffers (and any graph captured over them).

        Stale keys and values stay in the buffers: no op reads a slot at or beyond its row's length.
        """
        for plan, selection in self._states:
            plan.restart()
            selection.restart()

    @property
    def batch_size(self) -> int:
        return self.plan.batch_size


def uses_eager_ops(backend: str, device: torch.device) -> bool:
    """Whether the plain-PyTorch ops are `ops.eager` (the CPU path: reads lengths on the host, gathers what a draft
    reads) rather than `hf_vegas_kernels.naive` (shape-static, graph-safe)."""
    return backend == "torch" and device.type == "cpu"


def sparse_layers(text_config, config: VegasConfig, reach: int | None = None) -> dict[int, int | None]:
    """The layers whose drafts read a selection, each with the window its drafts stay inside (None: full attention).

    Every full-attention layer (a window at least `reach` long is one, see `layer_types`), and every sliding-window
    layer whose window is long enough for the budget to pay (`VegasConfig.drafts_window_sparsely`): Mistral v0.1's
    4096 under a longer context drafts from a budget of its window's slots, while Gemma-3's 512 and gpt-oss' 128
    draft with their whole window.
    """
    window = getattr(text_config, "sliding_window", None)
    sparse = {}
    for i, kind in enumerate(layer_types(text_config, reach)):
        if kind != "sliding_attention":
            sparse[i] = None
        elif isinstance(window, int) and config.drafts_window_sparsely(window):
            sparse[i] = window
    return sparse


def layer_types(text_config, reach: int | None = None) -> list[str]:
    """Each layer's attention type for a generation whose positions stay below `reach`.

    Without `layer_types`, a config with `sliding_window` set (Mistral, Phi-3, StarCoder2) gives every layer that
    window, as those models pass it to every attention call. A window of at least `reach` positions never cuts
    anything (Phi-3-128k's 262144, Mistral-v0.1's 4096 under a 4K context), so such a layer is full attention: it
    is drafted sparsely like any other.
    """
    num_layers = text_config.num_hidden_layers
    types = getattr(text_config, "layer_types", None)
    window = getattr(text_config, "sliding_window", None)
    if types:
        types = list(types[:num_layers])
    else:
        types = ["sliding_attention" if window is not None else "full_attention"] * num_layers
    if reach is not None and window is not None and window >= reach:
        types = ["full_attention" if t == "sliding_attention" else t for t in types]
    return types
