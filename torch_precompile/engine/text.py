"""Text out of the engine: a run's text, decoded as its tokens come, at a cost per
token that does not grow; each token's own text and bytes (logprobs).

Decoding every new token's whole sequence again costs O(n) a step, O(n^2) a
request: with a 16k-token byte-level BPE on this project's 2-core CPU, 193 us a
token on average over a 2,048-token run, for each slot, against 4 us here
(``benchmarks/detokenize.py``); a small model's decode step on a GPU is about 1 ms.
Here each step decodes a short window instead, as Hugging Face's TGI and vLLM
do: the tokens since the last whole piece of text (``read``), after a few of
context (from ``prefix``), so that a decoder that drops a leading space at the
start of a sequence (SentencePiece's) or joins bytes (byte-level BPE) decodes
them as it would inside the whole sequence. Text that ends in a cut character
(U+FFFD) waits for the token that completes it.

What may be sent is held back while it could be the start of a stop string;
a stop string is looked for only in the text not yet sent (a stop string found
ends the text before it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

_CUT = "\ufffd"  # what a decoder writes for bytes that are not yet a whole character
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def token_bytes(tokenizer: Any) -> Callable[[int], bytes]:
    """Each token's own bytes (OpenAI's logprobs ``bytes``), where its decoded text
    alone would be U+FFFD for a token holding part of a character.

    Byte-level BPE (GPT-2, Llama 3, Qwen) spells each byte as one character: mapped
    back. SentencePiece with byte fallback (Llama 2, Mistral) spells a byte as
    ``<0xNN>`` and a space as U+2581. Any other decoder: the token's decoded text.
    """
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    spelled = tokenizer.id_to_token
    if "ByteLevel" in kinds:
        table = {c: b for b, c in _byte_level_alphabet().items()}

        def of(token: int) -> bytes:
            text = spelled(token) or ""
            if all(c in table for c in text):
                return bytes(table[c] for c in text)
            return text.encode()  # an added token written as itself

    elif "ByteFallback" in kinds:

        def of(token: int) -> bytes:
            text = spelled(token) or ""
            byte = _BYTE_TOKEN.fullmatch(text)
            return bytes([int(byte[1], 16)]) if byte else text.replace("\u2581", " ").encode()

    else:

        def of(token: int) -> bytes:
            return tokenizer.decode([token], skip_special_tokens=False).encode()

    return of


def pieces_of(tokenizer: Any) -> Callable[[list[int]], list[tuple[str, bytes]]]:
    """Each token's text, as logprobs show it, and its own bytes (``token_id:N`` for a
    file without a tokenizer, as vLLM writes them)."""
    if tokenizer is None:
        return lambda tokens: [(f"token_id:{t}", f"token_id:{t}".encode()) for t in tokens]
    of, decode = token_bytes(tokenizer), tokenizer.decode
    return lambda tokens: [(decode([t], skip_special_tokens=False), of(t)) for t in tokens]


def _byte_level_alphabet() -> dict[int, str]:
    """Byte-level BPE's character for each byte: printable Latin-1 bytes as themselves,
    the others (controls, space, ...) as the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {
        **{b: chr(b) for b in printable},
        **{b: chr(0x100 + i) for i, b in enumerate(others)},
    }


class IncrementalText:
    """The text of a run's new tokens (end tokens left out) and what of it was sent."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) - 1 for s in stops), default=0)
        self.ids: list[int] = []
        self.text = ""  # whole characters decoded so far
        self.sent = 0  # how much of ``text`` was sent
        self._prefix = 0  # the window's context starts here
        self._read = 0  # ``text`` holds the tokens before this one

    def add(self, token: int) -> None:
        """One new token: its text joins :attr:`text` once it ends in whole characters."""
        self.ids.append(token)
        self._decode(final=False)

    def _decode(self, final: bool) -> None:
        if self._read == len(self.ids):
            return
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        window = decode(self.ids[self._prefix :], skip_special_tokens=True)
        if not final and (window.endswith(_CUT) or len(window) <= len(before)):
            return  # a cut character, or nothing yet: wait for the next token
        self.text += window[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)

    def take(self, final: bool) -> tuple[str, bool]:
        """The text to send now, and whether a stop string ended the run.

        ``final``: the run ends with this token; whatever is left is sent (a cut
        character at the very end as U+FFFD, as a whole decode would write it).
        """
        if final:
            self._decode(final=True)
        text, stopped = self.text, False
        found = [i for i in (text.find(s, self.sent) for s in self.stops) if i >= 0]
        if found:
            text, stopped, final = text[: min(found)], True, True
        if not final:
            text = text[: max(self.sent, len(text) - self.hold)]
        new = text[self.sent :]
        self.sent = len(text)
        return new, stopped
