"""`VegasCache`: a static, preallocated KV cache with per-row lengths and per-(layer, row) draft selections.

Layout. Every attention layer owns `keys`/`values` of shape `(batch, capacity + 1, kv_heads, head_dim)` ("NHD":
one token's keys for all KV heads are contiguous, which is what a gather of selected tokens wants); `update` hands
transformers the `(batch, kv_heads, slots, head_dim)` view it documents. On the CPU (`ops.eager`) the same view sits
over heads-first storage, so a head's slots are contiguous for SDPA as in vanilla's cache. Row `b` holds
its real tokens in slots `[0, lengths[b])`, with no padding: a token's slot is its position. The extra last slot is
a scratch sink for the left-padding of a batched prefill.

Step protocol. A forward of `T` tokens writes, at layer 0's `update`, the new per-row span
`[write_start, lengths)`; every layer then writes its keys into that span and its attention reads `lengths`.
After acceptance the generate loop rolls rows back with `rollback(new_lengths)`; HF's assisted loop uses `crop`.

Static state. Every tensor that outlives one forward (`lengths`, `left_pad`, `verify_end`, the selection) is
allocated once and only ever written in place: a CUDA graph captured over a draft or verify forward reads and
writes the addresses it saw at capture (`hf_vegas.graphs`), so a reassigned attribute would be invisible to it.

Selection. For full-attention layers, verification leaves `sel_idx[layer, b, :sel_count[b]]` (slots chosen among the
candidates `[0, sel_end[b])`); a draft attends to those plus every slot in `[sel_end[b], lengths[b])`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import selection
from .config import VegasConfig
from .ops import backend, reference

# Forwards of at most this many tokens per row write their keys and values with the Triton kernel (Triton backend).
KERNEL_WRITE_TOKENS = 64
MODES = ("prefill", "draft", "verify", "decode")  # "decode": one dense step of the gamma = 0 path, no selection


class VegasLayer(CacheLayerMixin):
    """One layer's static key/value buffers; the row bookkeeping lives in the owning `VegasCache`."""

    is_compileable = True
    is_croppable = True

    def __init__(self, owner: VegasCache, is_sliding: bool):
        super().__init__()
        self.owner = owner
        self.is_sliding = is_sliding

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        owner = self.owner
        batch, heads, _, head_dim = key_states.shape
        if batch != owner.batch_size_:
            raise ValueError(f"VegasCache was built for batch {owner.batch_size_}, got a forward of batch {batch}.")
        slots = owner.capacity + 1

        def buffer(like: torch.Tensor) -> torch.Tensor:
            if owner.eager_ops:
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
        kernel = self.owner.backend == "triton" and key_states.shape[2] <= KERNEL_WRITE_TOKENS
        write = backend.kernels().write_kv if kernel else reference.write_kv
        write(self.keys, self.values, key_states, value_states, self.owner.write_slots)
        # Transformers' documented layout, `(batch, kv_heads, slots, head_dim)`, as a view of the storage: models that
        # work on the keys or values between `update` and attention (DiffLlama splits the value heads) see what
        # they expect, and the "vegas" attention turns the view back without a copy.
        return self.keys.transpose(1, 2), self.values.transpose(1, 2)

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return self.owner.capacity

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.capacity + 1, 0

    def crop(self, tokens_to_remove: int) -> None:  # rows are cropped once, by the owner
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
        backend (`str`, *optional*, defaults to `"torch"`): the resolved attention ops, `"torch"` (reference) or
            `"triton"` (see `hf_vegas.ops.backend.resolve_backend`).
        reach (`int`, *optional*, defaults to `capacity`): positions the generation can reach; sliding windows at least
            this long are treated as full attention.
    """

    def __init__(self, config, batch_size: int, capacity: int, vegas_config: VegasConfig, device=None,
                 backend: str = "torch", reach: int | None = None):
        if backend not in ("torch", "triton"):
            raise ValueError(
                f"VegasCache backend must be 'torch' or 'triton' (resolve 'auto' first), got {backend!r}."
            )
        text_config = config.get_text_config(decoder=True)
        num_layers = text_config.num_hidden_layers
        # Positions this generation reaches: a sliding window at least as long is full attention (`layer_types`).
        self.reach = reach if reach is not None else capacity
        types = layer_types(text_config, self.reach)
        super().__init__(layers=[VegasLayer(self, t == "sliding_attention") for t in types])
        self.batch_size_ = batch_size
        self.capacity = capacity
        self.vegas_config = vegas_config
        self.policy = selection.policy(vegas_config.policy)
        self.backend = backend
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.eager_ops = uses_eager_ops(backend, self.device)
        long = dict(dtype=torch.long, device=self.device)
        self.row_index = torch.arange(batch_size, **long)
        self.lengths = torch.zeros(batch_size, **long)
        # Rows still generating (the loop updates it in place before each iteration): the kernels read nothing for
        # the others (`attend_lengths`), so a batch's last iterations, after most rows have finished, cost less.
        self.row_active = torch.ones(batch_size, dtype=torch.bool, device=self.device)
        self.attend_lengths = torch.zeros(batch_size, **long)
        self.left_pad = torch.zeros(batch_size, **long)
        self._left_pad_set = False
        self.verify_end = torch.zeros(batch_size, **long)
        self.verify_end_given = False
        # Per-forward layout, rebuilt at layer 0 of every forward and read by its layers only.
        self.write_start = torch.zeros(batch_size, **long)
        self.write_slots = torch.zeros(batch_size, 1, **long)
        self.query_slots = torch.zeros(batch_size, 1, **long)
        self.score_rows: torch.Tensor | None = None
        self._score_rows_by_shape: dict[tuple[str, int], torch.Tensor] = {}  # built once, outside any graph capture
        self.prefill_left_pad: list[int] | None = None
        self.mode = "verify"
        # Largest budget any row can need (boosted): the selection buffers are sized once, so no step reallocates.
        self.max_selected = vegas_config.max_budget(capacity)
        # A draft reads the selection plus the tail since `sel_end`: at most gamma accepted tokens and gamma drafts
        # (+1 for prefill's pending token). Kernels size their splits with it; it is a hint, never a cut.
        tail = 2 * vegas_config.gamma + 1
        self.draft_list_len = self.max_selected + tail
        # With a boost, no split of a draft's attention takes more than an unboosted list, so the boosted rows' longer
        # lists run in more programs rather than longer ones (the kernel lasts as long as its longest program).
        self.draft_split_len = vegas_config.budget(capacity) + tail if vegas_config.budget_boost > 1 else None
        # Per row, a running average of "the last verification rejected a draft", which scales its budget.
        self.rejection = torch.zeros(batch_size, dtype=torch.float32, device=self.device)
        self.sel_idx = torch.zeros(num_layers, batch_size, self.max_selected, **long)
        self.sel_count = torch.zeros(batch_size, **long)
        self.sel_end = torch.zeros(batch_size, **long)
        self.has_selection = False
        # A deferring policy (`last_token`): head-averaged scores of every scored verify row, until acceptance.
        self.row_scores: dict[int, torch.Tensor] = {}
        self._layer_scores: torch.Tensor | None = None
        # Full-attention layers: the ones that draft sparsely and select (sliding-window layers keep their window).
        self.full_layers = [i for i, layer in enumerate(self.layers) if not layer.is_sliding]
        self.full_layer_index = torch.tensor(self.full_layers, dtype=torch.long, device=self.device)
        # Kernel path: full layers whose scores this forward emitted, selected together at the last full layer.
        self.emitted_layers: list[int] = []
        # Layers that already chose their selection in this forward (a layer may attend twice: DiffLlama).
        self.selected_layers: set[int] = set()

    # -- step protocol -------------------------------------------------------------------------------------------
    def begin(self, mode: str, left_pad: torch.Tensor | None = None, verify_end: torch.Tensor | None = None) -> None:
        """Declare what the next forward is.

        `left_pad` (prefill only) counts each row's leading pad tokens. `verify_end` (verify only) is where each
        row's verified tokens end: the forward's last token lands in slot `verify_end - 1`, whatever prefix of the
        sequence the caller re-feeds (HF's assisted loop feeds the whole prompt with its first verification).
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "draft" and not self.has_selection:
            raise RuntimeError("A draft forward needs a selection: run a prefill or verify forward first.")
        self.mode = mode
        if left_pad is not None:
            self.left_pad.copy_(left_pad)
        elif self._left_pad_set:  # zeroed once after a padded prefill, not before every draft step
            self.left_pad.zero_()
        self._left_pad_set = left_pad is not None
        self.verify_end_given = verify_end is not None
        if verify_end is not None:
            self.verify_end.copy_(verify_end)

    @property
    def selecting(self) -> bool:
        """Whether the current forward chooses the next draft's slots (prefill and verify, when drafting at all)."""
        return self.mode in ("prefill", "verify") and self.vegas_config.gamma > 0

    def _start_forward(self, num_tokens: int) -> None:
        """Called at layer 0: lay out this forward's tokens for every row, once for all layers."""
        if self.mode == "verify" and self.verify_end_given:
            self.write_start = (self.verify_end - num_tokens).clamp_min(0)
        else:
            self.write_start = self.lengths.clone()
        offsets = torch.arange(num_tokens, device=self.device)
        slots = self.write_start[:, None] + offsets[None, :] - self.left_pad[:, None]
        is_pad = offsets[None, :] < self.left_pad[:, None]
        self.write_slots = torch.where(is_pad, self.capacity, slots)  # pads write into the scratch slot
        self.query_slots = slots.clamp_min(0)  # pad queries look at slot 0 only so their softmax stays finite
        self.lengths.copy_(self.write_start + (num_tokens - self.left_pad))
        self.attend_lengths = torch.where(self.row_active, self.lengths, 0)
        self.score_rows = None
        # A prefill into an empty cache lets attention run one causal call per row; the host needs the pads for it
        # (one synchronisation per prefill, never in the draft/verify steps).
        self.prefill_left_pad = None
        self.emitted_layers = []
        self.selected_layers = set()
        if self.mode == "prefill" and not bool(self.write_start.any()):
            self.prefill_left_pad = self.left_pad.tolist()
        if not self.selecting:
            return
        # Verification rates the prefix plus the pending token's slot (the slots every verify row sees); prefill
        # rates the whole prompt, from its last row.
        pending_row = max(num_tokens - self.vegas_config.gamma - 1, 0)
        if self.mode == "prefill":
            self.sel_end.copy_(self.lengths)
        else:
            self.sel_end.copy_(self.write_start + pending_row + 1)
        self.sel_count.copy_(budget_tensor(self.sel_end, self.vegas_config, self.rejection))
        self.score_rows = self._score_rows(num_tokens, pending_row)

    def _score_rows(self, num_tokens: int, pending_row: int) -> torch.Tensor | None:
        """The query rows the policy's scores come from, or None (a host list made a device tensor once per shape)."""
        key = (self.mode, num_tokens)
        if key not in self._score_rows_by_shape:
            rows = self.policy.score_rows(self.mode, num_tokens, pending_row)
            self._score_rows_by_shape[key] = None if rows is None else torch.tensor(rows, device=self.device)
        return self._score_rows_by_shape[key]

    @torch.compiler.disable  # host-side layout logic at layer 0: compiled steps (`vegas_compile`) call it eagerly
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self.begin_layer(layer_idx, key_states.shape[2])
        return self.layers[layer_idx].update(key_states, value_states)

    def begin_layer(self, layer_idx: int, num_tokens: int) -> None:
        """Before a layer writes its keys: layer 0 lays out the forward's `num_tokens` tokens for every layer. A fused
        draft layer (`hf_vegas.draft_layers`), which writes its keys itself, calls it in place of `update`."""
        if layer_idx == 0:
            self._start_forward(num_tokens)

    def note_acceptance(self, accepted: torch.Tensor, active: torch.Tensor) -> None:
        """After a verification: fold whether each active row rejected a draft into its `rejection` average (the
        budget boost reads it). A no-op without a boost."""
        if self.vegas_config.budget_boost > 1:
            rejected = (accepted < self.vegas_config.gamma).to(self.rejection.dtype)
            self.rejection.copy_(torch.where(active, 0.5 * (self.rejection + rejected), self.rejection))

    def rollback(self, new_lengths: torch.Tensor) -> None:
        """Set each row's committed length (drops rejected draft tokens; their slots are overwritten later)."""
        self.lengths.copy_(new_lengths)

    def store_selection(self, layer_idx: int, indices: torch.Tensor) -> None:
        self.sel_idx[layer_idx].copy_(indices)
        self.has_selection = True

    def selection_buffer(self) -> torch.Tensor:
        """`sel_idx` `(L, B, max_selected)`, for ops that write the selection in place."""
        self.has_selection = True
        return self.sel_idx

    def layer_scores(self, num_slots: int) -> torch.Tensor:
        """`(L, B, num_slots)` fp32 scratch where a verification leaves each full layer's scores (kernel path)."""
        if self._layer_scores is None:
            self._layer_scores = torch.empty(
                len(self.layers), self.batch_size_, num_slots, dtype=torch.float32, device=self.sel_idx.device
            )
        return self._layer_scores

    # -- transformers Cache API ----------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        # HF's own loops (batch 1) slice their inputs with this; it is the longest row.
        return int(self.lengths.max().item())

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.capacity + 1, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("VegasCache.crop takes a negative count (tokens to remove), like DynamicCache.")
        self.lengths.copy_((self.lengths + tokens_to_remove).clamp_min(0))

    def activate_past_recording(self) -> None:
        # Every slot stays in the buffer until overwritten, so rollback never needs a recording.
        pass

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.restart()

    def restart(self) -> None:
        """Empty every row for a new generation, keeping the buffers (and any graph captured over them).

        Stale keys and values stay in the buffers: no op reads a slot at or beyond its row's length.
        """
        self.lengths.zero_()
        self.row_active.fill_(True)
        self.rejection.zero_()
        self.has_selection = False
        self.row_scores.clear()
        self.emitted_layers = []

    @property
    def batch_size(self) -> int:
        return self.batch_size_


def uses_eager_ops(backend: str, device: torch.device) -> bool:
    """Whether attention runs `ops.eager` (the CPU path: reads lengths on the host, gathers what a draft reads) rather
    than `ops.reference` (shape-static, graph-safe) or the Triton kernels."""
    return backend == "torch" and device.type == "cpu"


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


def budget_tensor(candidates: torch.Tensor, config: VegasConfig, rejection: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Per-row budget `clamp(ceil(sparsity * n), min_tokens, n)`; float64 so it equals `VegasConfig.budget`. With a
    `budget_boost` and each row's `rejection` average, scaled by `1 + (boost - 1) * rejection` (at most `n`)."""
    n = candidates.to(torch.float64)
    budget = torch.ceil(config.sparsity * n).clamp_min(config.min_tokens)
    if rejection is not None and config.budget_boost > 1:
        budget = torch.ceil(budget * (1 + (config.budget_boost - 1) * rejection.to(torch.float64)))
    return torch.minimum(budget, n).to(torch.long)
