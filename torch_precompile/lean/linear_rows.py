"""``torch.ops.torch_precompile.linear_rows``: a float32 linear of a few rows by oneDNN.

A CPU build's decode steps over a batch of rows call it for their matmuls
(``generation/decode_matmul.py`` says where and why); Inductor's generated wrapper
calls it as it calls any operator it has no lowering for, so a file that uses it
loads wherever this package is imported (``lean/wrapper.py`` imports this module).
Its CPU kernel is oneDNN's linear (``mkldnn._linear_pointwise``) over the plain
weight, which the file keeps as it is; a Meta kernel gives its shape to the
compiler's fake tensors. An operator of our own, not ``mkldnn._linear_pointwise``
itself: Inductor lowers that one only over weights frozen into the graph, and fuses
it with what follows (a residual's add) into an operator with no fake kernel.
"""

from __future__ import annotations

import torch

_LIBRARY = torch.library.Library("torch_precompile", "DEF")
_LIBRARY.define("linear_rows(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")


def _cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise.default(
        x.contiguous(), weight.contiguous(), bias, "none", [], ""
    )


def _meta(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


_LIBRARY.impl("linear_rows", _cpu, "CPU")
_LIBRARY.impl("linear_rows", _meta, "Meta")

LINEAR_ROWS = torch.ops.torch_precompile.linear_rows.default


def available() -> bool:
    """Whether this torch has oneDNN on this CPU (the kernel's condition)."""
    return bool(torch.backends.mkldnn.is_available())
