"""The ``Precompile`` facade: chains the stages, adds nothing of its own."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

from ._aot_stage import aot_autograd
from ._artifact import PrecompiledArtifact
from ._distributed import save_shard
from ._dynamo_stage import dynamo
from ._inductor_stage import inductor
from ._precompile_stage import precompile
from .file.load import load
from .file.save import save

log = logging.getLogger("torch_precompile")


class Precompile:
    """Staged ahead-of-time compilation: dynamo -> aot_autograd -> inductor -> precompile.

    Each stage is a static method returning a frozen dataclass that unpacks
    like a tuple; ``save``/``load`` write and read one self-contained file.
    """

    dynamo = staticmethod(dynamo)
    aot_autograd = staticmethod(aot_autograd)
    inductor = staticmethod(inductor)
    precompile = staticmethod(precompile)
    save = staticmethod(save)
    load = staticmethod(load)
    save_shard = staticmethod(save_shard)

    @staticmethod
    def compile(
        model: Any,
        example_inputs: Any,
        example_kwargs: dict[str, Any] | None = None,
        *,
        dynamic: bool | None = None,
        size_oblivious: bool | None = None,
        decompositions: dict[Any, Any] | None = None,
        mode: str | None = None,
        options: dict[str, Any] | None = None,
        verbose: bool = False,
    ) -> PrecompiledArtifact:
        """Run the four stages in one call and return the artifact.

        ``verbose=True`` shows each stage's start and duration on stderr (the
        ``torch_precompile`` logger's INFO records, for this call only).
        """
        with _progress_on_stderr(verbose):
            captured = dynamo(
                model,
                example_inputs,
                example_kwargs,
                dynamic=dynamic,
                size_oblivious=size_oblivious,
            )
            joint = aot_autograd(captured, decompositions=decompositions)
            compiled = inductor(joint, mode=mode, options=options)
            return precompile(compiled)


@contextlib.contextmanager
def _progress_on_stderr(enabled: bool) -> Iterator[None]:
    """Show the stages' INFO records on stderr while a compile runs."""
    if not enabled:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("torch_precompile: %(message)s"))
    old_level = log.level
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
