"""Row-wise, table-wise and column-wise sharding of a sequence collection's KV tables
(and the registry of its KV shardings, table-row-wise from :mod:`.twrw_sequence` included).

TorchRec's sequence shardings as they are (the all-to-all of ids in, the
sequence all-to-all of rows back, in each id's place); the lookup is KV and,
row-wise, ids travel to the rank owning their routing bucket
(:mod:`torchrec_kvemb.sharding.rw`) instead of to a row range.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.distributed.embedding_sharding import BaseSparseFeaturesDist, EmbeddingShardingInfo
from torchrec.distributed.sharding.cw_sequence_sharding import CwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwSparseFeaturesDist
from torchrec.distributed.sharding.tw_sequence_sharding import TwSequenceEmbeddingSharding
from torchrec.distributed.types import Awaitable, QuantizedCommCodecs, ShardingEnv, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb.sharding.cw import check_column_shards
from torchrec_kvemb.sharding.kv_embedding import KVTableSpecs
from torchrec_kvemb.sharding.kv_lookup import KVLookupMixin
from torchrec_kvemb.sharding.kv_sequence import KVGroupedEmbeddingsLookup
from torchrec_kvemb.sharding.rw import route_kv_features
from torchrec_kvemb.sharding.twrw_sequence import KVTwRwSequenceEmbeddingSharding


class KVRwSequenceFeaturesDist(RwSparseFeaturesDist):
    """Input dist of row-wise KV sequence features: route by bucket, then TorchRec's
    ``KJTAllToAll``; ``unbucketize_permute_tensor`` tells the output dist where
    each id's row goes back (why a ``RwSparseFeaturesDist``: TorchRec's sharded
    ``EmbeddingCollection`` reads that attribute from its row-wise input dists).

    Example::

        dist_ = KVRwSequenceFeaturesDist(pg, num_buckets=[1024, 1024])
        kjt_here = dist_(local_kjt).wait().wait()
    """

    def __init__(self, pg: dist.ProcessGroup, num_buckets: Sequence[int]) -> None:
        BaseSparseFeaturesDist.__init__(self)
        self._world_size = pg.size()
        self._num_buckets = list(num_buckets)
        self._dist = KJTAllToAll(pg=pg, splits=[len(self._num_buckets)] * self._world_size)
        self.unbucketize_permute_tensor: torch.Tensor | None = None

    def forward(
        self, sparse_features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        routed, permute = route_kv_features(sparse_features, self._num_buckets, self._world_size)
        self.unbucketize_permute_tensor = permute
        return self._dist(routed)


class _KVSequenceSharding(KVLookupMixin):
    """A KV sharding of a sequence collection: its lookup is the sequence lookup."""

    kv_lookup_class = KVGroupedEmbeddingsLookup


class KVRwSequenceEmbeddingSharding(_KVSequenceSharding, RwSequenceEmbeddingSharding):
    """TorchRec's row-wise sequence sharding with KV routing and KV lookups.

    Example::

        sharding = KVRwSequenceEmbeddingSharding(sharding_infos, env, device, specs=specs)
    """

    kv_sharding_type = ShardingType.ROW_WISE

    def create_input_dist(self, device: torch.device | None = None) -> KVRwSequenceFeaturesDist:
        num_buckets = [
            self._kv_specs.options[t.name].total_num_buckets
            for t in self.embedding_tables()
            for _ in range(t.num_features())
        ]
        return KVRwSequenceFeaturesDist(self._pg, num_buckets)


class KVTwSequenceEmbeddingSharding(_KVSequenceSharding, TwSequenceEmbeddingSharding):
    """TorchRec's table-wise sequence sharding with KV lookups.

    Example::

        sharding = KVTwSequenceEmbeddingSharding(sharding_infos, env, device, specs=specs)
    """

    kv_sharding_type = ShardingType.TABLE_WISE


class KVCwSequenceEmbeddingSharding(_KVSequenceSharding, CwSequenceEmbeddingSharding):
    """TorchRec's column-wise sequence sharding with KV lookups: each column shard a
    ``KVTable`` of its width holding every id (see :mod:`torchrec_kvemb.sharding.cw`).

    Example::

        sharding = KVCwSequenceEmbeddingSharding(sharding_infos, env, device, specs=specs)
    """

    kv_sharding_type = ShardingType.COLUMN_WISE

    def __init__(
        self,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        *,
        specs: KVTableSpecs,
    ) -> None:
        check_column_shards(sharding_infos, env.world_size)
        super().__init__(
            sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry, specs=specs
        )

    def kv_num_shards(self) -> int:
        """Every column shard holds all of the table's ids: its whole capacity."""
        return 1


#: The sequence sharding of a KV table by sharding type.
KV_SEQUENCE_SHARDINGS = {
    ShardingType.ROW_WISE.value: KVRwSequenceEmbeddingSharding,
    ShardingType.TABLE_WISE.value: KVTwSequenceEmbeddingSharding,
    ShardingType.COLUMN_WISE.value: KVCwSequenceEmbeddingSharding,
    ShardingType.TABLE_ROW_WISE.value: KVTwRwSequenceEmbeddingSharding,
}
