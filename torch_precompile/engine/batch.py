"""The rows of one ``Generator.generate`` call, decoded in lockstep.

Every row is prefilled at once (left padded: each row's positions count its own
tokens, the cumulative sum of its attention mask less one, so a padded row
computes as it would alone), then decodes one token a step at the same cache
index, through the output stage (:class:`~.output.Chooser`), until every row has
stopped (an end token, a done constraint) or ``max_new_tokens``. A stopped
row's later tokens are ``pad``, as transformers' ``generate`` writes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..lean.cudagraphs import not_recorded
from .output import Chooser

# Without a streamer, whether every row has finished is read back from the
# device every this many tokens only (the extra tokens are cut off).
EOS_CHECK_EVERY = 8
_RECORDED = contextlib.nullcontext()  # a decode step: replayed from its CUDA graph


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


def decode_rows(
    step: Callable[..., torch.Tensor],
    rows: Rows,
    chooser: Chooser,
    *,
    max_new_tokens: int,
    streamer: Any = None,
    keep: tuple[bool, bool] = (False, False),
    settle: Callable[[], None] = lambda: None,
) -> Decoded:
    """The decode loop: ``step(ids, mask, positions, start)`` on the call's cache views;
    ``settle`` before the first step that may record a CUDA graph."""
    ids, mask = rows.ids, rows.mask
    device = ids.device
    batch, prompt = ids.shape
    kept_scores: list[torch.Tensor] = []
    kept_logits: list[torch.Tensor] = []
    if max_new_tokens == 0:
        return Decoded(ids.clone(), kept_scores, kept_logits)
    full = torch.zeros((batch, rows.max_length), dtype=torch.long, device=device)
    full[:, :prompt] = mask
    positions = mask.cumsum(-1) - 1
    positions.masked_fill_(mask == 0, 1)
    eos = list(rows.eos)
    eos_t = torch.tensor(eos or [-1], dtype=torch.long, device=device)
    put, end = _streamer_calls(streamer)
    out = torch.full((batch, max_new_tokens), rows.pad, dtype=torch.long, device=device)
    running = torch.ones(batch, dtype=torch.bool, device=device)
    last_pos = positions[:, -1:].clone()
    start = torch.zeros((), dtype=torch.long, device=device)
    step_ids, step_pos = ids, positions
    steps = max_new_tokens
    guided = [(i, g) for i, g in enumerate(chooser.guides) if g is not None]
    stops = bool(eos or guided)
    for i in range(max_new_tokens):
        if i == 1:  # the prefill ran beside a load's warm-up; a decode step may record
            settle()
        # The prefill runs without CUDA graphs: one a prompt length would pile up.
        with not_recorded() if i == 0 else _RECORDED:
            logits = step(step_ids, full, step_pos, start)[:, -1, :].float()
        if keep[1]:
            kept_logits.append(logits.clone())
        scores = chooser.scores(logits)
        if keep[0]:  # a copy where the step's output buffer is the next step's too
            kept_scores.append(scores.clone() if scores is logits else scores)
        token = chooser.pick(scores)
        token = torch.where(running, token, torch.full_like(token, rows.pad))
        chooser.chosen(token)  # the token appended, pad for a row that ended
        out[:, i] = token
        if put is not None:
            put(token)
        if eos:
            running &= ~torch.isin(token, eos_t)
        for row, guide in guided:
            if guide.done_after(i + 1):
                running[row] = False
        if i + 1 == max_new_tokens:
            break
        check = put is not None or guided or (i + 1) % EOS_CHECK_EVERY == 0
        if stops and check and not bool(running.any()):
            steps = i + 1
            break
        full[:, prompt + i] = 1
        start = start + step_ids.shape[1]
        last_pos = last_pos + 1
        step_ids, step_pos = token[:, None], last_pos
    if end is not None:
        end()
    new = _cut(out[:, :steps], eos_t) if eos and steps > 1 else out[:, :steps]
    steps = new.shape[1]
    return Decoded(torch.cat([ids, new], dim=1), kept_scores[:steps], kept_logits[:steps])


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
