"""Memory-traffic bounds: the bytes a decode step must read, and the fastest it can run at a measured bandwidth.

A decode step of a long-context batch is memory-bound: it reads every weight once and the keys and values its
attention needs. Its traffic bound is those bytes over the bandwidth a pure read reaches on the same GPU:

    dense step (HF, our gamma = 0 path)  weights + every row's visible KV
    Vegas iteration                      gamma drafts x (weights + selected KV + tail; dense windows whole)
                                         + one verification (weights + every row's full KV)

Tokens per second at the bound: dense B / t_step; Vegas B x tokens-per-iteration / t_iteration (the measured
tokens per iteration, so the bound is that of the speculation actually achieved).
"""

from __future__ import annotations

from .cache import layer_types, sparse_layers
from .config import VegasConfig


def weight_bytes(model) -> int:
    """Bytes of every parameter a step reads: all but an untied input embedding, of which a step reads one row per
    token (tied embeddings are the output projection, read whole)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # (a TP shard's `DTensor`: the whole)
    embedding = model.get_input_embeddings().weight
    if _storage(embedding) != _storage(model.get_output_embeddings().weight):
        total -= embedding.numel() * embedding.element_size()
    return total


def _storage(weight) -> int:
    """Where `weight`'s data starts (a tensor-parallel `DTensor`: its local shard's)."""
    return weight.to_local().data_ptr() if hasattr(weight, "to_local") else weight.data_ptr()


def _kv_shape(model) -> tuple[list[int | None], int]:
    """Each layer's window (None: full attention) and the KV bytes per token per layer."""
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    window = getattr(text, "sliding_window", None)
    windows = [window if kind == "sliding_attention" else None for kind in layer_types(text)]
    return windows, 2 * text.num_key_value_heads * head_dim * model.dtype.itemsize


def dense_step_bytes(model, batch: int, context: int) -> int:
    windows, per_token = _kv_shape(model)
    visible = sum(context if w is None else min(w, context) for w in windows)
    return weight_bytes(model) + batch * visible * per_token


def vegas_iteration_bytes(model, batch: int, context: int, config: VegasConfig, rejection: float = 0.0) -> int:
    """One iteration at `context` committed tokens per row: gamma sparse drafts and one full verification. With a
    `budget_boost`, `rejection` (the share of verifications that rejected a draft) scales the budget as it does on
    average (`VegasConfig.budget_boost`)."""
    if config.gamma == "auto":
        raise ValueError("The traffic model takes a config with an integer gamma; a gamma='auto' generation runs "
                         "several (its output's `gammas`): model the one it ran.")
    windows, per_token = _kv_shape(model)
    sparse = sparse_layers(model.config.get_text_config(decoder=True), config, context)

    def draft_reads(layer: int, window: int | None) -> int:
        visible = context if window is None else min(window, context)
        if layer not in sparse:
            return visible
        candidates = context if window is None else min(window - 1, context)
        budget = config.budget(candidates) * config.boost(rejection)
        # selection + tail (accepted since, and the drafts)
        return min(int(min(budget, candidates)) + 2 * config.gamma, visible)

    draft_visible = sum(draft_reads(layer, window) for layer, window in enumerate(windows))
    draft = weight_bytes(model) + batch * draft_visible * per_token
    return config.gamma * draft + dense_step_bytes(model, batch, context + config.gamma + 1)


def predicted_speedup(model, batch: int, context: int, config: VegasConfig, tokens_per_iteration: float,
                      rejection: float = 0.0) -> float:
    """Vegas over the dense path when both run at the same bandwidth (bytes alone decide, so the GPU cancels out):
    `tokens_per_iteration` tokens for one iteration's bytes against one token per dense step's bytes."""
    if config.gamma == 0:
        return 1.0
    return tokens_per_iteration * dense_step_bytes(model, batch, context) / vegas_iteration_bytes(
        model, batch, context, config, rejection)
