"""The SSD tier: the in-memory KV table as a cache over rows on disk.

* ``slab``: the record file (fixed-size records, checksums, memory-mapped).
* ``tier``: one table shard's SSD tier: id index, copy-on-write records, flush.
* ``tiered``: a KVTable's calls over both tiers: demotion, promotion, find, export.
* ``prefetch``: reading a coming batch's rows on a background thread.
* ``estimate``: memory and disk a table will use.

Turned on per table with ``KVTableOptions(ssd=SSDOptions(path=...))``; see
docs/ssd-tier.md.
"""

from torchrec_kvemb.ssd.estimate import storage_estimate
from torchrec_kvemb.ssd.slab import KVStorageError
from torchrec_kvemb.ssd.tier import SSDTier

__all__ = ["KVStorageError", "SSDTier", "storage_estimate"]
