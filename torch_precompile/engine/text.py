"""The engine's tokenizer work, in one module: text in (a prompt encoded, a chat
rendered by the file's template), text out (a run's text decoded as its tokens
come, at a cost per token that does not grow; each token's own text and bytes).

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

Prompts are tokenized through ``encode_batch``: ``tokenizers``' ``encode`` holds
the GIL while it runs, so a big prompt on any thread stopped the engine's thread
too (2 MB of text: a Python thread beside it waited 3.3 s), where ``encode_batch``
releases it (the longest wait was the result's conversion to a list and its
release, 0.1 and 0.2 s for 550,000 tokens; measured on this project's 2-core
CPU). Those two still grow with the tokens, so a text that cannot fit is refused
before it is tokenized: one of more characters than ``max_length`` tokens can hold
(see :func:`most_characters`). The chat template renders in jinja2's sandbox
(jinja2 imported where a file has a template). A text or chat the file cannot
take is a :class:`~.errors.RequestError` naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

from .errors import RequestError

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


def require_unicode(text: str, where: str, param: str | None) -> str:
    """``text``, or a :class:`RequestError` where it holds a lone surrogate (JSON's
    ``"\\ud800"``): no tokenizer can read it, and UTF-8 cannot spell it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        at = exc.start
        raise RequestError(
            f"{where} holds a lone surrogate (U+{ord(text[at]):04X} at character {at}), "
            "which is not text: send valid Unicode",
            param=param,
        ) from None
    return text


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
    refuses what needs it with a ``RequestError`` saying so."""

    def __init__(self, tokenizer: Any, spec: Any) -> None:
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
            raise RequestError(
                "this model's file holds no tokenizer: send the prompt as token ids",
                param=param,
            )
        return self.tokenizer

    def encode(self, text: str, *, special: bool = True, param: str = "prompt") -> list[int]:
        """``text``'s ids (``special``: with the tokenizer's added special tokens)."""
        tokenizer = self._need(param)
        require_unicode(text, "the prompt", param)
        if self.most is not None and len(text) > self.most:
            raise RequestError(
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
            raise RequestError(
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


class _TemplateRefused(Exception):
    """A template's own ``raise_exception`` (a chat it does not accept)."""


def _raise(message: str) -> None:
    raise _TemplateRefused(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def chat_renderer(template: str, tokens: dict[str, str]) -> Callable[..., str]:
    """``render(messages, generation=True, tools=None) -> prompt text``
    (``generation``: with ``add_generation_prompt``; ``tools``: the request's, as
    transformers passes them); a template that refuses a chat raises ``RequestError``."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    compiled = env.from_string(template)

    def render(
        messages: list[dict[str, Any]], generation: bool = True, tools: list[Any] | None = None
    ) -> str:
        try:
            return compiled.render(
                messages=messages, tools=tools, add_generation_prompt=generation, **tokens
            )
        except _TemplateRefused as exc:
            raise RequestError(
                f"the chat template refused the messages: {exc}", param="messages"
            ) from None
        except (
            jinja2.TemplateError,
            ArithmeticError,
            AttributeError,
            LookupError,
            TypeError,
            ValueError,
        ) as exc:
            raise RequestError(
                f"the chat template failed on the messages: {type(exc).__name__}: {exc}",
                param="messages",
            ) from None
        except RecursionError:  # a message nested past Python's limit (tojson)
            raise RequestError(
                "the chat template failed on the messages: nested too deep", param="messages"
            ) from None

    return render
