"""What a kind of file adds to a plain artifact's save and load: a plug-in.

``Precompile.save`` and ``Precompile.load`` handle one compiled function, its
bound weights and its kernels. A generator file (its step, with the generator's
records) and a distributed job's file (each rank's shard, its live mesh) extend
that; each is a :class:`FileExtension` listed in ``serialization/extensions.py``,
asked at the same points of every save and load, and nowhere special-cased.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .opened import OpenedFile

# The model libraries a file served by torch alone (a generator's) must not import.
MODEL_LIBRARIES = ("transformers", "diffusers", "sentence_transformers")


class FileExtension:
    """One kind of file. The defaults add nothing; an extension overrides the points it
    needs. One instance per file being loaded (:meth:`for_file`)."""

    # Top-level packages this kind of file is served without: save leaves attributes
    # naming them out of the module's stand-in, and its builder refuses a file whose
    # load would import one (``serialization/load_imports.py``).
    serves_without: tuple[str, ...] = ()

    @classmethod
    def parts_to_save(cls, obj: Any) -> tuple[Any, dict[str, bytes]] | None:
        """``(artifact, sections)`` when ``obj`` is of this kind: the artifact saved as
        usual, and the sections this kind adds. None for another object."""
        return None

    @classmethod
    def for_file(cls, file: OpenedFile, model: Any, mesh: Any) -> FileExtension | None:
        """This kind's part of loading ``file`` (its checks done), or None when the file
        is not of this kind; ``model`` and ``mesh`` are what the caller passed to load."""
        return None

    def weights(self, skeleton: dict[str, Any], tensors: dict[str, Any]) -> Any:
        """The module to run on the saved weights, or None to build the plain stand-in."""
        return None

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Around the rest of the load, from its weights to what it returns: work that
        may run beside it (ended, and waited for, when the block exits, failed or not)."""
        yield

    @contextlib.contextmanager
    def deserializing(self) -> Iterator[None]:
        """Around the rebuilding of the compiled functions."""
        yield

    def loaded(self, artifact: Any) -> Any:
        """What ``load`` returns for the loaded ``artifact``."""
        return artifact
