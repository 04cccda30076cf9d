"""`StepPlan`: what the next forward is and where each row's tokens go, declared before the model runs.

The loop that drives the forwards (`hf_vegas.runner`, or HF's assisted loop through `hf_vegas.candidate`) declares
each forward with `VegasCache.begin(mode, ...)`; layer 0's cache update then lays the forward's `T` tokens out once for
every layer (`lay_out`): row `b` writes slots `[write_start[b], lengths[b])` and its queries sit at `query_slots`.
A token's slot is its position (no padding inside a row), so the committed `lengths` say which slots hold keys; after
acceptance the loop moves them back with `rollback`.

Static state. Every tensor that outlives one forward (`lengths`, `row_active`, `left_pad`, `verify_end`) is allocated
once and only written in place: a CUDA graph captured over a forward reads and writes the addresses it saw at capture
(`hf_vegas.graphs`), so a reassigned attribute would be invisible to it. The per-forward layout (`write_slots`,
`query_slots`, `attend_lengths`) is rebuilt by every forward, inside its graph.
"""

from __future__ import annotations

import torch

MODES = ("prefill", "draft", "verify", "decode")  # "decode": one dense step of the gamma = 0 path, no selection


class StepPlan:
    """Per-row lengths and the layout of the current forward, for a batch of `batch_size` rows of `capacity` slots
    (plus one scratch slot, `capacity`, where the left padding of a batched prefill writes)."""

    def __init__(self, batch_size: int, capacity: int, device: torch.device):
        self.batch_size, self.capacity, self.device = batch_size, capacity, device
        long = dict(dtype=torch.long, device=device)
        self.row_index = torch.arange(batch_size, **long)
        self.lengths = torch.zeros(batch_size, **long)
        # Rows still generating (the loop updates it in place before each iteration): the kernels read nothing for
        # the others (`attend_lengths`), so a batch's last iterations, after most rows have finished, cost less.
        self.row_active = torch.ones(batch_size, dtype=torch.bool, device=device)
        self.attend_lengths = torch.zeros(batch_size, **long)
        self.left_pad = torch.zeros(batch_size, **long)
        self._left_pad_set = False
        self.verify_end = torch.zeros(batch_size, **long)
        self.verify_end_given = False
        self.write_start = torch.zeros(batch_size, **long)
        self.write_slots = torch.zeros(batch_size, 1, **long)
        self.query_slots = torch.zeros(batch_size, 1, **long)
        # A prefill runs one SDPA call per row, after the tokens the row already holds; the host needs each row's
        # pads and start for it (one synchronisation per prefill forward, never in the draft/verify steps).
        self.prefill_left_pad: list[int] | None = None
        self.prefill_start: list[int] | None = None
        self.mode = "verify"
        # Whether this forward chooses the next draft's slots (a chunked prefill's chunks before the last do not).
        self.selects = True

    def begin(self, mode: str, left_pad: torch.Tensor | None = None, verify_end: torch.Tensor | None = None,
              selects: bool = True) -> None:
        """Declare the next forward. `left_pad` (prefill only) counts each row's leading pad tokens; `verify_end`
        (verify only) is where each row's verified tokens end: the forward's last token lands in slot
        `verify_end - 1`, whatever prefix of the sequence the caller re-feeds (HF's assisted loop feeds the whole
        prompt with its first verification). `selects=False`: a prefill chunk followed by more, which leaves the
        selection to the last one."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.selects = selects
        if left_pad is not None:
            self.left_pad.copy_(left_pad)
        elif self._left_pad_set:  # zeroed once after a padded prefill, not before every draft step
            self.left_pad.zero_()
        self._left_pad_set = left_pad is not None
        self.verify_end_given = verify_end is not None
        if verify_end is not None:
            self.verify_end.copy_(verify_end)

    def lay_out(self, num_tokens: int) -> None:
        """At layer 0 of a forward of `num_tokens` tokens per row: where they are written and where their queries
        sit, for every layer; advances `lengths` past them."""
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
        self.prefill_left_pad = self.prefill_start = None
        if self.mode == "prefill":
            self.prefill_left_pad, self.prefill_start = self.left_pad.tolist(), self.write_start.tolist()

    def follow(self, main: StepPlan) -> None:
        """Take `main`'s current forward, copied to this plan's device: the plan of the layers on another device
        (`hf_vegas.placement`), refreshed at the first of them that a forward reaches, after `main.lay_out`."""
        self.mode, self.selects = main.mode, main.selects
        self.prefill_left_pad, self.prefill_start = main.prefill_left_pad, main.prefill_start
        self.lengths.copy_(main.lengths)
        for name in ("write_start", "write_slots", "query_slots", "attend_lengths"):
            setattr(self, name, getattr(main, name).to(self.device, copy=True))

    def rollback(self, new_lengths: torch.Tensor) -> None:
        """Set each row's committed length (drops rejected draft tokens; their slots are overwritten later)."""
        self.lengths.copy_(new_lengths)

    def crop(self, tokens_to_remove: int) -> None:
        """Every row `tokens_to_remove` (negative, as `DynamicCache.crop` takes it) positions shorter."""
        if tokens_to_remove > 0:
            raise ValueError("VegasCache.crop takes a negative count (tokens to remove), like DynamicCache.")
        self.lengths.copy_((self.lengths + tokens_to_remove).clamp_min(0))

    def restart(self) -> None:
        """Every row empty and active, for a new generation over the same buffers."""
        self.lengths.zero_()
        self.row_active.fill_(True)
