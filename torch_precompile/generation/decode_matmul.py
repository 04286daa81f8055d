"""A generator step's small matmuls, as kernels Inductor generates and fuses.

A prefill's matmul over an inner dimension of one (the rotary embedding's
``inv_freq @ positions``, in float32) is the broadcast product it is
(:func:`outer_product`), on a GPU always: left to cuBLAS, its first call in a
process took 51-69 ms of a Llama-3.2-3B shape's first prefill on an H200
(torch.profiler, docs/measurements.md), a warmed-up cuBLAS notwithstanding. The
product is one multiplication an element, rounded once, as cuBLAS's is, and
Inductor fuses it into the cosines and sines that read it.

A decode step's one-row matmuls become reductions Inductor can tune and fuse.
Under ``coordinate_descent_tuning`` Inductor turns a one-row ``mm`` on a GPU
into a Triton reduction (``(a.unsqueeze(2) * b.unsqueeze(0)).sum(1)``), tuned
to read the weight at memory speed and fused with what surrounds it. Two
things here change how:

- A projection with a bias (Qwen2's ``q/k/v_proj``) is an ``addmm``, which
  Inductor leaves to cuBLAS: three GEMV launches a layer of a few
  microseconds each, none fused. :func:`one_row_addmm` gives ``addmm`` the
  reduction too, the sum and the bias taken in float32 as cuBLAS does,
  rounded once to the output's dtype.
- The row is computed once, into a buffer (:func:`one_row_mm`). Left to
  itself Inductor inlines the row's producer into the reduction, and every
  block of output columns computes it again: a 0.5B Qwen2's down projection
  computed ``silu(gate) * up`` for each of its 896 outputs, and took 5 to 9
  us a layer for 8.7 MB of weight on an H200.

The build uses both where Inductor would decompose ``mm``: on a GPU, with
coordinate descent tuning, at a static one-row batch (:func:`step_decompositions`);
on the CPU in float32 at a static one-row batch always. There ATen's ``mm`` of one
row (MKL's) read the weights at 12-15 GB/s on a 2-core EPYC whose DRAM streams 26;
Inductor's C++ reduction, inside a compiled step, read them at 21-28 GB/s: 30
layers of the SmolLM2-135M shape's linears took 15-20 ms a row against 38-42 ms
(docs/measurements.md, 2026-12-04). Over a batch captured dynamic the reduction
reads the weight once a row (76 ms at 8 rows against ``mm``'s 52), so a static
one-row step is compiled beside the slot step of 1..N rows (``rows.py``), whose
float32 matmuls are oneDNN's linear over the plain weight (``lean/linear_rows.py``,
:func:`onednn_rows`), as are a CPU prefill's: on a 2-core AMD EPYC with AVX-512 the 30
layers' linears took 18-26 ms at 2 to 16 rows where ``mm`` (MKL's) took 34-42, and
about half ``mm``'s time up to 512 rows (docs/measurements.md, 2026-12-06).

On the CPU a decode step's int8 weight-only matmul (``aten._weight_int8pack_mm``)
over its rows (one, or a batch of 1..N) becomes the reduction ``sum(x * q) * scale``
(:func:`int8_decode_rows`), a C++ kernel of Inductor's that reads the int8 weight a row
at a time, converting it in registers. ATen's CPU kernel for it converts float32
activations slowly: over the 210 linears of the SmolLM2-135M shape, one thread, it
took 179 ms a token, the reduction 25 ms and the float32 file's ``linear`` 80 ms
(docs/measurements.md). A prefill's converts the weight and multiplies by ``mm``
(:func:`int8_prefill_rows`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .._compat.joint import computed_once, default_decompositions
from .._compat.quantized_mm import INT8_MM
from ..lean import linear_rows

MM = torch.ops.aten.mm.default
BMM = torch.ops.aten.bmm.default
ADDMM = torch.ops.aten.addmm.default


def outer_product(mat1: torch.Tensor, mat2: torch.Tensor) -> Any:
    """``mat1 @ mat2`` (``mm`` or ``bmm``) over an inner dimension of one (a static size)
    as the broadcast product ``mat1 * mat2``; ``NotImplemented`` otherwise."""
    inner, rows = mat1.shape[-1], mat2.shape[-2]
    static = type(inner) is int and type(rows) is int
    if static and inner == rows == 1 and mat1.dtype == mat2.dtype:
        return mat1 * mat2
    return NotImplemented


def prefill_mm(mat1: torch.Tensor, mat2: torch.Tensor, *, tuned: bool = False) -> Any:
    """A GPU prefill's ``mm``: :func:`outer_product` over an inner dimension of one, else
    :func:`one_row_mm` when ``tuned`` (coordinate descent tuning), else Inductor's own."""
    product = outer_product(mat1, mat2)
    if product is not NotImplemented:
        return product
    return one_row_mm(mat1, mat2) if tuned else _inductors(MM, mat1, mat2)


