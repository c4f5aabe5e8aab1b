"""Table-row-wise sharding of KV tables: a table lives on the ranks of one node,
its ids routed to them by bucket.

The plan places a table on node ``n`` (``ParameterSharding.ranks``: the ``L``
ranks of that node, ``L`` = the local world size). Local rank ``l`` of the node
owns the routing buckets ``[l * G / L, (l + 1) * G / L)`` of the table
(``G = options.total_num_buckets``, which ``L`` must divide), so a shard holds
``ceil(1 / L)`` of the table's capacity. Ids travel unchanged (raw ids are
the keys).

Input dist: the routing of :mod:`.rw` with ``L`` owners (each feature's ids
grouped by local rank), then TorchRec's table-row-wise shuffle and all-to-all
(each node receives the features of its tables only). Output dist: TorchRec's
(reduce-scatter of pooled partial sums inside the node, all-to-all across
nodes). MEAN tables pool exactly as row-wise: ``weight / bag length`` travels
with each id and every shard pools by weighted sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_lookup import BaseEmbeddingLookup
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import (
    BaseGroupedFeatureProcessor,
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
    ShardedEmbeddingTable,
)
from torchrec.distributed.sharding.twrw_sharding import (
    TwRwPooledEmbeddingSharding,
    TwRwSparseFeaturesDist,
)
from torchrec.distributed.types import (
    Awaitable,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb.sharding.kv_embedding import (
    KVEmbeddingBag,
    KVGroupedPooledEmbeddingsLookup,
    KVTableSpecs,
)
from torchrec_kvemb.sharding.kv_lookup import KVLookupMixin
from torchrec_kvemb.sharding.rw import bucketize_kv_features


def check_node_buckets(table: str, num_buckets: int, local_size: int) -> None:
    """Table-row-wise needs the local world size to divide the table's
    ``total_num_buckets``."""
    if num_buckets % local_size != 0:
        raise ValueError(
            f"table {table!r}: table_row_wise sharding over nodes of {local_size} ranks "
            f"needs KVTableOptions.total_num_buckets to be a multiple of {local_size}, "
            f"got {num_buckets}"
        )


def node_ranks(table: str, ranks: Sequence[int], local_size: int, world_size: int) -> list[int]:
    """The ranks holding a table-row-wise table: every rank of the node of
    ``ranks[0]``; the plan's ``ranks`` must be exactly those, in order."""
    if world_size % local_size != 0:
        raise ValueError(
            f"table {table!r}: table_row_wise sharding needs the world size {world_size} "
            f"to be a multiple of the local world size {local_size}"
        )
    node = ranks[0] // local_size
    expected = list(range(node * local_size, (node + 1) * local_size))
    if list(ranks) != expected:
        raise ValueError(
            f"table {table!r}: a table_row_wise plan must place the table on all ranks "
            f"of one node {expected} (local world size {local_size}), got ranks {list(ranks)}"
        )
    return expected


