"""A generator step's small matmuls (generation/decode_matmul.py): the decode step's
one-row ``addmm`` and ``mm`` as reductions over a row computed once, and a product
over an inner dimension of one (the rotary embedding's) as a broadcast multiply.

The GPU build uses them under coordinate descent tuning; here the functions
themselves are checked against ``torch.addmm`` and ``torch.mm`` (float32, and
bfloat16 against the float64 product rounded once), in a trace through the
decomposition table as AOTAutograd applies it (the row goes through
``computed_once`` before the product), through the pipeline's stages with
Inductor on the CPU against eager, and where the table holds them.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torch_precompile import Precompile, _compat
from torch_precompile._compat.quantized_mm import INT8_MM
from torch_precompile.generation.decode_matmul import (
    ADDMM,
    BMM,
    MM,
    cpu_rows_addmm,
    cpu_rows_mm,
    float32_only,
    int8_decode_rows,
    int8_options,
    int8_prefill_rows,
    one_row_addmm,
    one_row_mm,
    one_row_step,
    outer_product,
    step_decompositions,
)
from torch_precompile.lean.linear_rows import LINEAR_ROWS

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
        (CDT, "cpu", False),  # the CPU's own table, tuned or not
        ({"coordinate_descent_tuning": False}, "cuda", False),
        (None, "cuda", False),  # untuned, a reduction is slower than cuBLAS
    ],
)
def test_one_row_reductions_on_a_gpu_under_coordinate_descent_tuning_only(
    options: dict | None, device: str, used: bool
) -> None:
    decode = step_decompositions(options, torch.device(device), prefill=False)
    cpu = {  # an int8 file's decode, and float32 rows' matmuls
        INT8_MM: int8_decode_rows,
        MM: float32_only(MM, cpu_rows_mm),
        ADDMM: float32_only(ADDMM, cpu_rows_addmm),
    }
    if device == "cpu":
        assert decode == cpu
    else:
        assert decode == ({ADDMM: one_row_addmm, MM: one_row_mm} if used else {})
    prefill = step_decompositions(options, torch.device(device), prefill=True)
    on_gpu = device != "cpu"
    # a CPU prefill's: an int8 file's converted, then oneDNN's linear, as float32's
    cpu_prefill = set() if on_gpu else {INT8_MM, MM, ADDMM}
    assert set(prefill) == ({ADDMM} if used else set()) | ({MM, BMM} if on_gpu else cpu_prefill)
    if on_gpu:  # mm: the one-row reduction only when tuned, as Inductor's own otherwise
        _, x, w = _operands(torch.float32)
        assert (prefill[MM](x, w) is NotImplemented) is not used
        product = prefill[MM](torch.randn(3, 1), torch.randn(1, 4))
        assert product is not NotImplemented


def test_a_cpu_decode_step_reduces_a_float32_row_and_gives_more_rows_to_onednn() -> None:
    """Through the CPU decode table as AOTAutograd applies it: a float32 row's ``mm`` and
    ``addmm`` become reductions, more float32 rows oneDNN's linear (``linear_rows``),
    each equal to ATen's; a bfloat16 row keeps the operator."""
    table = step_decompositions(None, torch.device("cpu"), prefill=False)
    for bias in (True, False):
        linear = torch.nn.Linear(896, 128, bias=bias)
        op = ADDMM if bias else MM
        for rows, dtype, kept, onednn in (
            (1, torch.float32, False, False),
            (3, torch.float32, False, True),
            (1, torch.bfloat16, True, False),
        ):
            layer = linear.to(dtype)
            x = torch.randn(rows, 896).to(dtype)
            with torch.no_grad():
                traced = make_fx(layer, decomposition_table=table)(x)
                targets = {n.target for n in traced.graph.nodes if n.op == "call_function"}
                assert (op in targets) is kept, (bias, rows, dtype, targets)
                assert (LINEAR_ROWS in targets) is onednn, (bias, rows, dtype, targets)
                want, got = layer(x), traced(x)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * 10)


