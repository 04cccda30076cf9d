"""What `generate` returns with `return_dict_in_generate=True`: HF's usual output plus acceptance statistics."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput


@dataclass
class VegasGenerateOutput(GenerateDecoderOnlyOutput):
    r"""
    [`~generation.GenerateDecoderOnlyOutput`] plus Vegas statistics. `past_key_values` is the generation's own
    `VegasCache`, or None when the cache was pooled for the next call (CUDA graphs, see `hf_vegas.graphs`).

    Args:
        accepted (`torch.LongTensor` of shape `(batch_size, num_iterations)`):
            Draft tokens accepted by each row in each draft/verify iteration; `-1` where the row had already
            finished. Each active iteration also yields one more token (the correction or bonus token).
    """

    accepted: torch.LongTensor | None = None

    @property
    def tokens_per_iteration(self) -> float:
        """Mean tokens produced per active (row, iteration): accepted drafts + the bonus/correction token."""
        active = self.accepted[self.accepted >= 0]
        return float((active + 1).float().mean()) if active.numel() else float("nan")
