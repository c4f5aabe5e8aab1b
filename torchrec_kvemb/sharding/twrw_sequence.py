"""Table-row-wise sharding of a sequence collection's KV tables.

TorchRec has no table-row-wise sharding for ``EmbeddingCollection``; this one
is built from its parts. A table lives on the ``L`` ranks of one node and is
routed as for bags (:mod:`.twrw`): local rank ``l`` owns buckets
``[l * G / L, (l + 1) * G / L)``. Input dist: each feature's ids grouped by local
owner (:func:`~torchrec_kvemb.sharding.rw.route_kv_features`), ordered rank-major
(each rank gets the features of its node's tables) and sent by ``KJTAllToAll``;
``unbucketize_permute_tensor`` records where each id went. Output dist:
TorchRec's sequence all-to-all sends each row back to the rank that sent its
id, which puts it back in the id's place, as row-wise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.dist_data import KJTAllToAll, SequenceEmbeddingsAllToAll
from torchrec.distributed.embedding_lookup import BaseEmbeddingLookup
from torchrec.distributed.embedding_sharding import BaseEmbeddingDist, BaseSparseFeaturesDist
from torchrec.distributed.embedding_types import BaseGroupedFeatureProcessor
from torchrec.distributed.sharding.rw_sharding import RwSparseFeaturesDist
from torchrec.distributed.sharding.sequence_sharding import SequenceShardingContext
from torchrec.distributed.sharding.twrw_sharding import BaseTwRwEmbeddingSharding
from torchrec.distributed.types import Awaitable, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb.sharding.kv_sequence import KVGroupedEmbeddingsLookup
from torchrec_kvemb.sharding.rw import route_kv_features
from torchrec_kvemb.sharding.twrw import KVNodeShardingMixin


def node_major_order(features_per_rank: Sequence[int], local_size: int) -> list[int]:
    """The key order that sends each rank its node's features: routed keys are
    ``features * L`` (local owner-major); rank ``n * L + l`` gets, in order, the
    keys ``l * F + f`` of node ``n``'s features ``f`` (``F``: all features, the
    nodes' in turn). The order of TorchRec's table-row-wise staggered shuffle.

    Example::

        node_major_order([2, 2, 1, 1], local_size=2)   # [0, 1, 3, 4, 2, 5]
    """
    nodes = len(features_per_rank) // local_size
    per_node = [features_per_rank[n * local_size] for n in range(nodes)]
    total = sum(per_node)
    order = []
    start = 0
    for n in range(nodes):
        for local_rank in range(local_size):
            order += [local_rank * total + f for f in range(start, start + per_node[n])]
        start += per_node[n]
    return order


class KVTwRwSequenceFeaturesDist(RwSparseFeaturesDist):
    """Input dist of table-row-wise KV sequence features: ids grouped by the local
    rank owning their bucket, each rank sent its node's features; sets
    ``unbucketize_permute_tensor`` (TorchRec's sharded ``EmbeddingCollection`` reads
    it from row-wise input dists) to each id's position in what was sent.

    Example::

        input_dist = KVTwRwSequenceFeaturesDist(pg, 2, features_per_rank=[2, 2, 1, 1],
                                                num_buckets=[64, 64, 90])
        kjt_here = input_dist(local_kjt).wait().wait()
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        local_size: int,
        features_per_rank: Sequence[int],
        num_buckets: Sequence[int],
    ) -> None:
        BaseSparseFeaturesDist.__init__(self)
        if any(g % local_size for g in num_buckets):
            raise ValueError(
                f"total_num_buckets {list(num_buckets)} must be multiples of the "
                f"local world size {local_size}"
            )
        self._local_size = local_size
        self._num_buckets = list(num_buckets)
        self._order = node_major_order(features_per_rank, local_size)
        self._dist = KJTAllToAll(pg=pg, splits=list(features_per_rank))
        self.unbucketize_permute_tensor: torch.Tensor | None = None

    def forward(
        self, sparse_features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        if sparse_features.variable_stride_per_key():
            raise ValueError(
                "table_row_wise KV tables: variable batch size per feature is not "
                "supported yet; plan these tables row_wise or table_wise"
            )
        routed, permute = route_kv_features(sparse_features, self._num_buckets, self._local_size)
        sent = routed.permute(self._order)
        # Where each routed id lands in what is sent: the same permutation of positions.
        n = routed.values().numel()
        positions = KeyedJaggedTensor(
            keys=routed.keys(),
            values=torch.arange(n, device=permute.device),
            lengths=routed.lengths(),
            stride=routed.stride(),
        ).permute(self._order)
        landed = torch.empty_like(permute).scatter_(
            0, positions.values(), torch.arange(n, device=permute.device)
        )
        self.unbucketize_permute_tensor = landed[permute]
        return self._dist(sent)


class KVTwRwSequenceEmbeddingDist(
    BaseEmbeddingDist[SequenceShardingContext, torch.Tensor, torch.Tensor]
):
    """Output dist: TorchRec's sequence all-to-all of rows back to the ranks that
    sent their ids, each row put back in its id's place.

    Example::

        output_dist = KVTwRwSequenceEmbeddingDist(pg, features_per_rank=[2, 2, 1, 1])
        rows = output_dist(local_rows, sharding_ctx).wait()
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        features_per_rank: Sequence[int],
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self._dist = SequenceEmbeddingsAllToAll(pg, list(features_per_rank), device)

    def forward(
        self,
        local_embs: torch.Tensor,
        sharding_ctx: SequenceShardingContext | None = None,
    ) -> Awaitable[torch.Tensor]:
        if sharding_ctx is None:
            raise ValueError("table_row_wise KV sequence output dist: no sharding context")
        return self._dist(
            local_embs,
            lengths=sharding_ctx.lengths_after_input_dist,
            input_splits=sharding_ctx.input_splits,
            output_splits=sharding_ctx.output_splits,
            batch_size_per_rank=sharding_ctx.batch_size_per_rank,
            sparse_features_recat=sharding_ctx.sparse_features_recat,
            unbucketize_permute_tensor=sharding_ctx.unbucketize_permute_tensor,
        )


class KVTwRwSequenceEmbeddingSharding(
    KVNodeShardingMixin,
    BaseTwRwEmbeddingSharding[
        SequenceShardingContext, KeyedJaggedTensor, torch.Tensor, torch.Tensor
    ],
):
    """Table-row-wise sharding of a sequence collection's KV tables: TorchRec's
    table placement over nodes, KV routing inside the node, KV sequence lookups.

    Example::

        sharding = KVTwRwSequenceEmbeddingSharding(sharding_infos, env, device, specs=specs)
    """

    kv_sharding_type = ShardingType.TABLE_ROW_WISE
    kv_lookup_class = KVGroupedEmbeddingsLookup

    def _features_per_rank_here(self) -> list[int]:
        return self._features_per_rank(self._grouped_embedding_configs_per_rank)

    def create_input_dist(self, device: torch.device | None = None) -> KVTwRwSequenceFeaturesDist:
        num_buckets = [
            self._kv_specs.options[table.name].total_num_buckets
            for table in self.embedding_tables()
            for _ in range(table.num_features())
        ]
        return KVTwRwSequenceFeaturesDist(
            self._pg, self._local_size, self._features_per_rank_here(), num_buckets
        )

    def create_lookup(
        self,
        device: torch.device | None = None,
        fused_params: dict[str, Any] | None = None,
        feature_processor: BaseGroupedFeatureProcessor | None = None,
    ) -> BaseEmbeddingLookup:
        if feature_processor is not None:
            raise ValueError("KV tables: feature processors are not supported yet")
        # The node's ranks hold the tables' shards, bucket ranges by local rank: to
        # the lookup (and its optimizer state) that is row-wise over the node's group.
        return KVGroupedEmbeddingsLookup(
            self._kv_specs,
            num_shards=self.kv_num_shards(),
            grouped_configs=self._grouped_embedding_configs,
            pg=self._intra_pg,
            device=device if device is not None else self._device,
            env=self._env,
            sharding_type=ShardingType.ROW_WISE,
        )

    def create_output_dist(self, device: torch.device | None = None) -> KVTwRwSequenceEmbeddingDist:
        return KVTwRwSequenceEmbeddingDist(
            self._pg,
            self._features_per_rank_here(),
            device if device is not None else self._device,
        )
