"""A long build's progress on stderr: one line rewritten in place on a terminal, plain
lines in a log.

``compile_generator`` logs each program it starts with ``extra={"progress": ...}``
(a :class:`~torch_precompile.generation.build_progress.BuildProgress`: the
program, n of m, the build's start). On a terminal the line is redrawn each
second with the time elapsed; elsewhere each record is one line, so a log reads
in order. Warnings pass through; the stages' other INFO records are left out.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO

PREFIX = "torch-precompile"


class ProgressHandler(logging.Handler):
    """Shows progress records on ``stream`` (see the module docstring)."""

    def __init__(self, stream: TextIO, tty: bool) -> None:
        super().__init__(logging.INFO)
        self.stream = stream
        self.tty = tty
        self._current: Any = None  # the progress shown on the open line
        self._open = False  # a progress line is drawn and not ended
        self._lock_line = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def emit(self, record: logging.LogRecord) -> None:
        progress = getattr(record, "progress", False)
        if progress is False and record.levelno < logging.WARNING:
            return
        text = f"{PREFIX}: {record.getMessage()}"
        with self._lock_line:
            if self.tty and progress:
                self._current = progress
                self._draw(f"{PREFIX}: compiling {progress}")
                self._start_ticker()
                return
            self._current = None
            self._end_line()
            self.stream.write(text + "\n")
            self.stream.flush()

    def line(self, text: str) -> None:
        """A plain line of the build's own (a step, the end), after any open progress line."""
        with self._lock_line:
            self._current = None
            self._end_line()
            self.stream.write(f"{PREFIX}: {text}\n")
            self.stream.flush()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock_line:
            self._end_line()
        super().close()

    def _draw(self, text: str) -> None:
        self.stream.write("\r\x1b[K" + text)
        self.stream.flush()
        self._open = True

    def _end_line(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False

    def _start_ticker(self) -> None:
        if self._ticker is not None:
            return

        def tick() -> None:
            while not self._stop.wait(1.0):
                with self._lock_line:
                    if self._current is not None:
                        self._draw(f"{PREFIX}: compiling {self._current}")

        self._ticker = threading.Thread(target=tick, name="torch-precompile-progress", daemon=True)
        self._ticker.start()


@contextlib.contextmanager
def build_progress(stream: TextIO = sys.stderr) -> Iterator[ProgressHandler]:
    """The package logger's progress shown on ``stream`` while the block runs."""
    tty = bool(getattr(stream, "isatty", lambda: False)())
    handler = ProgressHandler(stream, tty)
    log = logging.getLogger("torch_precompile")
    old_level = log.level
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
        handler.close()
