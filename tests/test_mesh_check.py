"""The lean guards' DeviceMesh check is DeviceMesh equality, as Dynamo's guard is.

A submesh and a fresh mesh over the same ranks, device type and names differ in
their flattened rank map and layout; ``DeviceMesh.__eq__`` (what Dynamo's mesh
guards compare) tells them apart, and so must the lean check. Runs in a fresh
process on PyTorch's fake process group (4 ranks, no communication).
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
    import json
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from torch_precompile.lean_writer.dtensor_guards import mesh_descriptor
    from torch_precompile.lean.subclasses import MeshCheck

    sub = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    fresh = DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",))
    again = DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",))

    def pickled():
        # A check that has seen a mesh (a weak reference to it) pickles as what was
        # saved: a save keeps the lean guards' constants (lean/guards.py's prepared).
        import pickle
        check = MeshCheck(mesh_descriptor(fresh))
        seen = check.ok(again)
        copy = pickle.loads(pickle.dumps(check))
        return [seen, copy._last is None, copy.ok(again), copy.ok(sub)]
    print(json.dumps({
        "torch_equal": [sub == fresh, fresh == again],
        "lean_equal": [
            MeshCheck(mesh_descriptor(sub)).ok(fresh),
            MeshCheck(mesh_descriptor(fresh)).ok(again),
            MeshCheck(mesh_descriptor(sub)).ok(sub),
        ],
        "old_descriptor": MeshCheck(mesh_descriptor(sub)[:4]).ok(fresh),
        "pickled": pickled(),
    }))
    """
)


def test_submesh_and_fresh_mesh_over_the_same_ranks_differ() -> None:
    result = script_json(SCRIPT)
    assert result["torch_equal"] == [False, True]  # what Dynamo's mesh guard compares
    assert result["lean_equal"] == [False, True, True]  # the lean check agrees
    # A file saved before the layout was recorded compares ranks, names, device, thread.
    assert result["old_descriptor"] is True
    # The copy holds no mesh it saw, and checks as the original does.
    assert result["pickled"] == [True, True, True, False]