def test_a_cpu_prefill_gives_its_linears_to_onednn_and_keeps_the_rotary_product() -> None:
    """Through the CPU prefill table: a float32 linear's rows (with and without a bias)
    are ``linear_rows``, equal to ATen's; an int8 file's matmul too, after converting
    the weight; the rotary embedding's product over an inner dimension of one stays a
    broadcast multiply."""
    table = step_decompositions(None, torch.device("cpu"), prefill=True)
    for bias in (True, False):
        layer = torch.nn.Linear(896, 128, bias=bias)
        x = torch.randn(7, 896)
        with torch.no_grad():
            traced = make_fx(layer, decomposition_table=table)(x)
            assert LINEAR_ROWS in {n.target for n in traced.graph.nodes}, bias
            assert torch.allclose(traced(x), layer(x), rtol=1e-5, atol=1e-4)
    inv_freq, positions = torch.randn(32, 1), torch.arange(9.0)[None]
    traced = make_fx(torch.mm, decomposition_table=table)(inv_freq, positions)
    assert LINEAR_ROWS not in {n.target for n in traced.graph.nodes}
    assert torch.equal(traced(inv_freq, positions), inv_freq @ positions)
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-128, 128, (64, 896), dtype=torch.int8, generator=g)
    scales, x = torch.rand(64, generator=g) + 0.5, torch.randn(5, 896, generator=g)
    want = torch.ops.aten._weight_int8pack_mm(x, q, scales)
    traced = make_fx(table[INT8_MM])(x, q, scales)
    assert LINEAR_ROWS in {n.target for n in traced.graph.nodes}
    assert torch.allclose(traced(x, q, scales), want, rtol=1e-5, atol=1e-3)


def test_onednn_rows_take_a_weights_transpose_only_and_equal_mm() -> None:
    """``linear_rows`` for ``x @ w.T`` (a linear layer's operands); a right-hand side
    that is not a contiguous weight's transpose, or a scaled ``addmm``, is left to
    Inductor's own decomposition (``NotImplemented`` here: the operator is kept)."""
    _, x, wt = _operands(torch.float32, rows=5, seed=6)
    bias = torch.randn(128)
    assert torch.allclose(cpu_rows_mm(x, wt), x @ wt, rtol=1e-5, atol=1e-4)
    assert torch.allclose(cpu_rows_addmm(bias, x, wt), torch.addmm(bias, x, wt), atol=1e-4)
    plain = wt.contiguous()  # x @ plain: plain.T is not contiguous
    assert cpu_rows_mm(x, plain) is NotImplemented
    assert cpu_rows_addmm(bias, x, wt, beta=0.5) is NotImplemented
    assert cpu_rows_addmm(bias[None].expand(5, 128), x, wt) is NotImplemented


def test_the_one_row_step_for_quantized_files_and_large_float32_models() -> None:
    big = 64 * 2**20
    assert one_row_step("int8", "float32", 1) and one_row_step("int4", "bfloat16", 1)
    assert one_row_step(None, "float32", big)
    assert not one_row_step(None, "float32", big - 1)
    assert not one_row_step(None, "bfloat16", 10 * big)


def _marker() -> object:
    """The operator ``computed_once`` leaves in a trace."""
    traced = make_fx(_compat.computed_once)(torch.ones(1, 4))
    (target,) = {n.target for n in traced.graph.nodes if n.op == "call_function"}
    return target


def test_one_row_mm_equals_mm_and_is_inductors_own_reduction() -> None:
    _, x, w = _operands(torch.float32, seed=3)
    got = one_row_mm(x, w)
    assert got.shape == (1, 128) and torch.allclose(got, x @ w, rtol=1e-5, atol=1e-4)
    # In bfloat16, the arithmetic of Inductor's own decomposition of a one-row mm
    # (which the GPU build ran before): only where the row is computed changes.
    _, x, w = _operands(torch.bfloat16, seed=4)
    got = one_row_mm(x, w)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (x.unsqueeze(2) * w.unsqueeze(0)).sum(dim=1))


def test_more_rows_get_inductors_own_decomposition_of_mm() -> None:
    # Inductor decomposes a tiny outer product on the CPU (a broadcast multiply): the
    # table's mm must still do so, and give mm's answer.
    a, b = torch.randn(3, 1), torch.randn(1, 4)
    got = one_row_mm(a, b)
    assert got is not NotImplemented and torch.equal(got, a * b)
    assert torch.allclose(got, a @ b)
    assert one_row_mm(torch.randn(2, 896), torch.randn(896, 8)) is NotImplemented


