"""The artifact file: its container and typed header; no torch import.

- :mod:`.layout`: the byte layout (magic, fixed fields, flags), regular-file checks;
- :mod:`.write`, :mod:`.read_whole`, :mod:`.reader`: the checksummed, optionally signed
  container of named byte sections (atomic write; whole-file or header-first reads,
  sections on demand);
- :mod:`.header`: the typed header ``Precompile.save`` writes, read back once;
- :mod:`.opened`: a file opened for ``Precompile.load`` (header, sections, kernels);
- :mod:`.extension`: what a kind of file (a generator, a distributed job) adds;
- :mod:`.sections`: every section name the file uses.

The package exports the container: ``torch-precompile inspect`` reads a header
with it and :mod:`.header`, without torch's compiler.
"""

from __future__ import annotations

from .layout import FORMAT_VERSION, MAGIC, ArtifactInfo, looks_like_artifact
from .read_whole import (
    read_artifact,
    read_file,
    read_info,
    read_meta,
    read_prefix,
)
from .reader import ArtifactReader, open_artifact
from .write import write_artifact

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "ArtifactInfo",
    "ArtifactReader",
    "looks_like_artifact",
    "open_artifact",
    "read_artifact",
    "read_file",
    "read_info",
    "read_meta",
    "read_prefix",
    "write_artifact",
]
