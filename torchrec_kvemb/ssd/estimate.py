"""What a table will use: memory (its rows, a host tier's, the SSD tier's index) and disk.

The in-memory part is ``torchrec_kvemb.memory.table_memory`` (sized by
``capacity`` or ``memory_budget_bytes``, at the maximum capacity of a table that
grows, its scratch reserve included); the SSD tier adds, in memory,
24 bytes per index slot (key, score, record number) and 17 bytes per slab
record (free list, write generation, durable flag), and on disk one record per
row plus the slack copy-on-write needs: the rows freed since the last flush
(up to a quarter of the file before the table flushes by itself) and the
in-memory rows written by the last flush and the room kept for the next one.
A slab grows by half when it is short, and it is short only with less than a
quarter of it waiting for a flush, so it holds at most
``2 * (ssd_rows + 2 * memory_rows) + 1024`` records (for batches of fewer
distinct ids than ``memory_rows``; ``benchmarks/soak.py`` checks it).

A host tier (``KVTableOptions.host_tier``) adds its rows, records and index in
host memory (``host_tier.host_tier_bytes``). ``table_bytes`` (the table's own
arrays: device memory, HBM, on CUDA) and ``host_bytes`` (the lower tiers' host
memory, DDR) are reported apart, as TorchRec's ``Storage(hbm=..., ddr=...)``
(:func:`planner_storage`).
"""

from __future__ import annotations

import math

from torchrec.distributed.planner.types import Storage

from torchrec_kvemb.host_tier import host_tier_bytes
from torchrec_kvemb.memory import table_memory
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import WAYS, KVTableOptions
from torchrec_kvemb.slot_index import INDEX_BYTES_PER_SLOT, INITIAL_BUCKETS, MAX_LOAD
from torchrec_kvemb.ssd.slab import HEADER_BYTES, record_words
from torchrec_kvemb.ssd.store import BOOKKEEPING_BYTES_PER_RECORD, MIN_GROWTH

#: Slab records per row the tier may need (see the module docstring): 4/3 of the
#: rows in use before a growth, times the growth of 1.5.
SLAB_SLACK = 2.0
#: Bytes per row of the index file a flush writes (id, score, record; 16 for memory rows).
INDEX_FILE_BYTES_PER_ROW = 24


def _index_slots(options: KVTableOptions, ssd_rows: int) -> int:
    if options.ssd.capacity is not None:
        return math.ceil(options.ssd.capacity / WAYS) * WAYS
    buckets = INITIAL_BUCKETS
    while ssd_rows > MAX_LOAD * buckets * WAYS:
        buckets *= 2
    return buckets * WAYS


def storage_estimate(
    options: KVTableOptions,
    dim: int,
    optim: FusedOptimConfig | None = None,
    ssd_rows: int | None = None,
    host_rows: int | None = None,
) -> dict[str, int]:
    """Memory and disk one table (or shard) built from ``options`` will use.

    ``ssd_rows``: rows expected in the SSD tier; default ``options.ssd.capacity``
    (needed when the tier has no capacity); ``host_rows``: rows expected in a host
    tier without a bound. Returns ``memory_bytes`` (``table_bytes`` +
    ``host_bytes``), ``disk_bytes``, and the figures behind them: ``memory_rows``
    (in-memory capacity), ``host_rows``, ``ssd_rows``, ``record_bytes``,
    ``slab_records``.

    Example::

        storage_estimate(
            KVTableOptions(memory_budget_bytes=2**30, ssd=SSDOptions("/mnt/ssd", 50_000_000)),
            dim=64,
            optim=FusedOptimConfig(),
        )   # {"memory_bytes": ..., "disk_bytes": ..., ...}
    """
    in_memory = table_memory(options, dim, optim or FusedOptimConfig())
    memory_rows, memory = in_memory.rows, in_memory.bytes
    record_bytes = 8 * record_words(dim, in_memory.state_dim)
    host_rows, host_bytes = 0, 0
    if options.host_tier is not None:
        host_rows, host_bytes = host_tier_bytes(
            options.host_tier, dim, in_memory.state_dim, host_rows
        )
    out = {
        "memory_bytes": memory + host_bytes,
        "table_bytes": memory,
        "host_bytes": host_bytes,
        "disk_bytes": 0,
        "memory_rows": memory_rows,
        "host_rows": host_rows,
        "ssd_rows": 0,
        "record_bytes": record_bytes,
        "slab_records": 0,
    }
    if options.ssd is None:
        return out
    if ssd_rows is None:
        ssd_rows = options.ssd.capacity
    if ssd_rows is None:
        raise ValueError(
            "storage_estimate: the SSD tier has no capacity; give ssd_rows (rows expected there)"
        )
    if options.ssd.capacity is not None:
        ssd_rows = min(ssd_rows, options.ssd.capacity)
    # why host_rows here: over a host tier, a flush snapshot holds its rows too.
    snapshot_rows = memory_rows + host_rows
    records = math.ceil(SLAB_SLACK * (ssd_rows + 2 * snapshot_rows)) + MIN_GROWTH
    ssd_host = (
        _index_slots(options, ssd_rows) * INDEX_BYTES_PER_SLOT
        + records * BOOKKEEPING_BYTES_PER_RECORD
    )
    out.update(
        memory_bytes=memory + host_bytes + ssd_host,
        host_bytes=host_bytes + ssd_host,
        disk_bytes=HEADER_BYTES
        + records * record_bytes
        + (ssd_rows + snapshot_rows) * INDEX_FILE_BYTES_PER_ROW,
        ssd_rows=ssd_rows,
        slab_records=records,
    )
    return out


def planner_storage(
    options: KVTableOptions,
    dim: int,
    optim: FusedOptimConfig | None = None,
    compute_device: str = "cuda",
    ssd_rows: int | None = None,
    host_rows: int | None = None,
) -> Storage:
    """TorchRec's ``Storage`` of one table (or shard): on CUDA the table's own arrays in
    ``hbm`` and its lower tiers' host memory in ``ddr``; on the CPU all in ``ddr``.

    Example::

        planner_storage(KVTableOptions(capacity=1 << 20, host_tier=HostTierOptions(
            capacity=1 << 24)), dim=64)   # Storage(hbm=..., ddr=...)
    """
    estimate = storage_estimate(options, dim, optim, ssd_rows, host_rows)
    if compute_device == "cuda":
        return Storage(hbm=estimate["table_bytes"], ddr=estimate["host_bytes"])
    return Storage(hbm=0, ddr=estimate["memory_bytes"])
