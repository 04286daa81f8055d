"""Collectives answered on one rank, for the save-time autotuning run of a CUDA graph.

A CUDA artifact's save runs its graph once on random inputs so that its Triton
kernels autotune; only the saving rank runs it, so a collective in the graph
would wait for ranks that never join (a 2-H100 tensor-parallel build hung there).
Each answer must have the shape PyTorch's own meta kernel of the collective gives.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from torch_precompile._compat.local_collectives import (
    UnknownCollectiveError,
    _LocalCollectives,
    local_collectives,
)

C10D = torch.ops._c10d_functional
X = torch.randn(8, 3)
CASES = [
    ("all_reduce", (X, "sum", "tp")),
    ("all_reduce_", (X, "sum", "tp")),
    ("all_gather_into_tensor", (X, 4, "tp")),
    ("reduce_scatter_tensor", (X, "sum", 4, "tp")),
    ("broadcast", (X, 0, "tp")),
    ("all_to_all_single", (X, [1, 2, 2, 3], [2, 2, 2, 2], "tp")),
    ("wait_tensor", (X,)),
    ("all_gather_into_tensor_coalesced", ([X, X[:4]], 4, "tp")),
    ("reduce_scatter_tensor_coalesced", ([X, X[:4]], "sum", 4, "tp")),
]


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
        return [v.to("meta") for v in value]
    return value


def _shapes(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [tuple(v.shape) for v in value]
    return tuple(value.shape)


@pytest.mark.parametrize(("name", "args"), CASES, ids=[c[0] for c in CASES])
def test_answer_has_the_collectives_shape(name: str, args: tuple[Any, ...]) -> None:
    op = getattr(C10D, name)
    if name != "wait_tensor":  # (waiting on a finished tensor needs no process group)
        with pytest.raises(Exception):  # noqa: B017 - no process group: the real one cannot run
            op(*args)
    with local_collectives():
        got = op(*args)
    assert _shapes(got) == _shapes(op(*map(_meta, args)))


def test_values_come_from_this_rank() -> None:
    with local_collectives():
        gathered = C10D.all_gather_into_tensor(X, 2, "tp")
        reduced = C10D.all_reduce(X, "sum", "tp")
    assert torch.equal(gathered, torch.cat([X, X]))
    assert torch.equal(reduced, X) and reduced is not X


def test_out_variants_write_out() -> None:
    out = torch.empty(16, 3)
    with local_collectives():
        C10D.all_gather_into_tensor_out(X, 2, "tp", out=out)
        assert torch.equal(out, torch.cat([X, X]))
        half = torch.empty(4, 3)
        C10D.reduce_scatter_tensor_out(X, "sum", 2, "tp", out=half)
        assert torch.equal(half, X[:4])


def test_other_ops_run_as_usual_and_point_to_point_is_refused() -> None:
    with local_collectives():
        assert torch.equal(torch.mm(X, X.T), X @ X.T)
    # A collective outside the table (torch 2.13 and later have a functional isend;
    # torch 2.11 has none, so the dispatch is also given one directly).
    isend = types.SimpleNamespace(
        namespace="_c10d_functional", overloadpacket=types.SimpleNamespace(__name__="isend")
    )
    with pytest.raises(UnknownCollectiveError, match=r"isend.*cannot be answered locally"):
        _LocalCollectives().__torch_dispatch__(isend, (), (X, 1, 0, "tp"))
    if hasattr(C10D, "isend"):
        refused = pytest.raises(UnknownCollectiveError, match=r"isend.*cannot be answered")
        with local_collectives(), refused:
            C10D.isend(X, 1, 0, "tp")
