"""Serve the state a forward leaves behind on its first call.

Some forwards initialise state the first time they run: HF's classification
heads set ``config.problem_type``, modules build a buffer or a rotary table
lazily. The captured graph assumed the state before that write, and its guards
say so, so the call after the first one would be refused. ``settled`` finds
such writes in the precompile recording (the stubbed run of the bytecode, see
:mod:`._preserve`), checks whether the artifact's own guards accept the state
they leave, and if not compiles a second variant from that state. The
caller's objects are put back as they were afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .. import _compat
from ..runtime.artifact import PrecompiledArtifact
from ..runtime.bundle import bundle_variants
from .snapshot import Snapshot, Write, apply

log = logging.getLogger("torch_precompile")


def _after_first_call(artifact: PrecompiledArtifact) -> tuple[list[Write], dict[int, object]]:
    """The writes to persistent state (model, closures), with the stub's empty tensors
    replaced by zeros of the shape the real graph output has."""
    recording = artifact.recording
    if recording is None:
        return [], {}
    writes = [w for w in recording.writes if w.persistent]
    examples = {id(stub): example for stub, example in recording.placeholders}
    values = {
        id(w): _compat.concrete_zeros_like(examples[id(w.new)])
        for w in writes
        if id(w.new) in examples
    }
    return writes, values


def settled(
    artifact: PrecompiledArtifact,
    args: tuple,
    kwargs: dict,
    rebuild: Callable[[], PrecompiledArtifact],
) -> PrecompiledArtifact:
    """``artifact``, or a bundle of it and a variant built from the state its first
    call leaves, when its guards would refuse that state."""
    writes, values = _after_first_call(artifact)
    if not writes:
        return artifact
    roots = {"model": artifact.module, "args": args, "kwargs": kwargs}
    snapshot = Snapshot(roots)
    try:
        apply(writes, values)
        refusal = artifact.runtime.refusal(args, kwargs)
        if refusal is None:
            return artifact
        names = ", ".join(sorted({w.path for w in writes}))
        log.info(
            "precompile: the forward writes %s on its first call, and the artifact's guards "
            "refuse the state it leaves (%s); compiling a second variant from that state",
            names,
            str(refusal).splitlines()[0],
        )
        after = rebuild()
    finally:
        snapshot.restore()
    return bundle_variants([artifact, after])
