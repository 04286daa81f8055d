"""The exceptions torch_precompile raises; all derive from PrecompileError."""

from __future__ import annotations

__all__ = [
    "ArtifactCorruptedError",
    "ArtifactVersionError",
    "CaptureError",
    "GuardError",
    "IncompatibleSystemError",
    "PrecompileError",
    "UntrustedArtifactError",
]


class PrecompileError(RuntimeError):
    """Base class of every error torch_precompile raises on purpose."""


class CaptureError(PrecompileError):
    """Dynamo could not capture the model as one graph (graph break, unsupported code)."""


class GuardError(PrecompileError):
    """An artifact was called with inputs or state that break one of its guards."""


class ArtifactCorruptedError(PrecompileError):
    """The file is not an artifact, or it is truncated or altered."""


class ArtifactVersionError(PrecompileError):
    """The file was written by a newer torch_precompile format version."""


class IncompatibleSystemError(PrecompileError):
    """The artifact was built for another torch, Python, CPU instruction set or GPU."""


class UntrustedArtifactError(PrecompileError):
    """A verify_key was given and the file's signature is missing, wrong or broken."""
