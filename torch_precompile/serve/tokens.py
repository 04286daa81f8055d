"""The file's tokenizer and chat template as requests use them: the engine's
(``torch_precompile/engine/text.py``), under their old names."""

from ..engine.text import Tokens, most_characters

__all__ = ["Tokens", "most_characters"]
