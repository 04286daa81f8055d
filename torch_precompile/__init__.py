"""torch_precompile: PyTorch's ahead-of-time compilation as composable stages.

``Precompile.dynamo`` -> ``aot_autograd`` -> ``inductor`` -> ``precompile``,
then ``save``/``load`` of one self-contained file. Importing the package also
exposes ``torch.Precompile`` and ``torch.precompile``.

This module is the public API: the ``Precompile`` facade (it chains the stages and
adds nothing of its own), the types its stages return, and the errors.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

try:
    import torch
except ImportError as exc:  # a clear word on what to install, not a bare traceback
    raise ImportError(
        "torch_precompile needs PyTorch (torch>=2.11,<2.16): install it first, e.g. "
        "`pip install torch==2.13.0`, then `pip install -e .` (README, Set up)"
    ) from exc

from ._errors import (
    ArtifactCorruptedError,
    ArtifactVersionError,
    CaptureError,
    DistributedLayoutError,
    GenerationLimitError,
    GuardError,
    IncompatibleSystemError,
    KernelDirectoryError,
    ModelDirectoryError,
    PrecompileError,
    UntrustedArtifactError,
)
from .distributed.data_parallel import replicate_parameters, shard_parameters
from .distributed.shards import save_shard
from .guards import Guard, Guards
from .runtime.artifact import PrecompiledArtifact
from .runtime.bundle import bundle_variants
from .runtime.generator import Generator
from .serialization.load import load
from .serialization.save import save
from .stages.aot_autograd import AOTAutogradOutput, aot_autograd
from .stages.dynamo import DynamoOutput, dynamo, normalize_inputs
from .stages.first_call import settled
from .stages.inductor import InductorOutput, inductor
from .stages.pipeline import run_stages
from .stages.precompile import precompile
from .stages.size_one import with_size_one

__version__ = "0.1.0"

__all__ = [
    "AOTAutogradOutput",
    "ArtifactCorruptedError",
    "ArtifactVersionError",
    "CaptureError",
    "DistributedLayoutError",
    "DynamoOutput",
    "GenerationLimitError",
    "Generator",
    "Guard",
    "GuardError",
    "Guards",
    "IncompatibleSystemError",
    "InductorOutput",
    "KernelDirectoryError",
    "ModelDirectoryError",
    "Precompile",
    "PrecompileError",
    "PrecompiledArtifact",
    "UntrustedArtifactError",
    "replicate_parameters",
    "save_shard",
    "shard_parameters",
]

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
        size_one: bool = True,
        verbose: bool = False,
    ) -> PrecompiledArtifact:
        """Run the four stages in one call and return the artifact.

        A dynamic capture whose dimensions leave out size 1 (Dynamo specialises
        it; libraries branch on it) also gets one variant per such dimension at
        size 1, bundled in, unless ``size_one=False``. A forward that writes
        state on its first call gets a variant for the state it leaves. The
        model and the example inputs are left as they were.

        ``verbose=True`` shows each stage's start and duration on stderr (the
        ``torch_precompile`` logger's INFO records, for this call only).
        """

        def build(
            args: tuple[Any, ...], kwargs: dict[str, Any], settle: bool = True
        ) -> PrecompiledArtifact:
            artifact = run_stages(
                model,
                args,
                kwargs,
                dynamic=dynamic,
                size_oblivious=size_oblivious,
                decompositions=decompositions,
                mode=mode,
                options=options,
            )
            if not settle:
                return artifact
            return settled(artifact, args, kwargs, lambda: build(args, kwargs, settle=False))

        with _progress_on_stderr(verbose):
            args, kwargs = normalize_inputs(example_inputs), dict(example_kwargs or {})
            artifact = build(args, kwargs)
            if not size_one:
                return artifact
            variants = with_size_one(artifact, args, kwargs, build)
            if len(variants) == 1:
                return artifact
            return bundle_variants(variants)


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


torch.Precompile = Precompile  # type: ignore[attr-defined]
torch.precompile = sys.modules[__name__]  # type: ignore[attr-defined]
