"""The server's incremental detokenizer equals a whole decode, for byte-level BPE and for
SentencePiece-style (Metaspace) tokenizers, with cut characters and stop strings across
token boundaries, and decodes a window per token, not the whole run."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.fixtures.bpe import byte_level_bpe
from torch_precompile.serve.detokenizer import IncrementalText, token_bytes

CORPUS = [
    "the cat sat on the mat, héllo wörld",
    "a generator serves itself: 日本語のテキスト and emoji 🙂🙃",
    "stop here. END of story; the end",
] * 30


def _byte_level() -> Tokenizer:
    return byte_level_bpe(CORPUS, 400, ["<eos>"])


def _metaspace() -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<eos>", *byte_tokens])
    tok.train_from_iterator(CORPUS, trainer)
    return tok


TOKENIZERS = {"byte_level": _byte_level, "metaspace": _metaspace}


def _sequences(tok: Tokenizer, n: int, seed: int) -> list[list[int]]:
    """Real text's tokens, and random tokens (which split characters between tokens)."""
    rng = random.Random(seed)
    text = tok.encode(" ".join(CORPUS[:3])).ids
    vocab = tok.get_vocab_size()
    out = [text]
    for _ in range(n):
        out.append([rng.randrange(vocab) for _ in range(rng.randrange(1, 40))])
    return out


def _streamed(tok: Tokenizer, ids: list[int], stops: tuple[str, ...]) -> tuple[list[str], bool]:
    text = IncrementalText(tok, stops)
    chunks, stopped = [], False
    for i, token in enumerate(ids):
        text.add(token)
        chunk, stopped = text.take(final=i == len(ids) - 1)
        chunks.append(chunk)
        if stopped:
            break
    return chunks, stopped


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_streamed_text_equals_the_whole_decode(kind: str) -> None:
    tok = TOKENIZERS[kind]()
    for ids in _sequences(tok, 60, seed=1):
        chunks, stopped = _streamed(tok, ids, ())
        assert "".join(chunks) == tok.decode(ids, skip_special_tokens=True), ids
        assert not stopped
        # A cut character is never sent before the end: each chunk but the last is whole.
        assert all("\ufffd" not in c or i == len(chunks) - 1 for i, c in enumerate(chunks)) or (
            "\ufffd" in tok.decode(ids[:-1], skip_special_tokens=True)
        )


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
@pytest.mark.parametrize("stops", [("END",), ("the end", "mat"), (". ", "🙃"), ("zzz-never",)])
def test_stop_strings_end_the_text_before_them(kind: str, stops: tuple[str, ...]) -> None:
    tok = TOKENIZERS[kind]()
    for ids in _sequences(tok, 30, seed=2):
        whole = tok.decode(ids, skip_special_tokens=True)
        found = [whole.find(s) for s in stops if s in whole]
        chunks, stopped = _streamed(tok, ids, stops)
        sent = "".join(chunks)
        if found:
            # The text streamed up to the stop string equals the whole decode's, cut there.
            assert stopped and sent == whole[: min(found)], (ids, sent, whole)
        else:
            assert not stopped and sent == whole
        assert not any(s in sent for s in stops)


class _Counting:
    """A tokenizer that counts the tokens it is asked to decode."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.longest = tok, 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, **kwargs)


def test_each_token_decodes_a_window_not_the_whole_run() -> None:
    tok = _byte_level()
    ids = tok.encode(" ".join(CORPUS)).ids * 4  # about 2,000 tokens
    counting = _Counting(tok)
    text = IncrementalText(counting, ("never-there",))
    sent = []
    for i, token in enumerate(ids):
        text.add(token)
        sent.append(text.take(final=i == len(ids) - 1)[0])
    assert "".join(sent) == tok.decode(ids)
    assert len(ids) > 1500 and counting.longest <= 8


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_token_bytes_join_to_the_texts_bytes(kind: str) -> None:
    """Each token's own bytes (OpenAI's logprobs ``bytes``), joined, are the text's
    UTF-8 (after the pre-tokenizer's own spaces), where a token holding part of a
    character decodes alone to U+FFFD (byte-level) or nothing (byte fallback)."""
    tok = TOKENIZERS[kind]()
    of = token_bytes(tok)
    cut = 0
    for text in [*CORPUS[:3], "unseen: 新しい 한국어 🦀 ß"]:
        ids = tok.encode(text).ids
        want = text.encode() if kind == "byte_level" else (" " + text).encode()
        assert b"".join(of(i) for i in ids) == want, (text, [of(i) for i in ids])
        cut += sum(tok.decode([i]).encode() != of(i) for i in ids)
    assert cut > 5  # the unseen characters are split into bytes: decoded alone, lost
    assert of(tok.token_to_id("<eos>")) == b"<eos>"
