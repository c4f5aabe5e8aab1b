"""Table-wise sharding of KV tables: each table lives whole on one rank.

TorchRec's table-wise sharding as is (ids travel to the table's rank by
all-to-all, pooled rows come back the same way); only the lookup differs: the
table is a :class:`~torchrec_kvemb.table.KVTable` with its full capacity.
"""

from __future__ import annotations

from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingType

from torchrec_kvemb.sharding.kv_lookup import KVLookupMixin


class KVTwPooledEmbeddingSharding(KVLookupMixin, TwPooledEmbeddingSharding):
    """TorchRec's table-wise pooled sharding with KV lookups.

    Example::

        sharding = KVTwPooledEmbeddingSharding(sharding_infos, env, device, specs=specs)
    """

    kv_sharding_type = ShardingType.TABLE_WISE
