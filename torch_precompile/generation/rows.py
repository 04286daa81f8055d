"""Which programs a generator build compiles: one for every batch where a capture allows.

Dynamo specialises a size of 1, so a step captured at a batch of several rows serves
2..N rows: batch 1 needed a prefill and a decode step of its own, each a whole
capture, AOTAutograd trace and Inductor compile of the same forward again (two of
the five programs of a build of 2..N rows, docs/measurements.md). Marked here
(:func:`mark`), the batch dimension is dynamic and the capture reasons about it
size-obliviously (PyTorch's ``backed_size_oblivious``), so that 1 stays in its range;
every size not marked is static. The prefill (its prompt's length marked too, from 2:
transformers branches on a one-token query) then serves 1..N rows; off a GPU the
decode step too. Where the model takes the slot step, it is ``generate``'s decode step
as well off a GPU (:func:`decodes_by_slots`): prefill and slot step, two programs. A GPU
build keeps a program a batch size (:func:`plan` says why) and its decode step.
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
    batch's range; else Dynamo's ``dynamic=True``, 1 specialised. ``slot``: the slot
    decode step (``start`` one offset a row, ``slots.py``)."""

    name: str
    batch: int
    length: int
    marked: bool = False
    slot: bool = False


def decodes_by_slots(slots: bool, device_type: str) -> bool:
    """Whether ``generate``'s decode steps run the slot step, so that the build compiles
    no decode step of its own: where the slot step is built (one rank), off a GPU. On
    an H200 the slot step of one row decoded the Qwen2.5-0.5B shape at 734 tokens/s,
    the decode step at 1,147-1,176 (docs/measurements.md, 2026-12-03)."""
    return slots and device_type != "cuda"


def plan(
    max_batch: int,
    batch: int,
    prompt: int,
    device_type: str,
    world: int,
    slots: bool,
    one_row: bool = False,
) -> list[tuple[Program, list[Program]]]:
    """The programs, each with those to compile as well when it leaves one row out;
    ``slots``: the model takes the slot step (``slots_work``). ``one_row`` (quantized
    weights, or a large float32 model: ``one_row_step``): a CPU build's slot step of
    1..N rows is preceded by one of a static row, which a call of one row takes (the
    first program whose guards hold): the quantized kernels of a batch captured
    dynamic decoded the SmolLM2-135M shape's 4 layers at 206 tokens/s in int8, 384 at
    a static row; a float32 row's matmuls are reductions at a static row only
    (``decode_matmul.py``, docs/measurements.md)."""
    by_slots = decodes_by_slots(slots, device_type)
    unmarked = [
        Program(program_name(b, s, max_batch, b == batch), b, s)
        for b in ((1,) if max_batch == 1 else (batch, 1))
        for s in (prompt, 1)
        if s > 1 or not by_slots
    ]
    one = Program("slot decode step, batch 1", 1, 1, slot=True)
    slot = []  # the server's (2..N rows), and generate's batch 1 where it decodes by it
    if slots and max_batch > 1:
        slot.append(Program(f"slot decode step, batch 2..{max_batch}", batch, 1, slot=True))
    if slots and (by_slots or max_batch == 1):
        slot.append(one)
    # Tensor parallel: the shards' rules guard the batch. CUDA: torch 2.11's Inductor
    # fails to lower the head's slice of a marked batch (KeyError 'unbacked_bindings',
    # one lent H200), so a GPU build keeps a program a batch size.
    if world > 1 or max_batch == 1 or device_type == "cuda":
        return [(p, []) for p in unmarked + slot]
    rows = f"batch 1..{max_batch}"
    prefill = (Program(f"prefill, {rows}", batch, prompt, True), [unmarked[-1 if by_slots else 2]])
    if by_slots:
        many_rows = Program(f"slot decode step, {rows}", batch, 1, True, True)
        if one_row:
            return [prefill, (one, []), (many_rows, [])]
        return [prefill, (many_rows, [one])]
    decode = (Program(f"decode, {rows}", batch, 1, True), [unmarked[3]])
    return [prefill, decode]  # no slot step (a model that takes one decodes by it)


def mark(program: Program, ids: torch.Tensor, positions: torch.Tensor, *rows: torch.Tensor) -> None:
    """Mark the example's dynamic dimensions if ``program`` is ``marked``: the batch of
    ``ids``, ``positions`` and ``rows`` (the mask, a slot step's starts, the cache), and a
    prompt's length in ``ids`` and ``positions``. No bounds: a guard the capture adds is
    a guard of the file (a bound would make it an error of the capture)."""
    if not program.marked:
        return
    for tensor in (ids, positions, *rows):
        _compat.mark_dynamic(tensor, 0, None, None)
    if program.length > 1:
        for tensor in (ids, positions):
            _compat.mark_dynamic(tensor, 1, None, None)
