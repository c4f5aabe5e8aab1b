"""Storage of the lower tier under a KV table: rows on disk.

* ``slab``: the record file (fixed-size records, checksums, memory-mapped).
* ``torchrec_kvemb.slot_index`` (beside this package): the id index of the rows on
  disk (bounded, or growing), shared with the host tier.
* ``store``: one table shard's rows on disk: index, copy-on-write records, flush.
* ``prefetch``: reading a coming batch's rows on a background thread.
* ``estimate``: memory and disk a table will use.

A table uses it through ``torchrec_kvemb.tiered.TieredKVTable``, turned on per
table with ``KVTableOptions(ssd=SSDOptions(path=...))``, and only through the
lower-tier contract (``torchrec_kvemb.tier.LowerTier``); see docs/ssd-tier.md.
"""

from torchrec_kvemb.ssd.estimate import storage_estimate
from torchrec_kvemb.ssd.slab import KVStorageError
from torchrec_kvemb.ssd.store import SSDStore

__all__ = ["KVStorageError", "SSDStore", "storage_estimate"]
