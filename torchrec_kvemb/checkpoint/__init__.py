"""Checkpoints of models with KV tables: ``save(model, path)`` / ``load(model, path)``.

Built on ``torch.distributed.checkpoint`` (DCP). One checkpoint holds the whole
model's ``state_dict()`` (KV tables as described in :mod:`torchrec_kvemb.state_dict`,
stock tables, dense parameters and buffers), the fused optimizer state of stock
tables (``model.fused_optimizer``, where the model has one), the learning rate of
each KV table's fused optimizer and, optionally, a dense optimizer. Both calls are
collectives when ``torch.distributed`` is initialized (call them on every rank)
and work without a process group too.

``load`` works at another world size, another sharding type of a KV table
(row-wise <-> table-wise) and into the unsharded ``KVEmbeddingBagCollection``:
each rank reads the saved rows of the routing buckets it owns (rows are stored
sorted by bucket, so that is one contiguous range per table), keeps the ids it
owns and inserts them with their optimizer state and eviction scores.

Saving is atomic: DCP writes into ``<path>.tmp-<uuid>``; after a barrier rank 0
renames it to ``path`` (replacing an older checkpoint there) and writes the
``COMPLETE`` marker with the table-config fingerprint. ``load`` refuses a
directory without the marker, and a checkpoint whose KV tables differ from the
model's (dim, optimizer), naming the table; nothing in the model changes when a
load fails. Format and layout: docs/checkpoint-format.md.

``async_save(model, path)`` (or ``save(..., blocking=False)``) copies the state at
the call and writes it on a background thread while training goes on; its
handle's ``result()`` waits and raises ``CheckpointError`` on failure
(:mod:`.asynchronous`: the snapshot, the handle, the gloo group its collectives
use).

Modules: :mod:`.save_load` (``save``, ``async_save``, ``load``), :mod:`.marker` (``COMPLETE``,
``fingerprint``, atomic publication), :mod:`.reader` (DCP load planners, the
parallel reader), :mod:`.optimizer_state` (fused, KV learning rates, dense),
:mod:`.collectives`, :mod:`.migrate` (stock <-> KV tables), :mod:`.incremental`
and :mod:`.streaming` (dumps of changed rows).

Example::

    from torchrec_kvemb import checkpoint

    checkpoint.save(model, "/ckpt/step_1000", optimizer=dense_optimizer)
    ...  # any world size, any KV sharding type, or unsharded
    checkpoint.load(model, "/ckpt/step_1000", optimizer=dense_optimizer)
"""

from torchrec_kvemb.checkpoint.asynchronous import AsyncCheckpoint
from torchrec_kvemb.checkpoint.incremental import (
    IncrementalDumper,
    apply_dumps,
    dump_incremental,
    load_dumps_into,
)
from torchrec_kvemb.checkpoint.marker import MARKER, fingerprint, read_marker
from torchrec_kvemb.checkpoint.reader import KVLoadPlanner, ParallelFileSystemReader
from torchrec_kvemb.checkpoint.save_load import async_save, load, save
from torchrec_kvemb.checkpoint.streaming import CallableSink, EmbeddingStreamer, FileSink
from torchrec_kvemb.state_dict.checks import CheckpointError

__all__ = [
    "MARKER",
    "AsyncCheckpoint",
    "CallableSink",
    "CheckpointError",
    "EmbeddingStreamer",
    "FileSink",
    "IncrementalDumper",
    "KVLoadPlanner",
    "ParallelFileSystemReader",
    "apply_dumps",
    "async_save",
    "dump_incremental",
    "fingerprint",
    "load",
    "load_dumps_into",
    "read_marker",
    "save",
]
