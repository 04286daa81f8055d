"""Save: the code file holds the plain tensors, each rank's shard goes to its own
file (``PATH.rank<r>-of-<n>``), read back by that rank alone."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from .._compat import distributed as _cdist
from .._errors import ArtifactCorruptedError, DistributedLayoutError
from ..file import ArtifactReader, open_artifact, write_artifact
from ..file import sections as names
from ..lean.pickling import dumps as stable_dumps
from ..lean.standin import module as _standin
from .placement import Layout, _sharded, describe

log = logging.getLogger("torch_precompile")


def shard_path(path: str | os.PathLike[str], rank: int, world_size: int) -> str:
    """``model.pt`` -> ``model.pt.rank1-of-4``: where rank 1 of 4 keeps its shard."""
    return f"{os.fspath(path)}.rank{rank}-of-{world_size}"


def code_file_parts(
    module: torch.nn.Module, tensors: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
    """The code file's share of a parallelised module: its plain tensors, and the
    section that lets the stand-in register the parallelisation hooks again."""
    plain = {k: t for k, t in tensors.items() if k not in _sharded(module)}
    hooks, unknown = _cdist.parallel_hooks(module)
    if unknown:
        log.warning(
            "the model has %d forward hook(s) not registered by parallelize_module (first: %s); "
            "Precompile.load(path) without model= cannot rebuild them, load with model=",
            len(unknown),
            unknown[0],
        )
    return plain, {names.DISTRIBUTED_HOOKS: stable_dumps(hooks)}


def save_shard(path: str | os.PathLike[str], model: torch.nn.Module) -> str:
    """Write this rank's shard of ``model``'s DTensors beside the code file ``path``.

    Every rank of the job calls it (the rank that saved the code file has
    already written its shard through ``Precompile.save``; calling it again
    there rewrites the same bytes). Needs no collective: the layout, and so
    the file's ``layout_id``, is the same on every rank. Returns the path
    written.
    """
    layout = describe(model)
    if layout is None:
        raise TypeError("save_shard() takes a model with DTensor parameters (parallelised)")
    rank = torch.distributed.get_rank()
    locals_ = {name: t.to_local() for name, t in _sharded(model).items()}
    out = shard_path(path, rank, layout.world_size)
    meta = {
        "distributed_shard": {
            "rank": rank,
            "world_size": layout.world_size,
            "layout_id": layout.layout_id,
        }
    }
    write_artifact(out, meta, {names.WEIGHTS: _standin.pack_tensors(locals_)})
    return out


def _local_device(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def read_shard(path: str, layout: Layout, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s local tensors, read from its own shard file only."""
    spath = shard_path(path, rank, layout.world_size)
    if not os.path.exists(spath):
        raise FileNotFoundError(
            f"{spath}: rank {rank}'s shard of {path} is missing; every rank of the saving job "
            "writes its own with torch_precompile.save_shard(path, model) (the saving rank's "
            "comes with Precompile.save), and each rank of a loading job needs its file"
        )
    with open_artifact(spath) as reader:  # the header checked; the weights as they copy
        local = _read_local(reader, spath, path, layout)
    missing = sorted(set(layout.tensors) - set(local))
    if missing:
        raise ArtifactCorruptedError(f"{spath}: the shard lacks tensor {missing[0]!r}; re-save it")
    return local


def _read_local(reader: ArtifactReader, spath: str, path: str, layout: Layout) -> dict[str, Any]:
    """The shard's tensors, copied out and checked at once (as ``Precompile.load``
    copies a file's weights): ``ArtifactCorruptedError`` before they are returned."""
    info = reader.info.meta.get("distributed_shard") or {}
    if info.get("layout_id") != layout.layout_id:
        raise DistributedLayoutError(
            f"{spath}",
            f"layout {layout.layout_id} (the code file {path})",
            f"a shard file of layout {info.get('layout_id')}",
            "the shard file was written by another save; save the code file and every rank's "
            "shard from one job",
        )
    if names.WEIGHTS not in reader.names():
        raise ArtifactCorruptedError(f"{spath}: the shard has no weights section; re-save it")
    view, check = reader.view_to_copy(names.WEIGHTS)
    try:
        local = _standin.unpack_tensors(view, check=check)
    except BaseException:
        reader.finish()  # bytes that fail their checksum explain the failure: raised instead
        raise
    reader.finish()
    return local
