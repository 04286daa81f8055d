"""torch_precompile: PyTorch's ahead-of-time compilation as composable stages.

``Precompile.dynamo`` -> ``aot_autograd`` -> ``inductor`` -> ``precompile``,
then ``save``/``load`` of one self-contained file. Importing the package also
exposes ``torch.Precompile`` and ``torch.precompile``.
"""

from __future__ import annotations

import sys

try:
    import torch
except ImportError as exc:  # a clear word on what to install, not a bare traceback
    raise ImportError(
        "torch_precompile needs PyTorch (torch>=2.11,<2.16): install it first, e.g. "
        "`pip install torch==2.13.0`, then `pip install -e .` (README, Set up)"
    ) from exc

from ._api import (
    AOTAutogradOutput,
    DynamoOutput,
    Generator,
    Guard,
    Guards,
    InductorOutput,
    Precompile,
    PrecompiledArtifact,
    replicate_parameters,
    save_shard,
    shard_parameters,
)
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

torch.Precompile = Precompile  # type: ignore[attr-defined]
torch.precompile = sys.modules[__name__]  # type: ignore[attr-defined]
