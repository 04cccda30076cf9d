"""Version and environment gates, kept in one place."""

from __future__ import annotations

import sys

from transformers.generation.utils import GenerationMixin


def generate_call_argument(name: str):
    """The value of `name` (`streamer`, `synced_gpus`) in the enclosing `GenerationMixin.generate` call, if any.

    transformers (5.17 to 5.23) replaces the mode kwargs of a `custom_generate` callable by the callable's own extra
    parameters, so a user's `streamer=` or `synced_gpus=` never reaches it. Without this lookup they would be
    silently ignored.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "generate" and isinstance(frame.f_locals.get("self"), GenerationMixin):
            return frame.f_locals.get(name)
        frame = frame.f_back
    return None


def is_user_cache(cache) -> bool:
    """Whether the user passed `cache` (transformers 5.17 to 5.23 mark it in `_prepare_cache_for_generation`), rather
    than transformers building it for `cache_implementation`."""
    return bool(getattr(cache, "_is_user_defined", False))
