"""Capture of a parallelised model once for every rank: the stages trace it under
``compile_on_one_rank``, so a rank's coordinate is computed at run time."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .._compat import distributed as _cdist
from .placement import _dtensor_type


def _holds_dtensors(model: Any) -> bool:
    owner = model if isinstance(model, torch.nn.Module) else getattr(model, "__self__", None)
    dtensor = _dtensor_type() if isinstance(owner, torch.nn.Module) else None
    return dtensor is not None and any(isinstance(p, dtensor) for p in owner.parameters())


def traced_on_one_rank(model: Any) -> bool:
    """Whether ``model`` is traced under ``compile_on_one_rank``: it holds DTensors, and
    this torch has it (so that the compiled code is the same for every rank). The
    capture decides it once; every later stage traces the same way."""
    return _holds_dtensors(model) and _cdist.compile_on_one_rank_available()


@contextlib.contextmanager
def one_rank_tracing(enabled: bool) -> Iterator[None]:
    """Trace under ``compile_on_one_rank`` where ``enabled`` (:func:`traced_on_one_rank`)."""
    if enabled:
        with _cdist.compile_on_one_rank():
            yield
    else:
        yield
