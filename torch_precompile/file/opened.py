"""An artifact file opened for ``Precompile.load``: its typed header, its sections by
name (each read and checked once, when first asked for) and its shipped kernels.

No torch import: what the file holds is decided here, what it runs is not.
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .._errors import ArtifactCorruptedError
from . import sections as names
from . import trace as _trace
from .header import Header
from .reader import ArtifactReader, open_artifact
from .treehash import TreeCheck

Kernels = Mapping[str, bytes | memoryview]


class Sections:
    """The file's sections by name, each read and checked once, when first asked for
    (the reader keeps them); a section no one asks for is never read."""

    def __init__(self, reader: ArtifactReader) -> None:
        self._reader = reader
        self._names = set(reader.names())

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def _need(self, name: str) -> None:
        if name not in self._names:
            raise ArtifactCorruptedError(
                f"{self._reader.path}: the artifact has no {name!r} section; re-save it"
            )

    def __getitem__(self, name: str) -> bytes:
        self._need(name)
        return self._reader.read(name)

    def mapped(self, name: str) -> memoryview:
        """Section ``name`` as a checked read-only view of the mapped file (no copy)."""
        self._need(name)
        return self._reader.view(name)

    def copied_out(self, name: str) -> tuple[memoryview, TreeCheck | None]:
        """Section ``name`` as a view of the mapped file to copy out at once, and the
        check its copier feeds (None: checked on a thread meanwhile); either way
        checked before ``load`` returns (:meth:`ArtifactReader.view_to_copy`)."""
        self._need(name)
        return self._reader.view_to_copy(name)

    def forget(self, name: str) -> None:
        """Section ``name`` was copied out and is not needed again (the weights)."""
        self._reader.forget(name)

    def reader_of(self, name: str) -> Callable[[], bytes]:
        """Reads section ``name`` when called (after the load too: the file stays open)."""
        self._need(name)
        return functools.partial(self._reader.read, name)

    def names(self) -> list[str]:
        return self._reader.names()

    def entries(self, prefix: str) -> dict[str, dict[str, Any]]:
        """The header's entries of the sections named ``prefix<key>``, by key."""
        return {
            entry["name"][len(prefix) :]: entry
            for entry in self._reader.info.sections
            if entry["name"].startswith(prefix)
        }


class ShippedKernels(Mapping[str, memoryview]):
    """The ``kernel/<key>`` sections by key, each read and checked when a graph first
    asks for it; :meth:`sha256` and :meth:`length` answer from the checked header,
    so naming the kernel directory and finding a kernel already in it read nothing."""

    def __init__(self, sections: Sections) -> None:
        self._sections = sections
        self._entries = sections.entries(names.KERNEL_PREFIX)

    def __getitem__(self, key: str) -> memoryview:
        if key not in self._entries:
            raise KeyError(key)
        return self._sections.mapped(names.KERNEL_PREFIX + key)

    def __contains__(self, key: object) -> bool:
        return key in self._entries  # Mapping's would read the kernel

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def sha256(self, key: str) -> str:
        entry = self._entries[key]  # a kernel of 64 MiB or more has a tree digest
        return str(entry.get("sha256") or entry["sha256_tree"])

    def length(self, key: str) -> int:
        return int(self._entries[key]["length"])


def _v1_kernels(data: bytes) -> dict[str, bytes | memoryview]:
    """Format version 1's ``kernels`` section: ``u64 L | JSON {key: [offset, length]} | bytes``."""
    n = int.from_bytes(data[:8], "little")
    try:
        index = json.loads(data[8 : 8 + n])
        view = memoryview(data)[8 + n :]
        return {key: view[off : off + length] for key, (off, length) in index.items()}
    except (ValueError, TypeError) as exc:
        raise ArtifactCorruptedError(
            f"the kernels section is malformed ({exc}); re-save it"
        ) from None


class OpenedFile:
    """One artifact file being loaded: ``path``, ``header``, ``sections``, ``kernels``
    (the shipped kernels, ``{key: shared object}``: one ``kernel/<key>`` section each;
    format version 1 nested them in one ``kernels`` section)."""

    def __init__(self, path: str, reader: ArtifactReader) -> None:
        self.path = path
        self._reader = reader
        self.header = Header.decode(reader.info.format_version, reader.info.meta, path)
        self.sections = Sections(reader)
        self.kernels: Kernels
        if reader.info.format_version != 1:
            self.kernels = ShippedKernels(self.sections)
        elif names.KERNELS_V1 in self.sections:
            self.kernels = _v1_kernels(self.sections[names.KERNELS_V1])
        else:
            self.kernels = {}

    @classmethod
    def open(cls, path: str, f: io.FileIO, verify_key: bytes | None) -> OpenedFile:
        """The file opened as ``f`` (owned from here; closed if this raises), its header
        checked and typed. Use it in a ``with`` block (see :meth:`__exit__`)."""
        with _trace.phase("header"):
            reader = open_artifact(path, verify_key=verify_key, opened=f)
            try:
                return OpenedFile(path, reader)
            except BaseException:
                reader.close()
                raise

    def __enter__(self) -> OpenedFile:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        """Check the checksums computed beside the load (the weights'); the file then
        stays open for a later re-save. After an error, bytes that fail their
        checksum explain it, and the file is closed."""
        if exc is None:
            try:
                with _trace.phase("checksums"):  # waits for the weights' copies and hashes
                    self._reader.finish()  # the weights' checksum, computed while copied out
            except BaseException:
                self._reader.close()
                raise
            self._reader.settle()  # a re-save reads compiled from the bytes loaded, later
            return
        try:
            self._reader.finish()
        except ArtifactCorruptedError as corrupt:
            raise corrupt from exc
        finally:
            self._reader.close()
