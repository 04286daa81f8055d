"""The exceptions torch_precompile raises; all derive from PrecompileError."""

from __future__ import annotations

__all__ = [
    "ArtifactCorruptedError",
    "ArtifactVersionError",
    "CaptureError",
    "DistributedLayoutError",
    "GuardError",
    "IncompatibleSystemError",
    "KernelDirectoryError",
    "ModelDirectoryError",
    "PrecompileError",
    "QuantizationError",
    "UntrustedArtifactError",
]


class PrecompileError(RuntimeError):
    """Base class of every error torch_precompile raises on purpose."""


class CaptureError(PrecompileError):
    """Dynamo could not capture the model as one graph (graph break, unsupported code)."""


class QuantizationError(CaptureError, ValueError):
    """``compile_generator(weights=...)`` cannot quantize the model as asked: an unknown
    format, or a linear layer whose shape the format cannot hold (the message names it)."""


class ModelDirectoryError(PrecompileError):
    """``torch-precompile build`` was given a directory it cannot load a model from."""


class GuardError(PrecompileError):
    """An artifact was called with inputs or state that break one of its guards."""


class ArtifactCorruptedError(PrecompileError):
    """The file is not an artifact, or it is truncated or altered."""


class ArtifactVersionError(PrecompileError):
    """The file was written by a newer torch_precompile format version."""


class IncompatibleSystemError(PrecompileError):
    """The artifact was built for another torch, Python, CPU instruction set or GPU."""


class DistributedLayoutError(IncompatibleSystemError):
    """A distributed artifact met another world size, mesh or placement than it was saved for.

    ``saved`` and ``current`` describe both sides in words; the message names
    both and what to do.
    """

    def __init__(self, what: str, saved: str, current: str, fix: str) -> None:
        self.what = what
        self.saved = saved
        self.current = current
        self.fix = fix
        super().__init__(
            f"{what}: the artifact was saved for {saved}, this job has {current}; {fix}"
        )

    def __reduce__(self) -> tuple[type, tuple[str, str, str, str]]:
        return type(self), (self.what, self.saved, self.current, self.fix)


class UntrustedArtifactError(PrecompileError):
    """A verify_key was given and the file's signature is missing, wrong or broken."""


class KernelDirectoryError(PrecompileError):
    """The shipped C++ kernels cannot be written to or loaded from their directory.

    Raised at load when the kernel directory is missing and cannot be made, is
    full, is not writable, is on a ``noexec`` mount, or is not private to this
    user. ``directory`` names it and ``cause`` says what failed; the message
    says how to choose another one (``TORCH_PRECOMPILE_KERNEL_DIR``).
    """

    def __init__(self, directory: str, cause: str) -> None:
        self.directory = directory
        self.cause = cause
        super().__init__(
            f"cannot use the kernel directory {directory!r}: {cause}. The artifact's "
            "compiled C++ kernels are written there and loaded as shared objects, so it must "
            "be private to this user (not writable by others), on a filesystem that allows "
            "executing files (not mounted noexec) and with free space. Set "
            "TORCH_PRECOMPILE_KERNEL_DIR to such a directory (default: "
            "$TMPDIR/torch_precompile-<uid>), or set TORCH_PRECOMPILE_SHIPPED_KERNELS=0 to "
            "compile the kernels at load instead (needs a C++ compiler, takes seconds)"
        )

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (self.directory, self.cause)


class GenerationLimitError(PrecompileError, ValueError):
    """A generate call asks for more than the generator was built for.

    Raised before any kernel runs: more rows than ``max_batch``, or a prompt
    plus new tokens longer than ``max_length`` (the key/value cache's size).
    The message names the limit and says how to build a larger generator.
    """
