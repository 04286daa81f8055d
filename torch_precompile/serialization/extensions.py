"""The kinds of file that extend a plain artifact's (``file/extension.py``), in the
order ``Precompile.save`` and ``Precompile.load`` ask them."""

from __future__ import annotations

from ..distributed.binding import DistributedFile
from ..file.extension import FileExtension
from ..runtime.generator_file import GeneratorFile

EXTENSIONS: tuple[type[FileExtension], ...] = (GeneratorFile, DistributedFile)
