"""A generator's file: the step's file, with the generator's records beside it.

:class:`GeneratorFile` is the file extension (``file/extension.py``) that saves a
:class:`~.generator.Generator` as its step's artifact plus two sections (its
spec, and its tokenizer when built with one), and that loads it back: the
record is read and checked with the header, the device's lazy set-up starts
beside the load of the step (``warm.py``), and load returns the generator, which
waits for that set-up before a step that may record a CUDA graph.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .._errors import ArtifactCorruptedError
from ..file import trace as _trace
from ..file.extension import MODEL_LIBRARIES, FileExtension
from ..file.sections import GENERATOR, GENERATOR_TOKENIZER
from .generator import Generator
from .generator_spec import GeneratorSpec
from .warm import beside_load

if TYPE_CHECKING:
    from ..file.opened import OpenedFile


class GeneratorFile(FileExtension):
    """A generator's file; load returns the :class:`~.generator.Generator`."""

    serves_without = MODEL_LIBRARIES  # served where the model's library is absent

    def __init__(self, path: str, spec: GeneratorSpec, tokenizer: bytes | None) -> None:
        self.path, self.spec, self.tokenizer = path, spec, tokenizer
        self._beside: list[threading.Thread] = []

    @classmethod
    def parts_to_save(cls, obj: Any) -> tuple[Any, dict[str, bytes]] | None:
        if not isinstance(obj, Generator):
            return None
        sections = {GENERATOR: json.dumps(obj.spec.to_json()).encode()}
        if obj.tokenizer_json is not None:
            sections[GENERATOR_TOKENIZER] = obj.tokenizer_json
        return obj.step, sections

    @classmethod
    def for_file(cls, file: OpenedFile, model: Any, mesh: Any) -> GeneratorFile | None:
        sections = file.sections
        if GENERATOR not in sections:
            return None
        try:
            data = json.loads(bytes(sections[GENERATOR]))
        except ValueError as exc:
            raise ArtifactCorruptedError(
                f"{file.path}: the '{GENERATOR}' section is not JSON ({exc}); build the "
                "generator again with compile_generator and Precompile.save"
            ) from None
        tokenizer = None
        if GENERATOR_TOKENIZER in sections:
            tokenizer = bytes(sections[GENERATOR_TOKENIZER])
        return cls(file.path, GeneratorSpec.from_json(data, file.path), tokenizer)

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """The device's lazy set-up (``warm.py``) beside the step's load. A load that
        succeeds hands it on to the generator (:meth:`loaded`), a failed one waits for it."""
        self._beside = beside_load(self.spec)
        try:
            yield
        except BaseException:
            with _trace.phase("warm-up wait"):
                for thread in self._beside:
                    thread.join()
            raise

    def loaded(self, artifact: Any) -> Generator:
        return Generator(artifact, self.spec, self.tokenizer, beside=self._beside)