class _MLP(torch.nn.Module):
    """A decoder's MLP: the down projection reads ``silu(gate) * up``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(64, 256, bias=False)
        self.up = torch.nn.Linear(64, 256, bias=False)
        self.down = torch.nn.Linear(256, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def test_in_a_trace_the_row_is_computed_once_before_each_product() -> None:
    mlp, marker = _MLP().eval(), _marker()
    with torch.no_grad():
        for rows, kept in ((1, False), (3, True)):
            x = torch.randn(rows, 64)
            traced = make_fx(mlp, decomposition_table={MM: one_row_mm})(x)
            nodes = [n for n in traced.graph.nodes if n.op == "call_function"]
            assert (MM in {n.target for n in nodes}) is kept, rows
            once = [n for n in nodes if n.target == marker]
            # each of the three products reads its row through the marker (the down
            # projection's row is silu(gate) * up, the others' the input)
            assert len(once) == (0 if kept else 3), rows
            if not kept:
                assert any(n.args[0].target == torch.ops.aten.mul.Tensor for n in once)
            assert torch.allclose(traced(x), mlp(x), rtol=1e-5, atol=1e-5)


def test_compiled_by_the_stages_with_the_table_equals_eager() -> None:
    mlp = _MLP().eval()
    x = torch.randn(1, 64)
    table = {**_compat.default_decompositions(), MM: one_row_mm, ADDMM: one_row_addmm}
    with torch.no_grad():
        gm, _, guards = Precompile.dynamo(mlp, x)
        joint = Precompile.aot_autograd(gm, guards, decompositions=table)
        targets = {n.target for n in joint.joint_graph.graph.nodes if n.op == "call_function"}
        assert MM not in targets and _marker() in targets
        compiled, _ = Precompile.inductor(joint.joint_graph, joint.guards)
        artifact = Precompile.precompile(compiled)
        got = artifact(x)
    got = got[0] if isinstance(got, (tuple, list)) else got
    assert torch.allclose(got, mlp(x), rtol=1e-5, atol=1e-5)


def test_an_inner_dimension_of_one_is_the_broadcast_product_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        a = (torch.randn(64, 1, generator=g) * 1e3).to(dtype)  # a rotary's inv_freq...
        b = torch.arange(300.0).reshape(1, 300).to(dtype)  # ...and positions
        got = outer_product(a, b)
        assert got.dtype == dtype and torch.equal(got, a @ b), dtype
        a3, b3 = a.expand(3, 64, 1), b.expand(3, 1, 300)  # bmm, a batch of three
        assert torch.equal(outer_product(a3, b3), torch.bmm(a3, b3)), dtype
    assert outer_product(torch.randn(4, 2), torch.randn(2, 3)) is NotImplemented
    assert outer_product(torch.randn(4, 1), torch.randn(1, 3).double()) is NotImplemented


def test_in_a_trace_the_rotary_product_leaves_no_matmul() -> None:
    """The rotary embedding's frequencies as transformers computes them (float32,
    ``inv_freq[None, :, None] @ positions[:, None, :]``), traced through the GPU
    table: no ``mm`` or ``bmm`` is left, and the values are eager's exactly."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))

    def freqs(positions: torch.Tensor) -> torch.Tensor:
        expanded = inv_freq[None, :, None].expand(positions.shape[0], -1, 1)
        return (expanded @ positions[:, None, :].float()).transpose(1, 2)

    table = step_decompositions(None, torch.device("cuda"), prefill=True)
    for batch in (1, 3):
        positions = torch.arange(96).repeat(batch, 1)
        traced = make_fx(freqs, decomposition_table=table)(positions)
        targets = {n.target for n in traced.graph.nodes if n.op == "call_function"}
        assert not targets & {MM, BMM, torch.ops.aten.matmul.default}, (batch, targets)
        assert torch.equal(traced(positions), freqs(positions)), batch


