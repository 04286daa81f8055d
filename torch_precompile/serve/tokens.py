"""The file's tokenizer and chat template as requests use them: text to ids and back.

Requests are tokenized on a worker thread (``app.py``), and through
``encode_batch``: ``tokenizers``' ``encode`` holds the GIL while it runs, so a
big prompt on any thread stopped the engine's thread too (2 MB of text: a
Python thread beside it waited 3.3 s), where ``encode_batch`` releases it (the
longest wait was the result's conversion to a list and its release, 0.1 and
0.2 s for 550,000 tokens; measured on this project's 2-core CPU). Those two
still grow with the tokens, so a text that cannot fit is refused before it is
tokenized: one of more characters than ``max_length`` tokens can hold (see
:func:`most_characters`).
"""

from __future__ import annotations

import json
from typing import Any

from .body import require_unicode
from .errors import ApiError

# The most characters a Unicode normal form folds into one (the longest canonical
# decomposition is 4 code points: U+1F82's), so NFC/NFD/NFKC/NFKD shrink a text 4x at most.
_NORMAL_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}
_KEEPS_LENGTH = {"Lowercase", "Prepend"}
# Pre-tokenizers that drop no character (Whitespace and BERT's drop spaces).
_PRE_KEEPS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


def _shrink(normalizer: dict[str, Any] | None) -> int | None:
    """How many times shorter the normalizer may make a text, or None if it may drop
    characters without bound (Strip, StripAccents, BERT's, a replacement by less)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            one = _shrink(part)
            if one is None:
                return None
            factor *= one
        return factor
    if kind in _NORMAL_FORMS:
        return 4
    if kind in _KEEPS_LENGTH:
        return 1
    if kind == "Replace":
        pattern = normalizer.get("pattern", {}).get("String")
        content = normalizer.get("content", "")
        return 1 if isinstance(pattern, str) and len(content) >= len(pattern) else None
    return None


def _pre_keeps(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(_pre_keeps(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") in _PRE_KEEPS and pre.get("behavior") != "Removed"


def most_characters(spec: dict[str, Any], max_length: int) -> int | None:
    """The most characters a text of ``max_length`` tokens can hold for this tokenizer
    (its JSON), or None where no bound is known.

    Each token stands for at most its own spelling's characters (byte-level BPE spells
    a byte as one character; a SentencePiece byte ``<0x0A>`` is six), so a text of
    ``c`` characters is at least ``c / (longest x shrink)`` tokens, ``shrink`` being
    what the normalizer may fold. No bound for a model other than BPE (WordLevel and
    Unigram may make one token of a whole unknown word), a BPE that fuses unknown
    characters into one token, a normalizer or pre-tokenizer that may drop characters,
    or an added token that swallows the spaces beside it (``lstrip``/``rstrip``).
    """
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("fuse_unk"):
        return None
    shrink = _shrink(spec.get("normalizer"))
    if shrink is None or not _pre_keeps(spec.get("pre_tokenizer")):
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    spellings = [*model.get("vocab", {}), *(t.get("content", "") for t in added)]
    longest = max((len(s) for s in spellings), default=1)
    return max_length * longest * shrink


class Tokens:
    """Text in and out for the server; a file without a tokenizer or a chat template
    refuses what needs it with a 400 saying so."""

    def __init__(self, tokenizer: Any, spec: Any) -> None:
        from .chat import chat_renderer

        self.tokenizer, self.max_length = tokenizer, spec.max_length
        self.chat = None
        if tokenizer is not None and spec.chat_template is not None:
            self.chat = chat_renderer(spec.chat_template, dict(spec.chat_tokens))
        self.templated = spec.chat_template is not None
        self.most = None
        if tokenizer is not None:
            self.most = most_characters(json.loads(tokenizer.to_str()), spec.max_length)

    def _need(self, param: str) -> Any:
        if self.tokenizer is None:
            raise ApiError(
                400,
                "this model's file holds no tokenizer: send the prompt as token ids",
                param=param,
            )
        return self.tokenizer

    def encode(self, text: str, *, special: bool = True, param: str = "prompt") -> list[int]:
        """``text``'s ids (``special``: with the tokenizer's added special tokens)."""
        tokenizer = self._need(param)
        require_unicode(text, "the prompt", param)
        if self.most is not None and len(text) > self.most:
            raise ApiError(
                400,
                f"a prompt of {len(text)} characters cannot fit the model's max_length="
                f"{self.max_length} tokens (this tokenizer's tokens hold at most "
                f"{self.most // self.max_length} characters each): shorten the prompt",
                param=param,
            )
        (encoding,) = tokenizer.encode_batch([text], add_special_tokens=special)
        return encoding.ids

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        generation: bool = True,
        special: bool = False,
        tools: list[Any] | None = None,
    ) -> list[int]:
        """A chat's ids: its messages (and ``tools``) rendered by the file's template
        (``generation``: ending with the assistant's prompt), no special tokens added
        unless asked (the template writes its own)."""
        if not self.templated:
            raise ApiError(
                400,
                "this model's file holds no chat template (its tokenizer had none at build): "
                "use /v1/completions",
                param="messages",
            )
        self._need("messages")
        text = self.chat(messages, generation, tools)
        return self.encode(text, special=special, param="messages")

    def decode(self, ids: list[int]) -> str:
        return self._need("tokens").decode(ids, skip_special_tokens=False)

    def spellings(self, ids: list[int]) -> list[str]:
        """Each id's spelling in the vocabulary (vLLM's ``token_strs``)."""
        tokenizer = self._need("tokens")
        return [tokenizer.id_to_token(i) or "" for i in ids]
