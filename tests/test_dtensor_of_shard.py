"""A rank's shard made a DTensor parameter as ``from_local`` and ``nn.Parameter`` make it,
without importing Dynamo.

``DTensor.from_local`` (an ``autograd.Function``), ``DTensor(...)`` and
``nn.Parameter``'s ``detach`` (dispatched through DTensor's sharding
propagation) each import ``torch._dynamo`` on first use; a distributed load
builds every weight with ``_compat.distributed``'s ``dtensor_of_shard`` and
``dtensor_parameter`` instead. Runs in a fresh process on PyTorch's fake
process group (4 ranks, no communication).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from conftest import script_json

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch built without torch.distributed"
)

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from torch_precompile._compat.distributed import dtensor_of_shard, dtensor_parameter

    mesh = init_device_mesh("cpu", (4,))
    out = {"dynamo_before": "torch._dynamo" in sys.modules}
    made = {}
    for name, placements, local, shape, stride in [
        ("rows", [Shard(0)], torch.randn(2, 3), (8, 3), (3, 1)),
        ("cols", [Shard(1)], torch.randn(5, 2), (5, 8), (8, 1)),
        ("whole", [Replicate()], torch.randn(4), (4,), (1,)),
    ]:
        for grad in (True, False):
            t = dtensor_of_shard(local, mesh, placements, torch.Size(shape), stride)
            made[name, grad] = (dtensor_parameter(t, grad), t, local, placements, shape, stride)
    out["dynamo_after_ours"] = "torch._dynamo" in sys.modules
    same = []
    for (name, grad), (ours, t, local, placements, shape, stride) in made.items():
        theirs = torch.nn.Parameter(
            DTensor.from_local(local, mesh, placements, run_check=False,
                               shape=torch.Size(shape), stride=stride),
            requires_grad=grad,
        )
        same.append({
            "name": name,
            "types": [type(ours).__name__, type(t).__name__],
            "spec": ours._spec == theirs._spec,
            "shape": [list(ours.shape), list(theirs.shape)],
            "stride": [list(ours.stride()), list(theirs.stride())],
            "grad": [ours.requires_grad, theirs.requires_grad, grad],
            "is_param": [getattr(ours, "_is_param", False), getattr(theirs, "_is_param", False)],
            "local_grad": [ours._local_tensor.requires_grad, theirs._local_tensor.requires_grad],
            "shares_memory": ours._local_tensor.data_ptr() == local.data_ptr(),
            "values": torch.equal(ours.to_local(), theirs.to_local()),
        })
    out["same"] = same
    out["dynamo_after_from_local"] = "torch._dynamo" in sys.modules
    print(json.dumps(out))
    """
)


def test_shard_parameters_equal_from_local_and_import_no_dynamo() -> None:
    out = script_json(SCRIPT)
    assert not out["dynamo_before"] and not out["dynamo_after_ours"]
    assert out["dynamo_after_from_local"]  # what the load no longer calls imports it
    assert len(out["same"]) == 6
    for case in out["same"]:
        assert case["types"] == ["DTensor", "DTensor"], case
        assert case["spec"] and case["values"] and case["shares_memory"], case
        assert case["shape"][0] == case["shape"][1] and case["stride"][0] == case["stride"][1]
        grad = case["grad"][2]
        assert case["grad"] == [grad, grad, grad], case
        assert case["is_param"] == [True, True] and case["local_grad"] == [False, False], case