def test_int8_decode_rows_equals_atens_int8_mm_and_a_static_batch_keeps_the_operator() -> None:
    """The CPU decode step's int8 matmul: ``sum(x * q) * scale``, ATen's result to
    float32 rounding, for one row and for a batch traced dynamic (the 1..N rows of a
    CPU generator's step); a static batch of two is left to the operator."""
    torch.manual_seed(0)
    x, q = torch.randn(1, 96), torch.randint(-127, 128, (40, 96), dtype=torch.int8)
    scales = torch.rand(40)
    want = torch.ops.aten._weight_int8pack_mm(x, q, scales)
    torch.testing.assert_close(int8_decode_rows(x, q, scales), want, atol=1e-5, rtol=1e-5)
    assert int8_decode_rows(torch.randn(2, 96), q, scales) is NotImplemented

    def mm(rows: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, q, scales)

    table = {INT8_MM: int8_decode_rows}
    traced = make_fx(mm, decomposition_table=table, tracing_mode="symbolic")(
        torch.randn(3, 96), q, scales
    )
    assert INT8_MM not in {n.target for n in traced.graph.nodes}
    for batch in (1, 3, 5):
        rows = torch.randn(batch, 96)
        want = mm(rows, q, scales)
        # outputs of a few hundred: float32's rounding of another order of the sum
        torch.testing.assert_close(traced(rows, q, scales), want, atol=1e-3, rtol=1e-5)


def test_int8_prefill_rows_equals_atens_int8_mm() -> None:
    """The CPU prefill's int8 matmul: the weight converted, ``mm``, then scaled; ATen's
    result to float32 rounding of another order of the sum."""
    torch.manual_seed(1)
    q, scales = torch.randint(-127, 128, (40, 96), dtype=torch.int8), torch.rand(40)
    for rows in (1, 7):
        x = torch.randn(rows, 96)
        want = torch.ops.aten._weight_int8pack_mm(x, q, scales)
        torch.testing.assert_close(int8_prefill_rows(x, q, scales), want, atol=1e-3, rtol=1e-5)


def test_a_cuda_int8_build_tunes_by_coordinate_descent_unless_told_otherwise() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert int8_options(None, "int8", cuda) == {"coordinate_descent_tuning": True}
    kept = {"coordinate_descent_tuning": False, "max_autotune": True}
    assert int8_options(kept, "int8", cuda) == kept
    assert int8_options({"max_autotune": True}, "int8", cuda) == {
        "max_autotune": True,
        "coordinate_descent_tuning": True,
    }
    for weights, device in (("int8", cpu), ("int4", cuda), (None, cuda)):
        assert int8_options(None, weights, device) is None


class _Bytes(torch.nn.Module):
    """An int8 weight's one-row product with its scales, and a uint8 row's integer
    division by itself (a lane past the eight loaded must not divide by zero)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.register_buffer("q", torch.randint(-127, 128, (64, 96), dtype=torch.int8, generator=g))
        self.register_buffer("scales", torch.rand(64, generator=g))

    def forward(self, x: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        product = (x[:, None, :] * self.q[None].float()).sum(-1) * self.scales
        wide = u.to(torch.int32)
        return product, (wide // (wide | 1)).sum(-1)


def test_a_cpu_builds_byte_loads_are_eight_byte_loads_on_avx2_and_compute_as_eager() -> None:
    """On a 256-bit vector ISA (AVX2) the stages' C++ kernels load eight int8 / uint8
    values by one 8-byte load (``_compat.inductor_fixes.full_width_byte_loads``), not
    ATen's buffer-filling partial load; on AVX-512 ATen's masked load is kept. Either way
    the compiled step computes what eager does."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.utils import run_and_get_code

    module = _Bytes().eval()
    x = torch.randn(1, 96)
    u = torch.randint(
        0, 256, (2, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(4)
    )
    with torch.no_grad():
        gm, _, guards = Precompile.dynamo(module, (x, u))
        joint = Precompile.aot_autograd(gm, guards)

        def build() -> tuple[torch.Tensor, torch.Tensor]:
            compiled, _ = Precompile.inductor(joint.joint_graph, joint.guards)
            return Precompile.precompile(compiled)(x, u)

        (product, quotient), code = run_and_get_code(build)
    source = "\n".join(code)
    want_product, want_quotient = module(x, u)
    torch.testing.assert_close(product, want_product, atol=1e-4, rtol=1e-5)
    assert torch.equal(quotient, want_quotient)
    isa = cpu_vec_isa.pick_vec_isa()
    partial = "Vectorized<int8_t>::loadu(" in source or "Vectorized<uint8_t>::loadu(" in source
    if isa and isa.bit_width() == 256:
        assert "_mm_loadl_epi64" in source and not partial
    else:
        assert "_mm_loadl_epi64" not in source
