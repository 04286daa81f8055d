"""The runner: a generator file's step over the slots of one static cache.

Each of the cache's ``max_batch`` rows is a *slot*. A run joining a free slot is
prefilled alone (batch 1, the step's prefill variant on views of that slot's rows) from
cache index 0, so in a slot the cache index is the position; then every step decodes all
slots at once with the slot step (``start`` a ``(batch,)`` tensor, each row its own
offset). A step runs on the first rows only: as many as the highest busy slot needs,
rounded up to a power of two (:func:`step_batches`; one row alone where the file decodes
``generate``'s tokens by its slot step, so one client steps as ``generate`` does). Free
slots among them decode too (token 0 at the index just past the entries the slot keeps,
attending to those, so no NaN and no kept entry overwritten): a few shapes, each
recorded once, and a row's result never depends on its neighbours. A slot's kept entries
are what a later prompt that begins with the same tokens reuses:
:meth:`SlotRunner.prefill` at ``start`` fills only the rest (the file's prefill program
at an offset, as ``generate``'s decode steps run it), and a long prompt is prefilled so,
a chunk at a time.

The runner's cache is its own, not the ``Generator``'s: ``Generator.generate``
in the same process touches other tensors.

The scheduler's loop asks a runner for what :class:`Runner` names; the other
runner, ``generate``'s rows in lockstep, is :class:`~.batch.LockstepRunner`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from .errors import NotServable


class Loaded(Protocol):
    """What the engine asks of a loaded generator file (the runtime's ``Generator``)."""

    spec: Any

    def run_step(self, *args: Any) -> Any: ...

    def loop(
        self, fixed: Sequence[torch.Tensor], *, settled: bool = True
    ) -> Callable[..., Any]: ...

    def unrecorded(self) -> AbstractContextManager[None]: ...

    def settle(self) -> None: ...


class Runner(Protocol):
    """The programs over a cache, as the scheduler's loop steps them: ``slots`` rows,
    each decode step over the first ``batch_for(top)`` of them."""

    device: torch.device
    slots: int

    def decode(self, batch: int) -> torch.Tensor:
        """One decode step of the first ``batch`` rows: their logits ``(batch, vocab)``."""
        ...

    def advance(self, batch: int, tokens: torch.Tensor) -> None:
        """The rows take ``tokens`` (on the device) as their next input."""
        ...

    def free(self, slot: int, kept: int = 0) -> None: ...

    def batch_for(self, top: int) -> int: ...


def step_batches(slots: int, one_row: bool) -> list[int]:
    """The batches a decode step runs at: powers of two below ``slots``, then ``slots``;
    from 1 where the slot step takes one row (``one_row``: a file that decodes
    ``generate``'s tokens by it, or has one slot), else from 2 (a GPU build's slot
    step serves 2..N rows; its one row is the decode step's shape)."""
    first = 0 if one_row or slots == 1 else 1
    return [b for b in (2**i for i in range(first, slots.bit_length())) if b < slots] + [slots]


class SlotRunner:
    """The cache, each slot's next token and index on the device, and the steps."""

    def __init__(self, generator: Loaded) -> None:
        spec = generator.spec
        if not spec.slots:
            raise NotServable(
                "this generator file has no slot decode step (built before serve existed, or a "
                "model whose attention cannot take a per-row mask: ALiBi families such as Bloom "
                "and Falcon): build it again with compile_generator, or use Generator.generate"
            )
        self.spec, self.step = spec, generator.run_step
        self.device = torch.device(spec.device)
        slots, length = spec.max_batch, spec.max_length
        self.slots, self.unrecorded = slots, generator.unrecorded
        dtype = getattr(torch, spec.dtype)
        self.cache = [
            torch.zeros((slots, h, length, d), dtype=dtype, device=self.device)
            for h, d in spec.kv_shapes
        ]
        self.full = torch.ones((slots, length), dtype=torch.long, device=self.device)
        # Per slot, on the device: its next input token, the cache index it goes to, and
        # 1 while a run decodes in the slot (a free slot decodes token 0 past its entries).
        self.ids = torch.zeros((slots, 1), dtype=torch.long, device=self.device)
        self.index = torch.zeros((slots,), dtype=torch.long, device=self.device)
        self.member = torch.zeros((slots,), dtype=torch.long, device=self.device)
        self.batches = step_batches(slots, spec.decode_by_slots)
        # Per batch, the decode step as one loop over views of the first rows (the
        # guards are checked at its first call: the runner owns the model and cache).
        self._steps: dict[int, Callable[..., Any]] = {
            batch: generator.loop([t[:batch] for t in self.cache]) for batch in self.batches
        }

    def prefill(
        self, slot: int, prompt: list[int] | tuple[int, ...], start: int = 0
    ) -> torch.Tensor:
        """The prompt into the slot's rows from index ``start`` (the entries before it
        already there): its last position's logits."""
        n, length = len(prompt), self.spec.max_length
        ids = torch.tensor([prompt], dtype=torch.long)
        if self.device.type == "cuda":  # pinned, so the copy does not wait for the device
            ids = ids.pin_memory()
        ids = ids.to(self.device, non_blocking=True)
        mask = torch.zeros((1, length), dtype=torch.long, device=self.device)
        mask[:, : start + n] = 1
        positions = torch.arange(start, start + n, device=self.device)[None]
        at = self.spec.start_of(torch.tensor(start, dtype=torch.long, device=self.device), 1, n)
        rows = [t[slot : slot + 1] for t in self.cache]
        with self.unrecorded():  # no CUDA graph a prompt length (lean/cudagraphs.py)
            return self.step(ids, mask, positions, at, *rows)[:, -1, :].float()

    def filling(self, slot: int, length: int) -> None:
        """The slot's first ``length`` entries are written, more to come: the decode
        steps until then write past them."""
        self.index[slot] = length

    def copy(self, source: int, slot: int, length: int) -> None:
        """The first ``length`` cache entries of ``source`` into ``slot`` (a prompt
        prefilled once for several choices)."""
        for t in self.cache:
            t[slot, :, :length].copy_(t[source, :, :length])

    def joined(self, slot: int, token: torch.Tensor, length: int) -> None:
        """The slot's run decodes ``token`` (on the device) next, at index ``length``."""
        self.ids[slot, 0] = token
        self.index[slot], self.member[slot] = length, 1

    def decode(self, batch: int) -> torch.Tensor:
        """One decode step of the first ``batch`` slots (views of their rows)."""
        index = self.index[:batch]
        out = self._steps[batch](self.ids[:batch], self.full[:batch], index[:, None].clone(), index)
        return out[:, -1, :].float()

    def advance(self, batch: int, tokens: torch.Tensor) -> None:
        """The busy slots of the first ``batch`` take ``tokens`` as their next input."""
        member = self.member[:batch]
        self.ids[:batch].copy_((tokens * member)[:, None])
        self.index[:batch].add_(member)

    def free(self, slot: int, kept: int = 0) -> None:
        """The slot's rows go back to token 0, at index ``kept`` (after the steps
        launched): its first ``kept`` entries stay as they are."""
        self.ids[slot], self.index[slot], self.member[slot] = 0, kept, 0

    def batch_for(self, top: int) -> int:
        """The batch a step runs at when slot ``top`` is the highest busy one."""
        return next(b for b in self.batches if b > top)
