"""A run's text as its tokens come: the engine's (``torch_precompile/engine/text.py``)."""

from ..engine.text import IncrementalText, token_bytes

__all__ = ["IncrementalText", "token_bytes"]
