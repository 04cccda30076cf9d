"""Attention and selection ops. `reference` is the plain-PyTorch definition of their semantics."""

from . import reference

__all__ = ["reference"]
