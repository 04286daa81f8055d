"""Inductor's behaviours adjusted while this package compiles: layout heuristics that
add no guards, op packets resolved to overloads, torch 2.11's C++ bounds check, and
AVX2 byte loads at full speed."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .capture import BEFORE_2_13


def optimization_hint(shape_env: Any, expr: Any) -> int | None:
    """The example's value of ``expr``, read without adding a guard (None: no hint,
    an unbacked size on torch 2.11).

    torch 2.13 and 2.14 have ``ShapeEnv.optimization_hint`` (with a fallback for
    unbacked sizes); torch 2.11 has ``size_hint``, which substitutes the example's
    sizes. Only a layout heuristic reads it: ties break by position.
    """
    if hasattr(shape_env, "optimization_hint"):
        return int(shape_env.optimization_hint(expr))
    hint = shape_env.size_hint(expr, allow_none=True)
    return None if hint is None else int(hint)


def _argsort_sym_without_guards(
    shape_env: Any, seq: Sequence[Any], *, reverse: bool = False
) -> list[int]:
    """Inductor's ``argsort_sym`` (stride order for layout heuristics), minus its guards.

    PyTorch documents that order as "optimization-only": no correctness
    decision may rest on it. Yet it decides ``128*s1 > 128`` with a guard,
    which narrows a sequence range [1, 128] to [2, 128]. Here, what the shape
    environment knows statically decides, and the example's sizes break ties,
    without adding a guard.
    """
    import sympy

    def as_expr(v: Any) -> Any:
        return v.node.expr if isinstance(v, torch.SymInt) else sympy.sympify(v)

    def less(a: Any, b: Any) -> bool:
        known = shape_env._maybe_evaluate_static(sympy.Lt(a, b))
        if known is not None:
            return bool(known)
        hint_a, hint_b = optimization_hint(shape_env, a), optimization_hint(shape_env, b)
        return hint_a is not None and hint_b is not None and hint_a < hint_b

    def cmp(a: tuple[int, Any], b: tuple[int, Any]) -> int:
        if less(a[1], b[1]):
            return -1
        if less(b[1], a[1]):
            return 1
        return 1 if a[0] < b[0] else -1 if a[0] > b[0] else 0

    exprs = [(i, as_expr(v)) for i, v in enumerate(seq)]
    exprs = sorted(exprs, key=functools.cmp_to_key(cmp), reverse=reverse)
    return [i for i, _ in exprs]


@contextlib.contextmanager
def stride_order_without_guards(enabled: bool) -> Iterator[None]:
    """Keep Inductor's stride-order heuristic from narrowing dynamic ranges."""
    if not enabled:
        yield
        return
    from torch._inductor import ir, utils

    saved = (ir.argsort_sym, utils.argsort_sym)
    ir.argsort_sym = utils.argsort_sym = _argsort_sym_without_guards  # type: ignore[assignment]
    try:
        yield
    finally:
        ir.argsort_sym, utils.argsort_sym = saved  # type: ignore[assignment]


def resolve_overload_packets(gm: torch.fx.GraphModule) -> None:
    """Give each node that calls an op packet (``torch.ops.ns.op``) its ``.default``
    overload, which is what Inductor lowers.

    On a 2-D mesh, tracing re-derives a submesh a backward closure holds from the
    root mesh with ``torch.ops.device_mesh._get_submesh(proxy, dims)`` (torch
    2.13-2.14, ``_device_mesh_reconstruct_fn``): called on a proxy, the node's
    target is the packet, and Inductor refuses it ("is not an OpOverload").
    """
    changed = False
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverloadPacket):
            node.target = target.default
            changed = True
    if changed:
        gm.recompile()


@contextlib.contextmanager
def bounds_checks_after_their_index() -> Iterator[None]:
    """torch 2.11's C++ kernels may check an index in the loads section before the
    compute section defines it (``'tmp2' was not declared``: a compile error, seen
    on a mask indexed by an ``arange``); torch 2.13 checks such an index in compute,
    as this does while Inductor generates code."""
    if not BEFORE_2_13:
        yield
        return
    from torch._inductor.codegen.cpp import CppKernel

    original = CppKernel.check_bounds

    def check_bounds(self: Any, expr: Any, size: Any, lower: bool, upper: bool) -> Any:
        if self.cse.try_get(self.sexpr(self.rename_indexing(expr))) is None:
            return original(self, expr, size, lower, upper)
        loads, self.loads = self.loads, self.compute  # the index is already in compute
        try:
            return original(self, expr, size, lower, upper)
        finally:
            self.loads = loads

    CppKernel.check_bounds = check_bounds  # type: ignore[method-assign]
    try:
        yield
    finally:
        CppKernel.check_bounds = original  # type: ignore[method-assign]


# Eight bytes into an AVX2 vector of 32, the other lanes 1 (as ATen's partial load
# fills them, so that a lane never divides by zero): one 8-byte load and two blends.
_EIGHT_BYTES = (
    "{vec}(_mm256_inserti128_si256(_mm256_set1_epi8(1), _mm_blend_epi16("
    "_mm_loadl_epi64(reinterpret_cast<const __m128i*>({ptr})), _mm_set1_epi8(1), 0xF0), 0))"
)


@contextlib.contextmanager
def full_width_byte_loads() -> Iterator[None]:
    """Inductor's AVX2 C++ kernels load eight int8 or uint8 values at a time (one for each
    float32 lane) with ``Vectorized<int8_t>::loadu(ptr, 8)``, which ATen's AVX2 vector
    class serves by filling a 32-byte buffer and copying into it
    (``ATen/cpu/vec/vec256/vec256_int.h``): an int8 weight's one-row reduction read 0.6 GB/s
    on a 2-core EPYC, 14 GB/s with the load below (docs/measurements.md, 2026-12-04). Here
    such a load is one 8-byte load, the other lanes 1 as ATen's. AVX-512's class masks
    the load; it is left as it is."""
    from torch._inductor.codegen import cpp

    original = getattr(cpp.CppVecKernel, "_get_vec_load_line", None)
    if original is None or not hasattr(cpp, "cexpr_index"):  # another layout: as it is
        yield
        return

    def load_line(self: Any, var: str, index: Any, dtype: torch.dtype, load_mask: Any = None):
        eight_bytes = dtype in (torch.int8, torch.uint8) and getattr(self, "num_elems", 0) == 8
        if not eight_bytes or load_mask is not None or self.vec_isa.bit_width() != 256:
            return original(self, var, index, dtype, load_mask)
        ptr = f"{var} + {cpp.cexpr_index(index)}" if index != 0 else var
        return _EIGHT_BYTES.format(vec=self._get_vec_type(dtype), ptr=ptr)

    cpp.CppVecKernel._get_vec_load_line = load_line  # type: ignore[method-assign]
    try:
        yield
    finally:
        cpp.CppVecKernel._get_vec_load_line = original  # type: ignore[method-assign]