def prefill_bmm(mat1: torch.Tensor, mat2: torch.Tensor) -> Any:
    """A GPU prefill's ``bmm``: :func:`outer_product` over an inner dimension of one, else
    Inductor's own."""
    product = outer_product(mat1, mat2)
    return product if product is not NotImplemented else _inductors(BMM, mat1, mat2)


def one_row_addmm(
    bias: torch.Tensor,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    *,
    beta: float = 1,
    alpha: float = 1,
) -> Any:
    """``torch.addmm(bias, mat1, mat2, beta=, alpha=)`` as a reduction when ``mat1`` is
    one row (a static size); Inductor's own decomposition of ``addmm`` otherwise."""
    if not _one_row(mat1, mat2) or bias.dtype != mat1.dtype:
        return _inductors(ADDMM, bias, mat1, mat2, beta=beta, alpha=alpha)
    row = computed_once(mat1)
    acc = (row.unsqueeze(2).float() * mat2.unsqueeze(0).float()).sum(dim=1)
    if alpha != 1:
        acc = acc * alpha
    if beta != 0:
        acc = acc + (bias.float() if beta == 1 else bias.float() * beta)
    return acc.to(mat1.dtype)


def one_row_mm(mat1: torch.Tensor, mat2: torch.Tensor) -> Any:
    """``mat1 @ mat2`` as a reduction over the row, computed once, when ``mat1`` is one
    row (a static size); Inductor's own decomposition of ``mm`` otherwise."""
    if not _one_row(mat1, mat2):
        return _inductors(MM, mat1, mat2)
    row = computed_once(mat1)
    return (row.unsqueeze(2) * mat2.unsqueeze(0)).sum(dim=1)


def cpu_rows_mm(mat1: torch.Tensor, mat2: torch.Tensor) -> Any:
    """A CPU decode step's float32 ``mat1 @ mat2``: :func:`one_row_mm` at a static row,
    else oneDNN's linear (:func:`cpu_mm`)."""
    return one_row_mm(mat1, mat2) if _one_row(mat1, mat2) else cpu_mm(mat1, mat2)


def cpu_rows_addmm(
    bias: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, **scale: float
) -> Any:
    """A CPU decode step's float32 ``torch.addmm(bias, mat1, mat2, beta=, alpha=)``:
    :func:`one_row_addmm` at a static row, else oneDNN's linear (:func:`cpu_addmm`)."""
    reduce = one_row_addmm if _one_row(mat1, mat2) else cpu_addmm
    return reduce(bias, mat1, mat2, **scale)


def cpu_mm(mat1: torch.Tensor, mat2: torch.Tensor) -> Any:
    """A CPU step's float32 ``mat1 @ mat2`` (a prefill's, a decode step's of several
    rows) as oneDNN's linear where ``mat2`` is a weight's transpose (:func:`onednn_rows`);
    over an inner dimension of one (the rotary embedding's) the broadcast product."""
    product = outer_product(mat1, mat2)
    if product is not NotImplemented:
        return product
    return onednn_rows(mat1, mat2, None, lambda: _inductors(MM, mat1, mat2))


def cpu_addmm(
    bias: torch.Tensor,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    *,
    beta: float = 1,
    alpha: float = 1,
) -> Any:
    """A CPU step's float32 ``torch.addmm(bias, mat1, mat2)`` as oneDNN's linear with the
    bias (:func:`onednn_rows`), where unscaled and the bias one per output."""

    def inductors() -> Any:
        return _inductors(ADDMM, bias, mat1, mat2, beta=beta, alpha=alpha)

    if beta != 1 or alpha != 1 or bias.dim() != 1 or bias.dtype != mat1.dtype:
        return inductors()
    return onednn_rows(mat1, mat2, bias, inductors)


def onednn_rows(
    mat1: torch.Tensor, mat2: torch.Tensor, bias: torch.Tensor | None, otherwise: Callable[[], Any]
) -> Any:
    """``mat1 @ mat2 (+ bias)`` as ``linear_rows`` (oneDNN's linear over the plain
    weight ``mat2.T``) where ``mat2`` is the transpose of a contiguous float32 weight
    (a linear layer's) and oneDNN is there; ``otherwise()`` where not."""
    weight = mat2.t()
    takes = (
        linear_rows.available()
        and mat1.dim() == mat2.dim() == 2
        and mat1.dtype == mat2.dtype == torch.float32
        and weight.is_contiguous()
    )
    return linear_rows.LINEAR_ROWS(mat1, weight, bias) if takes else otherwise()


