"""The decode step's one-row ``addmm`` as a reduction (generation/decode_matmul.py).

The GPU build uses it under coordinate descent tuning; here the function itself
is checked against ``torch.addmm`` (float32, and bfloat16 against the float64
product rounded once), in a trace through the decomposition table as
AOTAutograd applies it, and where the table holds it.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torch_precompile.generation.decode_matmul import decode_decompositions, one_row_addmm

ADDMM = torch.ops.aten.addmm.default
CDT = {"coordinate_descent_tuning": True}


def _operands(dtype: torch.dtype, rows: int = 1, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 896, generator=g).to(dtype)
    weight = torch.randn(128, 896, generator=g).to(dtype)
    bias = torch.randn(128, generator=g).to(dtype)
    return bias, x, weight.t()  # a linear layer's addmm: the weight transposed (a view)


def test_float32_equals_addmm() -> None:
    bias, x, w = _operands(torch.float32)
    got = one_row_addmm(bias, x, w)
    assert got.dtype == torch.float32 and got.shape == (1, 128)
    assert torch.allclose(got, torch.addmm(bias, x, w), rtol=1e-5, atol=1e-4)


def test_bfloat16_is_the_exact_product_rounded_once() -> None:
    bias, x, w = _operands(torch.bfloat16, seed=1)
    got = one_row_addmm(bias, x, w)
    exact = bias.double() + x.double() @ w.double()
    assert got.dtype == torch.bfloat16
    # Summed in float32, rounded to bfloat16 once: within one bfloat16 step of the
    # exact value (addmm's own result is held to the same bound).
    step = exact.abs() * 2**-7 + 1e-6
    for result in (got, torch.addmm(bias, x, w)):
        assert bool(((result.double() - exact).abs() <= step).all())


def test_alpha_and_beta_as_addmm_and_beta_zero_ignores_the_bias() -> None:
    bias, x, w = _operands(torch.float32, seed=2)
    want = torch.addmm(bias, x, w, beta=0.5, alpha=2.0)
    assert torch.allclose(one_row_addmm(bias, x, w, beta=0.5, alpha=2.0), want, atol=1e-4)
    nan_bias = torch.full_like(bias, float("nan"))
    got = one_row_addmm(nan_bias, x, w, beta=0)
    assert torch.allclose(got, torch.addmm(nan_bias, x, w, beta=0), atol=1e-4)
    assert not got.isnan().any()


def test_in_a_trace_one_row_becomes_a_reduction_and_more_rows_stay_addmm() -> None:
    linear = torch.nn.Linear(896, 128)

    def f(x: torch.Tensor) -> torch.Tensor:
        return linear(x)

    table = {ADDMM: one_row_addmm}
    for rows, kept in ((1, False), (3, True)):
        x = torch.randn(rows, 896)
        with torch.no_grad():
            traced = make_fx(f, decomposition_table=table)(x)
            targets = {n.target for n in traced.graph.nodes if n.op == "call_function"}
            assert (ADDMM in targets) is kept, (rows, targets)
            assert torch.allclose(traced(x), f(x), rtol=1e-5, atol=1e-4)


def test_two_rows_or_mixed_dtypes_are_left_to_addmm() -> None:
    bias, x, w = _operands(torch.float32, rows=2)
    assert one_row_addmm(bias, x, w) is NotImplemented
    bias, x, w = _operands(torch.float32)
    assert one_row_addmm(bias.double(), x, w) is NotImplemented


@pytest.mark.parametrize(
    ("options", "device", "used"),
    [
        (CDT, "cuda", True),
        (CDT, "cpu", False),  # Inductor keeps CPU matmuls as they are
        ({"coordinate_descent_tuning": False}, "cuda", False),
        (None, "cuda", False),  # untuned, a reduction is slower than cuBLAS
    ],
)
def test_used_on_a_gpu_under_coordinate_descent_tuning_only(
    options: dict | None, device: str, used: bool
) -> None:
    table = decode_decompositions(options, torch.device(device))
    assert (ADDMM in table) is used
    assert set(table) <= {ADDMM}
