"""The rows of one ``Generator.generate`` call: a run of the scheduler's loop, over the
lockstep runner.

:class:`LockstepRunner` is the scheduler's runner for them: every row is prefilled
at once by the file's batch-N prefill (left padded: each row's positions count its
own tokens, the cumulative sum of its attention mask less one, so a padded row
computes as it would alone), then decodes one token a step at the same cache index.
:class:`Batch` is the run: its rows take their tokens from one output stage
(:class:`~.output.Chooser`) on the device, until every row has stopped (an end
token, a done constraint) or ``max_new_tokens``. A stopped row's later tokens are
``pad``, as transformers' ``generate`` writes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .output import Chooser
from .runner import Loaded

# Without a streamer, whether every row has finished is read back from the
# device every this many tokens only (the extra tokens are cut off).
EOS_CHECK_EVERY = 8


@dataclasses.dataclass(frozen=True)
class Rows:
    """A call's rows as the loop takes them: ids and mask ``(batch, prompt)``, long, on
    the device; its end tokens and the pad of a stopped row."""

    ids: torch.Tensor
    mask: torch.Tensor
    eos: tuple[int, ...]
    pad: int
    max_length: int


@dataclasses.dataclass(frozen=True)
class Decoded:
    """The sequences ``(batch, prompt + new)`` and, where kept, each step's scores
    (what the tokens were chosen from) and raw logits."""

    sequences: torch.Tensor
    scores: list[torch.Tensor]
    logits: list[torch.Tensor]


class LockstepRunner:
    """The call's rows of the generator's cache, stepped together: ``prefill`` the
    prompt, then ``decode`` a token a step (the :class:`~.runner.Runner` interface)."""

    def __init__(self, generator: Loaded, cache: Sequence[torch.Tensor], rows: Rows) -> None:
        ids, mask = rows.ids, rows.mask
        self.device = ids.device
        self.slots, prompt = ids.shape
        # The prefill runs beside a load's warm-up; a decode step may record a CUDA graph.
        self.step = generator.loop(cache, settled=False)
        self.settle, self.unrecorded = generator.settle, generator.unrecorded
        self.full = torch.zeros((self.slots, rows.max_length), dtype=torch.long, device=self.device)
        self.full[:, :prompt] = mask
        positions = mask.cumsum(-1) - 1
        self.positions = positions.masked_fill_(mask == 0, 1)
        self.last_pos = self.positions[:, -1:].clone()
        self.start = torch.zeros((), dtype=torch.long, device=self.device)
        self.ids, self.written = ids, prompt  # the next input; the cache entries so far
        self.spec = generator.spec

    def prefill(self) -> torch.Tensor:
        """Every row's prompt at once, outside CUDA graphs (one a prompt length would
        pile up): the last position's logits ``(batch, vocab)``."""
        with self.unrecorded():
            return self.step(self.ids, self.full, self.positions, self._start())[:, -1, :].float()

    def decode(self, batch: int) -> torch.Tensor:
        self.settle()
        return self.step(self.ids, self.full, self.last_pos, self._start())[:, -1, :].float()

    def _start(self) -> torch.Tensor:
        return self.spec.start_of(self.start, self.slots, self.ids.shape[1])

    def advance(self, batch: int, tokens: torch.Tensor) -> None:
        self.full[:, self.written] = 1
        self.start = self.start + self.ids.shape[1]
        self.last_pos = self.last_pos + 1
        self.ids, self.written = tokens[:, None], self.written + 1

    def free(self, slot: int, kept: int = 0) -> None:
        """Nothing to undo: the call's cache entries are masked by the next call."""

    def batch_for(self, top: int) -> int:
        return self.slots


