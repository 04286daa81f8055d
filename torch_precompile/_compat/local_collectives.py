"""Collectives answered on this rank alone, for running a compiled graph once at save.

Saving a CUDA artifact runs its wrapper once on Inductor's random inputs so that
each Triton kernel autotunes to one configuration (``triton_kernels._warm``). Only
the rank that saves runs it: a collective in the graph (tensor parallelism's
all-reduce, data parallelism's all-gather) would wait for ranks that never join,
or pair with an unrelated collective of theirs. Under :func:`local_collectives`
each functional collective (``torch.ops._c10d_functional``) returns a tensor of
the shape the real one returns, from this rank's data only; the values are
random inputs anyway, only the kernels' timings matter. Point-to-point ops
(``isend``/``irecv``) and any collective not listed raise
:class:`UnknownCollectiveError` (the artifact then ships no Triton kernels).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NAMESPACE = "_c10d_functional"


class UnknownCollectiveError(RuntimeError):
    """A collective this module cannot answer locally."""


def _gather(t: torch.Tensor, group_size: int) -> torch.Tensor:
    return torch.cat([t] * int(group_size))


def _scatter(t: torch.Tensor, group_size: int) -> torch.Tensor:
    return t.narrow(0, 0, t.shape[0] // int(group_size)).clone()


def _all_to_all(t: torch.Tensor, output_split_sizes: Any) -> torch.Tensor:
    if output_split_sizes is None:
        return t.clone()
    return t.new_zeros((sum(int(s) for s in output_split_sizes), *t.shape[1:]))


# Per overload packet: the output from the positional arguments (the group name,
# and for all-gather/reduce-scatter the group size, as the schema orders them).
_ANSWERS: dict[str, Any] = {
    "wait_tensor": lambda t: t,
    "all_reduce": lambda t, *_: t.clone(),
    "all_reduce_": lambda t, *_: t,
    "all_reduce_coalesced": lambda ts, *_: [t.clone() for t in ts],
    "all_reduce_coalesced_": lambda ts, *_: ts,
    "broadcast": lambda t, *_: t.clone(),
    "broadcast_": lambda t, *_: t,
    "all_gather_into_tensor": lambda t, size, *_: _gather(t, size),
    "all_gather_into_tensor_coalesced": lambda ts, size, *_: [_gather(t, size) for t in ts],
    "reduce_scatter_tensor": lambda t, _op, size, *_: _scatter(t, size),
    "reduce_scatter_tensor_coalesced": lambda ts, _op, size, *_: [_scatter(t, size) for t in ts],
    "all_to_all_single": lambda t, out_splits, *_: _all_to_all(t, out_splits),
}


# Ops of the namespace that reach no process group: eager DTensor code wraps a
# collective's result for autograd (``AsyncCollectiveTensor``) with this one.
_NOT_COLLECTIVES = frozenset({"_wrap_tensor_autograd"})


class _LocalCollectives(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace != NAMESPACE or func.overloadpacket.__name__ in _NOT_COLLECTIVES:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name == "all_gather_into_tensor_out":
            return kwargs["out"].copy_(_gather(args[0], args[1]))
        if name == "reduce_scatter_tensor_out":
            return kwargs["out"].copy_(_scatter(args[0], args[2]))
        answer = _ANSWERS.get(name)
        if answer is None or kwargs:
            raise UnknownCollectiveError(f"collective {func} cannot be answered locally")
        return answer(*args)


@contextmanager
def local_collectives() -> Iterator[None]:
    """Within this block, functional collectives never reach the process group."""
    with _LocalCollectives():
        yield
