"""The artifact file: its container, typed header, stand-in module, save and load.

- :mod:`.layout`: the byte layout (magic, fixed fields, flags), regular-file checks;
- :mod:`.write`, :mod:`.read`: the checksummed, optionally signed container of
  named byte sections (atomic write; whole-file or header-first reads);
- :mod:`.header`: the typed header ``Precompile.save`` writes, read back once;
- :mod:`.sections`: every section name the file uses;
- :mod:`.standin`: a model's weights and plain attributes, without its class;
- :mod:`.save`, :mod:`.load`: ``Precompile.save`` / ``Precompile.load``.

The package exports the container (no torch import): ``torch-precompile
inspect`` reads a header with it and :mod:`.header`, without torch's compiler.
"""

from __future__ import annotations

from .layout import FORMAT_VERSION, MAGIC, ArtifactInfo, looks_like_artifact
from .read import (
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
