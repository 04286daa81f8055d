"""A request's constraint: which tokens may come next, applied before sampling.

A :class:`Constraint` is any object with the three methods below (a grammar, a
JSON schema, a fixed choice); the engine holds one per request (per row of
``Generator.generate``) and, at each step, masks the logits of the tokens it
does not allow to ``-inf`` before penalties' result is warped and sampled. A
run whose constraint says :meth:`~Constraint.done` ends there (finish reason
``"stop"``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Constraint(Protocol):
    """The protocol: asked for a mask before each token, told each token chosen."""

    def allowed_mask(self, vocab_size: int) -> torch.Tensor | None:
        """A ``(vocab_size,)`` bool tensor, True for each token allowed next (any
        device); ``None``: every token is. Not asked once :meth:`done`."""
        ...

    def accept(self, token_id: int) -> None:
        """The token chosen (one that the last mask allowed)."""
        ...

    def done(self) -> bool:
        """Whether the text so far is complete: the run ends after its last token."""
        ...


class Guided:
    """A constraint beside a run whose tokens are chosen on the device: each token
    reaches :meth:`Constraint.accept` (a read from the device) only when the next
    mask or :meth:`done_after` needs it, so unconstrained runs never wait."""

    def __init__(self, constraint: Constraint) -> None:
        self.constraint = constraint
        self._chosen: list[torch.Tensor] = []
        self._accepted = 0

    def chose(self, token: torch.Tensor) -> None:
        """The token chosen at this step (a 0-d tensor, on the device)."""
        self._chosen.append(token)

    def _catch_up(self, count: int) -> None:
        for token in self._chosen[self._accepted : count]:
            self.constraint.accept(int(token))
        self._accepted = max(self._accepted, count)

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` (``(1, vocab)``) with the tokens not allowed next at ``-inf``. A
        constraint already done allows nothing: its run ends before this token, so
        the scores stay as they are."""
        self._catch_up(len(self._chosen))
        if self.constraint.done():
            return scores
        allowed = self.constraint.allowed_mask(scores.shape[-1])
        if allowed is None:
            return scores
        allowed = allowed.to(device=scores.device, dtype=torch.bool, non_blocking=True)
        return scores.masked_fill(~allowed.reshape(1, -1), -float("inf"))

    def done_after(self, count: int) -> bool:
        """Whether the constraint is done once the run's first ``count`` tokens are in."""
        self._catch_up(count)
        return self.constraint.done()
