"""Which programs a generator build compiles: one for every batch where a capture allows.

Dynamo specialises a size of 1, so a step captured at a batch of several rows serves
2..N rows: batch 1 needed a prefill and a decode step of its own, each a whole
capture, AOTAutograd trace and Inductor compile of the same forward again (two of
the five programs of a build of 2..N rows, docs/measurements.md). Marked here
(:func:`mark`), the batch dimension is dynamic and the capture reasons about it
size-obliviously (PyTorch's ``backed_size_oblivious``), so that 1 stays in its range;
every size not marked is static. The prefill (its prompt's length marked too, from 2:
transformers branches on a one-token query) then serves 1..N rows; off a GPU the
decode step too. A GPU build keeps a program a batch size (:func:`plan` says why).
Where an operator of this torch still branches on one row (a shape
guard ``Ne(batch, 1)``), :func:`takes_one` says so and the build compiles the
batch-1 program as before.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import _compat
from .build_progress import program_name


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of the step, traced at ``batch`` rows by ``length`` tokens:
    ``marked``, its batch (and a prompt's length) the only dynamic sizes, 1 kept in the
    batch's range; else Dynamo's ``dynamic=True``, 1 specialised."""

    name: str
    batch: int
    length: int
    marked: bool = False


def plan(
    max_batch: int, batch: int, prompt: int, device_type: str, world: int
) -> list[tuple[Program, list[Program]]]:
    """The programs, each with those to compile as well when it leaves one row out."""
    unmarked = [
        Program(program_name(b, s, max_batch, b == batch), b, s)
        for b in ((1,) if max_batch == 1 else (batch, 1))
        for s in (prompt, 1)
    ]
    # Tensor parallel: the shards' rules guard the batch. CUDA: torch 2.11's Inductor
    # fails to lower the head's slice of a marked batch (KeyError 'unbacked_bindings',
    # one lent H200), so a GPU build keeps a program a batch size.
    if world > 1 or max_batch == 1 or device_type == "cuda":
        return [(p, []) for p in unmarked]
    rows = f"batch 1..{max_batch}"
    prefill = (Program(f"prefill, {rows}", batch, prompt, True), [unmarked[2]])
    return [prefill, (Program(f"decode, {rows}", batch, 1, True), [unmarked[3]])]


def mark(program: Program, ids: torch.Tensor, positions: torch.Tensor, *rows: torch.Tensor) -> None:
    """Mark the example's dynamic dimensions if ``program`` is ``marked``: the batch of
    ``ids``, ``positions`` and ``rows`` (the mask, the cache), and a prompt's length in
    ``ids`` and ``positions``. No bounds: a guard the capture adds is a guard of the
    file (a bound would make it an error of the capture)."""
    if not program.marked:
        return
    for tensor in (ids, positions, *rows):
        _compat.mark_dynamic(tensor, 0, None, None)
    if program.length > 1:
        for tensor in (ids, positions):
            _compat.mark_dynamic(tensor, 1, None, None)
