"""Prefix reuse and chunked prefill: what each slot's cache holds, and a prompt's
prefill in pieces.

A slot keeps its last run's entries when the run ends (the prompt and every token
fed back as an input), as llama.cpp's server keeps a slot's prompt cache: a request
whose prompt begins with them (the next turn of a chat, a shared system prompt)
takes the free slot with the longest match and prefills only the rest. At least
one token is always prefilled, for the logits the first new token is drawn from.
A prompt is prefilled ``chunk`` tokens at a time, one chunk a pass of the
scheduler between decode steps, so the slots already decoding wait one chunk's
time, not the whole prompt's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


def common(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` begin with alike."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class SlotCaches:
    """Per slot, the tokens whose entries its cache holds (from index 0)."""

    def __init__(self, slots: int, max_length: int) -> None:
        self.tokens: list[tuple[int, ...]] = [()] * slots
        # A free slot decodes past its entries: index ``max_length - 1`` at most.
        self.limit = max_length - 1

    def keep(self, slot: int, tokens: Sequence[int]) -> int:
        """The slot's cache holds ``tokens`` (cut at the limit); how many it keeps."""
        self.tokens[slot] = tuple(tokens[: self.limit])
        return len(self.tokens[slot])

    def match(self, slot: int, prompt: Sequence[int]) -> int:
        """How many of the slot's entries ``prompt`` reuses (one token at least is
        left to prefill)."""
        return max(min(common(self.tokens[slot], prompt), len(prompt) - 1), 0)

    def choose(self, free: list[int], prompt: Sequence[int]) -> int:
        """The free slot to prefill ``prompt`` into: the longest match, then the lowest."""
        return max(free, key=lambda slot: (self.match(slot, prompt), -slot))


@dataclasses.dataclass
class Filling:
    """A prompt on its way into a slot: ``done`` of its ``tokens`` are in the cache
    (``reused`` of them were already there)."""

    slot: int
    tokens: tuple[int, ...]
    done: int
    reused: int

    def next_chunk(self, budget: int) -> tuple[int, tuple[int, ...]]:
        """Where the next chunk starts and its tokens (``budget`` 0: all the rest)."""
        end = len(self.tokens) if budget <= 0 else min(len(self.tokens), self.done + budget)
        return self.done, self.tokens[self.done : end]

    @property
    def finished(self) -> bool:
        return self.done == len(self.tokens)
