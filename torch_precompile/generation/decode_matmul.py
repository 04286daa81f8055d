"""A decode step's one-row matmuls with a bias, as reductions Inductor can tune and fuse.

Under ``coordinate_descent_tuning`` Inductor turns a one-row ``mm`` on a GPU
into a Triton reduction (``(a.unsqueeze(2) * b.unsqueeze(0)).sum(1)``), tuned
to read the weight at memory speed and fused with what surrounds it. A
projection with a bias (Qwen2's ``q/k/v_proj``) is an ``addmm``, which it
leaves to cuBLAS: three GEMV launches a layer of a few microseconds each,
none fused. :func:`one_row_addmm` gives ``addmm`` the same treatment, the sum
and the bias taken in float32 as cuBLAS does, rounded once to the output's
dtype. The build uses it where Inductor would decompose ``mm``: on a GPU,
with coordinate descent tuning, at a static one-row batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def one_row_addmm(
    bias: torch.Tensor,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    *,
    beta: float = 1,
    alpha: float = 1,
) -> Any:
    """``torch.addmm(bias, mat1, mat2, beta=, alpha=)`` as a reduction when ``mat1`` is
    one row (a static size); ``NotImplemented`` otherwise (kept as it is)."""
    rows = mat1.shape[0]
    if type(rows) is not int or rows != 1:
        return NotImplemented
    if mat1.dtype != mat2.dtype or bias.dtype != mat1.dtype:
        return NotImplemented
    acc = (mat1.unsqueeze(2).float() * mat2.unsqueeze(0).float()).sum(dim=1)
    if alpha != 1:
        acc = acc * alpha
    if beta != 0:
        acc = acc + (bias.float() if beta == 1 else bias.float() * beta)
    return acc.to(mat1.dtype)


def decode_decompositions(
    options: dict[str, Any] | None, device: torch.device
) -> dict[Any, Callable[..., Any]]:
    """The decompositions a step compiled on ``device`` with these Inductor ``options``
    adds: :func:`one_row_addmm` on a GPU under coordinate descent tuning, else none."""
    if device.type in ("cpu", "mps") or not (options or {}).get("coordinate_descent_tuning"):
        return {}
    return {torch.ops.aten.addmm.default: one_row_addmm}