def int8_decode_rows(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> Any:
    """``_weight_int8pack_mm(x, weight, scales)`` (``x @ (weight * scales[:, None]).T``)
    as a reduction when ``x`` is a decode step's rows: one (a static size) or a batch
    captured dynamic (1..max_batch, ``rows.py``): ``x * q`` summed in ``x``'s dtype, then
    scaled, as ATen's kernel does; the operator kept for a static batch of several."""
    rows = x.shape[0]
    if type(rows) is int and rows != 1:
        return NotImplemented
    row = computed_once(x)
    return (row.unsqueeze(1) * weight.unsqueeze(0).to(x.dtype)).sum(dim=2) * scales.to(x.dtype)


def int8_prefill_rows(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> Any:
    """``_weight_int8pack_mm(x, weight, scales)`` over a prefill's rows: the weight
    converted to ``x``'s dtype (one small buffer a linear), multiplied by ``mm``, then
    scaled. ATen's CPU kernel on float32 activations took 7.8 ms for one row of a 1536 x
    576 weight on a 2-core EPYC, float32 ``mm`` 0.12 ms (docs/measurements.md, 2026-12-04).
    The product is oneDNN's linear where it takes it (:func:`onednn_rows`)."""
    converted = weight.to(x.dtype).t()
    product = onednn_rows(x, converted, None, lambda: torch.mm(x, converted))
    return product * scales.to(x.dtype)


@functools.cache
def float32_only(op: Any, reduction: Callable[..., Any]) -> Callable[..., Any]:
    """``reduction`` where ``op``'s row operand is float32, Inductor's own decomposition
    of ``op`` otherwise (measured in float32 only). Cached: one function an ``op``, so
    that two tables built alike are equal."""

    def decomposed(*args: Any, **kwargs: Any) -> Any:
        row = args[1] if op is ADDMM else args[0]
        if row.dtype != torch.float32:
            return _inductors(op, *args, **kwargs)
        return reduction(*args, **kwargs)

    return decomposed


def _one_row(mat1: torch.Tensor, mat2: torch.Tensor) -> bool:
    """Whether ``mat1`` is one row, a static size, of ``mat2``'s dtype."""
    rows = mat1.shape[0]
    return type(rows) is int and rows == 1 and mat1.dtype == mat2.dtype


def _inductors(op: Any, *args: Any, **kwargs: Any) -> Any:
    """``op`` as Inductor's own decomposition table gives it (``NotImplemented`` where
    that has none, or declines: the operator is then kept)."""
    inductor = default_decompositions().get(op)
    return NotImplemented if inductor is None else inductor(*args, **kwargs)


def step_decompositions(
    options: dict[str, Any] | None, device: torch.device, prefill: bool
) -> dict[Any, Callable[..., Any]]:
    """The decompositions a step compiled on ``device`` with these Inductor ``options``
    adds, off a GPU none. Under coordinate descent tuning :func:`one_row_addmm` and
    :func:`one_row_mm`; a ``prefill`` step's ``mm`` and ``bmm`` take the
    :func:`outer_product` first (:func:`prefill_mm`, :func:`prefill_bmm`). A decode step
    keeps the table its measured speed was built with (docs/measurements.md). A CPU
    decode step's int8 matmul is :func:`int8_decode_rows`, a prefill's
    :func:`int8_prefill_rows`; its float32 one-row ``mm`` and ``addmm`` the reductions,
    of more rows (and a prefill's) oneDNN's linear (:func:`float32_only`)."""
    if device.type == "cpu":
        if prefill:
            return {
                INT8_MM: int8_prefill_rows,
                MM: float32_only(MM, cpu_mm),
                ADDMM: float32_only(ADDMM, cpu_addmm),
            }
        return {
            INT8_MM: int8_decode_rows,
            MM: float32_only(MM, cpu_rows_mm),
            ADDMM: float32_only(ADDMM, cpu_rows_addmm),
        }
    if device.type == "mps":
        return {}
    tuned = bool((options or {}).get("coordinate_descent_tuning"))
    table: dict[Any, Callable[..., Any]] = {ADDMM: one_row_addmm, MM: one_row_mm} if tuned else {}
    if prefill:
        table[MM] = functools.partial(prefill_mm, tuned=tuned)
        table[BMM] = prefill_bmm
    return table


FLOAT32_ONE_ROW_BYTES = 64 * 2**20


def one_row_step(weights: str | None, dtype: str, parameter_bytes: int) -> bool:
    """Whether a CPU build compiles a slot step of one static row beside that of 1..N
    rows (``rows.py``): for quantized ``weights`` always; in float32 where the model's
    parameters hold at least :data:`FLOAT32_ONE_ROW_BYTES`, past a CPU's caches, where
    the one-row reductions read DRAM at twice ``mm``'s speed. A smaller model's step
    is bound by its calls more than by its reads, and the program is one more compile
    (10-30 s on a 2-core CPU)."""
    if weights is not None:
        return True
    return dtype == "float32" and parameter_bytes >= FLOAT32_ONE_ROW_BYTES


def int8_options(
    options: dict[str, Any] | None, weights: str | None, device: torch.device
) -> dict[str, Any] | None:
    """Inductor's ``options`` for a build of these ``weights`` on ``device``: a CUDA int8
    build tunes its one-row products by coordinate descent unless ``options`` says
    otherwise. Without it Inductor does not fuse the weight's int8-to-bf16 conversion
    into the product, and the int8 file decoded at 0.57x the bf16 file's speed on an
    H200 (the Llama-3.2-3B shape), with it at 1.38x (docs/measurements.md)."""
    if weights != "int8" or device.type != "cuda" or "coordinate_descent_tuning" in (options or {}):
        return options
    return {**(options or {}), "coordinate_descent_tuning": True}
