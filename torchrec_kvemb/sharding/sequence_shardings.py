"""Row-wise and table-wise sharding of a sequence collection's KV tables.

TorchRec's sequence shardings as they are (the all-to-all of ids in, the
sequence all-to-all of rows back, in each id's place); the lookup is KV and,
row-wise, ids travel to the rank owning their routing bucket
(:mod:`torchrec_kvemb.sharding.rw`) instead of to a row range.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.distributed.embedding_lookup import BaseEmbeddingLookup
from torchrec.distributed.embedding_sharding import BaseSparseFeaturesDist, EmbeddingShardingInfo
from torchrec.distributed.embedding_types import BaseGroupedFeatureProcessor
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwSparseFeaturesDist
from torchrec.distributed.sharding.tw_sequence_sharding import TwSequenceEmbeddingSharding
from torchrec.distributed.types import Awaitable, QuantizedCommCodecs, ShardingEnv, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb.sharding.kv_embedding import KVTableSpecs
from torchrec_kvemb.sharding.kv_sequence import KVGroupedEmbeddingsLookup
from torchrec_kvemb.sharding.rw import check_num_buckets, route_kv_features


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


class _KVSequenceLookupMixin:
    """``create_lookup`` of a KV sequence sharding (mixed in before TorchRec's, which
    provides ``_pg``, ``_device``, ``_env`` and ``_grouped_embedding_configs``)."""

    kv_sharding_type: ShardingType
    _kv_specs: KVTableSpecs

    def create_lookup(
        self,
        device: torch.device | None = None,
        fused_params: dict[str, Any] | None = None,
        feature_processor: BaseGroupedFeatureProcessor | None = None,
    ) -> BaseEmbeddingLookup:
        if feature_processor is not None:
            raise ValueError("KV tables: feature processors are not supported yet")
        row_wise = self.kv_sharding_type == ShardingType.ROW_WISE
        return KVGroupedEmbeddingsLookup(
            self._kv_specs,
            self._pg.size() if row_wise else 1,
            grouped_configs=self._grouped_embedding_configs,
            pg=self._pg,
            device=device if device is not None else self._device,
            env=self._env,
            sharding_type=self.kv_sharding_type,
        )


class KVRwSequenceEmbeddingSharding(_KVSequenceLookupMixin, RwSequenceEmbeddingSharding):
    """TorchRec's row-wise sequence sharding with KV routing and KV lookups.

    Example::

        sharding = KVRwSequenceEmbeddingSharding(sharding_infos, env, device, specs=specs)
    """

    kv_sharding_type = ShardingType.ROW_WISE

    def __init__(
        self,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        *,
        specs: KVTableSpecs,
    ) -> None:
        super().__init__(sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)
        self._kv_specs = specs
        for info in sharding_infos:
            name = info.embedding_config.name
            check_num_buckets(name, specs.options[name].total_num_buckets, self._pg.size())

    def create_input_dist(self, device: torch.device | None = None) -> KVRwSequenceFeaturesDist:
        num_buckets = [
            self._kv_specs.options[t.name].total_num_buckets
            for t in self.embedding_tables()
            for _ in range(t.num_features())
        ]
        return KVRwSequenceFeaturesDist(self._pg, num_buckets)


class KVTwSequenceEmbeddingSharding(_KVSequenceLookupMixin, TwSequenceEmbeddingSharding):
    """TorchRec's table-wise sequence sharding with KV lookups.

    Example::

        sharding = KVTwSequenceEmbeddingSharding(sharding_infos, env, device, specs=specs)
    """

    kv_sharding_type = ShardingType.TABLE_WISE

    def __init__(
        self,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        *,
        specs: KVTableSpecs,
    ) -> None:
        super().__init__(sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)
        self._kv_specs = specs


#: The sequence sharding of a KV table by sharding type.
KV_SEQUENCE_SHARDINGS = {
    ShardingType.ROW_WISE.value: KVRwSequenceEmbeddingSharding,
    ShardingType.TABLE_WISE.value: KVTwSequenceEmbeddingSharding,
}
