"""Sharding KV tables with TorchRec's ``DistributedModelParallel`` (see docs/sharding.md).

Importing this package gives TorchRec's planner a bandwidth for KV tables'
compute kernel (``customized_kernel``), which it otherwise refuses.
"""

from torchrec_kvemb.sharding.dmp_collection import KVDMPCollection
from torchrec_kvemb.sharding.fused_optimizer import KVFusedOptimizer
from torchrec_kvemb.sharding.kv_embedding import KVEmbeddingBag
from torchrec_kvemb.sharding.planner import (
    KV_COMPUTE_KERNEL,
    kv_table_bytes,
    register_perf_estimates,
    storage_proxy,
)
from torchrec_kvemb.sharding.replica_sync import KVReplicaSync, kv_replica_sync_enabled
from torchrec_kvemb.sharding.rw import bucketize_kv_features, owner_rank
from torchrec_kvemb.sharding.sharded_ebc import ShardedKVEmbeddingBagCollection
from torchrec_kvemb.sharding.sharded_ec import ShardedKVEmbeddingCollection
from torchrec_kvemb.sharding.sharder import (
    KVEmbeddingBagCollectionSharder,
    KVEmbeddingCollectionSharder,
)

register_perf_estimates()

__all__ = [
    "KV_COMPUTE_KERNEL",
    "KVDMPCollection",
    "KVEmbeddingBag",
    "KVEmbeddingBagCollectionSharder",
    "KVEmbeddingCollectionSharder",
    "KVFusedOptimizer",
    "KVReplicaSync",
    "ShardedKVEmbeddingBagCollection",
    "ShardedKVEmbeddingCollection",
    "bucketize_kv_features",
    "kv_replica_sync_enabled",
    "kv_table_bytes",
    "owner_rank",
    "register_perf_estimates",
    "storage_proxy",
]
