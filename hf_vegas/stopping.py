"""Where each row stops inside the chunk of tokens it accepted this iteration.

Vanilla `generate` checks its stopping criteria after every token. Vegas accepts several tokens at once, so it
finds the first token after which vanilla would have stopped: the length budget and EOS are vectorised; any other
criterion (stop strings, custom criteria) is asked once per distinct history length, on exactly the history vanilla
would have passed.
"""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList


class ChunkStopper:
    def __init__(self, stopping_criteria: StoppingCriteriaList | None, eos_token_ids: torch.Tensor | None,
                 device: torch.device | None = None):
        criteria = list(stopping_criteria or [])
        self.has_eos = eos_token_ids is not None or any(isinstance(c, EosTokenCriteria) for c in criteria)
        eos = [eos_token_ids] if eos_token_ids is not None else []
        eos += [c.eos_token_id for c in criteria if isinstance(c, EosTokenCriteria)]
        # On the tokens' device: `vectorised` may run inside a CUDA graph, which cannot copy from the host.
        self.eos = torch.cat([e.reshape(-1).to(device or e.device) for e in eos]).unique() if eos else None
        # The length budget is enforced by the caller through `budget`; EOS is vectorised below.
        self.others = [c for c in criteria if not isinstance(c, (EosTokenCriteria, MaxLengthCriteria))]

    @staticmethod
    def vectorised(chunk, chunk_len, budget, eos: torch.Tensor | None):
        """The cut by the length budget and EOS, on the device only (a CUDA graph may hold it).

        Args:
            chunk `(B, C)`, chunk_len `(B,)`: the new tokens of each row (only the first `chunk_len[b]` are real).
            budget `(B,)`: tokens each row may still generate.
            eos: the EOS ids (`ChunkStopper.eos`), or None.

        Returns `(keep, stopped)`: tokens to keep per row, and whether the row is finished after them. The other
        criteria (`others`) may cut further: `check_others`.
        """
        positions = torch.arange(chunk.shape[1], device=chunk.device)[None, :]
        keep = torch.minimum(chunk_len, budget)
        stopped = keep >= budget
        if eos is not None:
            is_eos = torch.isin(chunk, eos) & (positions < keep[:, None])
            hit = is_eos.any(dim=-1)
            first = torch.where(is_eos, positions, chunk.shape[1]).min(dim=-1).values
            keep = torch.where(hit, first + 1, keep)
            stopped |= hit
        return keep, stopped

    def check_others(self, tokens, history, keep, stopped):
        """Cut `keep` further by the other criteria. `tokens` `(B, W)` holds every row's history with its chunk
        written at `history[b]`. They are asked once per distinct history length, on the whole batch (criteria may
        keep per-row state), and each row is cut at its first position where any says stop."""
        keep_host, stop_host = keep.tolist(), stopped.tolist()
        first_hit = [None] * len(history)
        lengths = sorted({h + j + 1 for h, k in zip(history, keep_host) for j in range(k)})
        for length in lengths:
            says_stop = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
            for criterion in self.others:
                says_stop |= criterion(tokens[:, :length], None).to(says_stop.device)
            for b, flag in enumerate(says_stop.tolist()):
                j = length - history[b] - 1
                if flag and first_hit[b] is None and 0 <= j < keep_host[b]:
                    first_hit[b] = j
        for b, j in enumerate(first_hit):
            if j is not None:
                keep_host[b], stop_host[b] = j + 1, True
        device = keep.device
        return torch.tensor(keep_host, device=device), torch.tensor(stop_host, device=device)