class KVTwRwSparseFeaturesDist(TwRwSparseFeaturesDist):
    """Input dist of table-row-wise KV features: each feature's ids grouped by the
    local rank that owns their bucket (:func:`~torchrec_kvemb.sharding.rw.bucketize_kv_features`
    with ``local_size`` owners), then TorchRec's table-row-wise shuffle and
    ``KJTAllToAll``, which send every node the features of its tables.

    ``num_buckets`` / ``mean_pooled``: per feature, in the sharding's feature order.

    Example::

        input_dist = KVTwRwSparseFeaturesDist(pg, local_size=2, features_per_rank=[2, 2, 1, 1],
                                              num_buckets=[64, 64, 64], mean_pooled=[False] * 3)
        kjt_on_this_rank = input_dist(local_kjt).wait().wait()
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        local_size: int,
        features_per_rank: list[int],
        num_buckets: Sequence[int],
        mean_pooled: Sequence[bool],
        device: torch.device | None = None,
    ) -> None:
        if any(g % local_size for g in num_buckets):
            raise ValueError(
                f"total_num_buckets {list(num_buckets)} must be multiples of the "
                f"local world size {local_size}"
            )
        # The stock block sizes are unused: routing is by bucket, not by row range.
        super().__init__(
            pg=pg,
            local_size=local_size,
            features_per_rank=features_per_rank,
            feature_hash_sizes=[local_size] * len(num_buckets),
            device=device,
        )
        self._num_buckets = list(num_buckets)
        self._mean_pooled = list(mean_pooled)

    def forward(
        self, sparse_features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        if sparse_features.variable_stride_per_key():
            raise ValueError(
                "table_row_wise KV tables: variable batch size per feature is not "
                "supported yet; plan these tables row_wise or table_wise"
            )
        routed = bucketize_kv_features(
            sparse_features, self._num_buckets, self._local_size, self._mean_pooled
        )
        shuffled = routed.permute(self._sf_staggered_shuffle, self._sf_staggered_shuffle_tensor)
        return self._dist(shuffled)


class KVTwRwPooledEmbeddingsLookup(KVGroupedPooledEmbeddingsLookup):
    """The grouped KV lookup of a table-row-wise sharding: every table one of
    ``num_shards`` (the local world size) shards, pooled by weighted sum (MEAN's
    ``1 / bag length`` comes with the ids), its optimizer state sharded over
    ``node_pg`` (the node's ranks).

    Example::

        lookup = KVTwRwPooledEmbeddingsLookup(specs, num_shards=2, grouped_configs=configs,
                                              pg=pg, node_pg=intra_pg, device=device)
    """

    def __init__(
        self,
        specs: KVTableSpecs,
        num_shards: int,
        grouped_configs: list[GroupedEmbeddingConfig],
        device: torch.device | None = None,
        pg: dist.ProcessGroup | None = None,
        sharding_type: ShardingType | None = None,
        env: ShardingEnv | None = None,
        *,
        node_pg: dist.ProcessGroup | None = None,
    ) -> None:
        # Read by _create_embedding_kernel, which the base __init__ calls.
        self.__dict__["_kv_node_pg"] = node_pg
        super().__init__(specs, num_shards, grouped_configs, device, pg, sharding_type, env)

    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | None,
        pg: dist.ProcessGroup | None,
        sharding_type: ShardingType | None,
        env: ShardingEnv | None,
    ) -> KVEmbeddingBag:
        if config.compute_kernel != EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            raise ValueError(
                f"tables {config.table_names()}: a KV table_row_wise lookup holds KV "
                f"tables only, got compute kernel {config.compute_kernel.value}"
            )
        lookup = self._kv_specs.bag_lookup(config, device, self._kv_num_shards, True)
        # The node's ranks hold the tables' shards, bucket ranges by local rank: the
        # optimizer state is row-wise over the node.
        return KVEmbeddingBag(config, lookup, group=self._kv_node_pg, row_wise=True)


class KVNodeShardingMixin(KVLookupMixin):
    """What the table-row-wise KV shardings (bags and sequences) share, mixed in
    before a TorchRec ``BaseTwRwEmbeddingSharding``: the plan and bucket checks,
    this rank's grouped configs (its node's tables), ``L`` shards per table.

    Example::

        class KVTwRwPooledEmbeddingSharding(KVNodeShardingMixin, TwRwPooledEmbeddingSharding):
            kv_sharding_type = ShardingType.TABLE_ROW_WISE
    """

    _local_size: int
    _world_size: int
    _rank: int
    _grouped_embedding_configs_per_rank: list[list[GroupedEmbeddingConfig]]
    _grouped_embedding_configs_per_node: list[list[GroupedEmbeddingConfig]]

    def __init__(
        self,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        *,
        specs: KVTableSpecs,
    ) -> None:
        super().__init__(
            sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry, specs=specs
        )
        for info in sharding_infos:
            name = info.embedding_config.name
            node_ranks(name, info.param_sharding.ranks, self._local_size, self._world_size)
            check_node_buckets(name, specs.options[name].total_num_buckets, self._local_size)

    @property
    def _grouped_embedding_configs(self) -> list[GroupedEmbeddingConfig]:
        """This rank's grouped configs (the tables of its node)."""
        return self._grouped_embedding_configs_per_rank[self._rank]

    def kv_num_shards(self) -> int:
        """How many ranks share each table: the local world size."""
        return self._local_size

    def embedding_tables(self) -> list[ShardedEmbeddingTable]:
        """Every table of the sharding, the nodes' in turn: the order of its features
        (what TorchRec's table-row-wise sharding does not say; index dedup reads it)."""
        return [
            table
            for configs in self._grouped_embedding_configs_per_node
            for config in configs
            for table in config.embedding_tables
        ]


class KVTwRwPooledEmbeddingSharding(KVNodeShardingMixin, TwRwPooledEmbeddingSharding):
    """TorchRec's table-row-wise pooled sharding with KV routing and KV lookups.

    Each table lives on the ranks of one node, each holding ``1 / L`` of its
    capacity (``L``: the local world size, from ``LOCAL_WORLD_SIZE``).

    Example::

        sharding = KVTwRwPooledEmbeddingSharding(sharding_infos, env, device, specs=specs)
    """

    kv_sharding_type = ShardingType.TABLE_ROW_WISE
    kv_lookup_class = KVTwRwPooledEmbeddingsLookup

    def create_input_dist(self, device: torch.device | None = None) -> KVTwRwSparseFeaturesDist:
        tables = self.embedding_tables()
        num_buckets = [
            self._kv_specs.options[t.name].total_num_buckets
            for t in tables
            for _ in range(t.num_features())
        ]
        mean_pooled = [t.pooling == PoolingType.MEAN for t in tables for _ in t.feature_names]
        return KVTwRwSparseFeaturesDist(
            self._pg,
            self._local_size,
            self._features_per_rank(self._grouped_embedding_configs_per_rank),
            num_buckets,
            mean_pooled,
            device=device if device is not None else self._device,
        )

    def create_lookup(
        self,
        device: torch.device | None = None,
        fused_params: dict[str, Any] | None = None,
        feature_processor: BaseGroupedFeatureProcessor | None = None,
    ) -> BaseEmbeddingLookup:
        if feature_processor is not None:
            raise ValueError("KV tables: feature processors are not supported yet")
        return KVTwRwPooledEmbeddingsLookup(
            self._kv_specs,
            num_shards=self.kv_num_shards(),
            grouped_configs=self._grouped_embedding_configs,
            pg=self._pg,
            device=device if device is not None else self._device,
            sharding_type=self.kv_sharding_type,
            env=self._env,
            node_pg=self._intra_pg,
        )
