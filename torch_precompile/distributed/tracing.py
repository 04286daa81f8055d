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


@contextlib.contextmanager
def one_rank_tracing(model: Any) -> Iterator[None]:
    """Trace a model holding DTensors under ``compile_on_one_rank`` (where this
    torch has it), so that the compiled code is the same for every rank; any
    other model is traced as it is."""
    if _holds_dtensors(model) and _cdist.compile_on_one_rank_available():
        with _cdist.compile_on_one_rank():
            yield
    else:
        yield