class Batch:
    """A ``generate`` call's rows as one run of the scheduler: each step's tokens chosen
    together on the device; :meth:`result` once :attr:`over`."""

    cancelled = False

    def __init__(
        self,
        rows: Rows,
        chooser: Chooser,
        *,
        max_new_tokens: int,
        streamer: Any = None,
        keep: tuple[bool, bool] = (False, False),
    ) -> None:
        self.rows, self.chooser, self.keep = rows, chooser, keep
        self.width, device = rows.ids.shape[0], rows.ids.device
        self.max_new_tokens = self.steps = max_new_tokens
        self.eos_t = torch.tensor(list(rows.eos) or [-1], dtype=torch.long, device=device)
        self.put, self.end = _streamer_calls(streamer)
        self.out = torch.full(
            (self.width, max_new_tokens), rows.pad, dtype=torch.long, device=device
        )
        self.running = torch.ones(self.width, dtype=torch.bool, device=device)
        self.guided = [(i, g) for i, g in enumerate(chooser.guides) if g is not None]
        self.stops = bool(rows.eos or self.guided)
        self.kept_scores: list[torch.Tensor] = []
        self.kept_logits: list[torch.Tensor] = []
        self.chosen = 0  # tokens chosen so far, per row
        self.over = max_new_tokens == 0

    @property
    def streams(self) -> list[Batch]:
        """What the scheduler holds in each of the run's slots: the batch itself, whose
        one output stage chooses every row's token."""
        return [self] * self.width

    def take(self, logits: torch.Tensor) -> torch.Tensor:
        """One step's tokens ``(batch,)`` from its ``(batch, vocab)`` logits; the run is
        :attr:`over` after its last."""
        i, chooser = self.chosen, self.chooser
        if self.keep[1]:
            self.kept_logits.append(logits.clone())
        scores = chooser.scores(logits)
        if self.keep[0]:  # a copy where the step's output buffer is the next step's too
            self.kept_scores.append(scores.clone() if scores is logits else scores)
        token = chooser.pick(scores)
        token = torch.where(self.running, token, torch.full_like(token, self.rows.pad))
        chooser.chosen(token)  # the token appended, pad for a row that ended
        self.out[:, i] = token
        if self.put is not None:
            self.put(token)
        if self.rows.eos:
            self.running &= ~torch.isin(token, self.eos_t)
        for row, guide in self.guided:
            if guide.done_after(i + 1):
                self.running[row] = False
        self.chosen = i + 1
        if self.chosen == self.max_new_tokens:
            self._finish()
            return token
        check = self.put is not None or self.guided or self.chosen % EOS_CHECK_EVERY == 0
        if self.stops and check and not bool(self.running.any()):
            self.steps = self.chosen
            self._finish()
        return token

    def _finish(self) -> None:
        self.over = True
        if self.end is not None:
            self.end()

    def result(self) -> Decoded:
        ids = self.rows.ids
        if self.max_new_tokens == 0:
            return Decoded(ids.clone(), [], [])
        new = self.out[:, : self.steps]
        if self.rows.eos and self.steps > 1:
            new = _cut(new, self.eos_t)
        steps = new.shape[1]
        sequences = torch.cat([ids, new], dim=1)
        return Decoded(sequences, self.kept_scores[:steps], self.kept_logits[:steps])


def _cut(new: torch.Tensor, eos_t: torch.Tensor) -> torch.Tensor:
    """Tokens past the step where every row had stopped are cut, as generate stops
    there: the first step whose token ends the last running row."""
    ended = torch.isin(new, eos_t).cumsum(-1) > 0
    ended = torch.cat([torch.zeros_like(ended[:, :1]), ended[:, :-1]], dim=1)
    alive = (~ended).any(0)
    last = int(alive.nonzero().max()) + 1 if bool(alive.any()) else 1
    return new[:, :last]


def _streamer_calls(streamer: Any) -> tuple[Callable[[torch.Tensor], Any] | None, Any]:
    if streamer is None:
        return None, None
    if hasattr(streamer, "put"):
        return streamer.put, getattr(streamer, "end", None)
    return streamer, None


def guides_for(constraint: Any, batch: int) -> Sequence[Any]:
    """A call's constraints, one per row (None: that row is free): ``constraint`` a
    list of them, or one constraint for a call of one row."""
    if constraint is None:
        return [None] * batch
    if isinstance(constraint, Sequence):
        if len(constraint) != batch:
            raise ValueError(
                f"{len(constraint)} constraints for {batch} rows: give one per row (None: free)"
            )
        return list(constraint)
    if batch != 1:
        raise ValueError(
            f"one constraint for {batch} rows: a constraint keeps one row's state; "
            "give a list, one per row"
        )
    return [constraint]
