"""Version and environment gates, kept in one place."""

from __future__ import annotations

import sys

from transformers.generation.utils import GenerationMixin


def streamer_from_generate_call():
    """The `streamer` given to the enclosing `GenerationMixin.generate` call, if any.

    transformers (5.17 to 5.23) replaces the mode kwargs of a `custom_generate` callable by the callable's own extra
    parameters, so a user's `streamer=` never reaches it. Without this lookup it would be silently ignored.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "generate" and isinstance(frame.f_locals.get("self"), GenerationMixin):
            return frame.f_locals.get("streamer")
        frame = frame.f_back
    return None

