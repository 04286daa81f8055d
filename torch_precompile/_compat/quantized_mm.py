"""torch's own weight-only quantized matmuls (private ATen operators), for generator files.

A quantized generator file's step calls these operators on plain int8 / uint8
tensors, so the serving process needs torch alone (no torchao, no compiler):

- ``aten._weight_int8pack_mm(x (M, K), w int8 (N, K), scales (N,))``:
  ``x @ (w * scales[:, None]).T``, scales of ``x``'s dtype (CPU; CUDA converts the
  weight in the graph instead, for Inductor to fuse).
- ``quantized.int4mm_packed_weight_cpu(x (M, K), packed uint8 (N, K/2), group
  (a 0-d int64 tensor), scales_and_zeros (K/group, N, 2))``: tinygemm's affine
  int4, ``w = (q - 8) * scale + zero`` per group of ``group`` inputs; the weight
  packed by ``aten._convert_weight_to_int4pack_for_cpu`` from int32 values
  0..15 of shape (N, K). It is ``aten._weight_int4pack_mm_for_cpu``'s kernel
  with the group size a tensor, what Inductor lowers that operator to; called
  with the group as Inductor makes it, it is a constant of the compiled graph,
  which the lean load refuses (the file would load through the compiler), so
  the step passes the group as a buffer of its own.
- On CUDA ``aten._weight_int4pack_mm`` over ``aten._convert_weight_to_int4pack``
  of the uint8 (N, K/2) nibbles (even column in the high nibble), bfloat16 only.
"""

from __future__ import annotations

from typing import Any

import torch

# tinygemm's inner K tiles on CUDA (K must be a multiple of 16 * this); CPU ignores it.
INNER_K_TILES = 8
# The int8 operator, for a decode step's decomposition of it (generation/decode_matmul.py).
INT8_MM = torch.ops.aten._weight_int8pack_mm.default


def int8_weight_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (weight * scales[:, None]).T`` for a 2-D ``x``.

    CPU: torch's int8 weight-only mm. CUDA: the conversion in the graph, as gpt-fast
    writes it, so Inductor fuses it into the matmul's reduction (a one-row matmul is
    one under ``coordinate_descent_tuning``) and reads one byte a weight; ATen's CUDA
    kernel decoded an 8B model at 17.9 tokens/s on an H200, against bf16's 190.
    """
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int8pack_mm(x, weight, scales)
    return torch.nn.functional.linear(x, weight.to(x.dtype)) * scales


def int4_weight_mm(
    x: torch.Tensor, packed: torch.Tensor, group: Any, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """``x @ w.T`` for a 2-D ``x``, ``w`` the int4 weight :func:`int4_pack` packed in
    groups of ``group`` (a 0-d int64 tensor; an int to the CUDA operator). On the CPU a
    float32 ``x`` is taken in bfloat16 (``scales_and_zeros`` are then bfloat16 too), the
    result returned in float32: the CPU kernel's float32 path reads the weight at a tenth
    of its bfloat16 path's speed (docs/generation.md)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and scales_and_zeros.dtype != x.dtype:
        low = x.to(scales_and_zeros.dtype)
        out = torch.ops.quantized.int4mm_packed_weight_cpu(low, packed, group, scales_and_zeros)
        return out.to(x.dtype)
    if x.device.type == "cpu":
        return torch.ops.quantized.int4mm_packed_weight_cpu(x, packed, group, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm(x, packed, group, scales_and_zeros)


def int4_pack(values: torch.Tensor) -> torch.Tensor:
    """The packed weight :func:`int4_weight_mm` reads, from int32 values 0..15 ``(N, K)``
    on the device that serves them."""
    if values.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.int(), INNER_K_TILES)
    nibbles = (values[:, ::2] << 4 | values[:, 1::2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(nibbles, INNER_K_TILES)
