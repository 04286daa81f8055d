"""One artifact for every rank of a torch.distributed job (DTensor tensor parallel).

A model parallelised with ``parallelize_module`` holds DTensor parameters:
each rank its own shard. The compiled code is the same on every rank: the
stages trace such a model under ``compile_on_one_rank`` (:func:`one_rank_tracing`),
so a rank's mesh coordinate is computed at run time and the process groups
are reached through the DeviceMesh, which the loader binds to the rank's
live mesh (``DistributedFile.deserializing``): the mesh passed to
``Precompile.load(path, mesh=...)``, the one of a model bound with ``model=``,
or one the load builds. It is saved once; the shards are
rank-specific, so each rank's shard goes to its own file:

- ``PATH``: the code file, an ordinary artifact whose header carries the
  layout (world size, mesh, each DTensor's placements and global shape) and
  whose ``weights`` hold only the plain (replicated) tensors;
- ``PATH.rank<r>-of-<n>``: rank ``r``'s local shards, in the same container.

Loading reads the code file and the rank's own shard file, never another
rank's. The layout is checked first: another world size, mesh shape,
process-group naming or placement raises :class:`DistributedLayoutError`
naming both sides.

Modules, by job: ``placement`` (the layout recorded from a model), ``tracing``
(one capture for every rank), ``shards`` (the per-rank shard files),
``binding`` (the layout checked and the live mesh bound at load), and
``data_parallel`` (sharded data parallel that compiles).
"""
