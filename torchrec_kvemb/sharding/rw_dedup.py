"""Row-wise KV bags with ``use_index_dedup``: unique ids travel, rows come back, bags
pool where they were formed.

Without dedup a row-wise bag is cut by owner rank, every id travels (with its
per-sample weight) and each owner sends back partial pooled sums. With dedup
each rank keeps, per table, the first occurrence of every id of its batch
(:func:`~torchrec_kvemb.sharding.index_dedup.dedup_features`, no weights), routes
those by bucket as a sequence batch, the owners look each one up once
(TorchRec's sequence lookup with KV kernels) and send its row back (TorchRec's
sequence all-to-all, rows in their ids' places); the rank then copies each row
to every occurrence and pools its own bags, with their per-sample weights and
MEAN divisors, exactly as the unsharded module does. In backward each unique
id gets the sum of its occurrences' gradients, travels back once, and the
owner's fused optimizer applies it.

The tables of a deduplicated sharding share one ``embedding_dim`` (rows of one
width travel in one tensor); a batch with a batch size per feature (VBE) cannot
be de-duplicated. Both are refused by name.

Example::

    sharder = KVEmbeddingBagCollectionSharder(options, fused_params=fused,
                                              use_index_dedup=True)
    model = DistributedModelParallel(model, sharders=[sharder], plan=row_wise_plan)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.distributed.embedding_lookup import BaseEmbeddingLookup
from torchrec.distributed.embedding_sharding import (
    BaseEmbeddingDist,
    BaseSparseFeaturesDist,
    EmbeddingShardingContext,
)
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingDist
from torchrec.distributed.sharding.sequence_sharding import SequenceShardingContext
from torchrec.distributed.types import Awaitable
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb.sharding.index_dedup import dedup_features, table_labels
from torchrec_kvemb.sharding.kv_sequence import KVGroupedEmbeddingsLookup
from torchrec_kvemb.sharding.rw import KVRwPooledEmbeddingSharding, route_kv_features


@dataclass
class KVDedupBagContext(SequenceShardingContext):
    """A deduplicated row-wise sharding's context: TorchRec's sequence context (the
    all-to-all splits, where each routed id went) plus the rank's own batch and
    where each of its ids' rows is among the unique ones (``reverse``)."""

    features: KeyedJaggedTensor | None = None
    reverse: torch.Tensor | None = None

    def record_stream(self, stream: torch.Stream) -> None:
        super().record_stream(stream)
        if self.features is not None:
            self.features.record_stream(stream)
        if self.reverse is not None:
            self.reverse.record_stream(stream)


class KVDedupBagFeaturesDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """Input dist of a deduplicated row-wise KV bag sharding: each (table, id) of the
    batch once, routed by bucket, TorchRec's ``KJTAllToAll``. What the output dist
    needs of the call is handed to the sharded module's context by
    :meth:`context` right after the call.

    Example::

        input_dist = KVDedupBagFeaturesDist(pg, num_buckets=[90, 90], labels=[0, 0])
        awaitable = input_dist(local_kjt)
        ctx = input_dist.context(EmbeddingShardingContext())
    """

    def __init__(
        self, pg: dist.ProcessGroup, num_buckets: Sequence[int], labels: Sequence[int]
    ) -> None:
        super().__init__()
        self._world_size = pg.size()
        self._num_buckets = list(num_buckets)
        self._labels = list(labels)
        self._dist = KJTAllToAll(pg=pg, splits=[len(self._num_buckets)] * self._world_size)
        self._last: KVDedupBagContext | None = None

    def forward(
        self, sparse_features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        dedup, reverse = dedup_features(sparse_features, self._labels)
        unique = KeyedJaggedTensor(
            keys=dedup.keys(),
            values=dedup.values(),
            lengths=dedup.lengths(),
            stride=dedup.stride(),
        )
        routed, permute = route_kv_features(unique, self._num_buckets, self._world_size)
        self._last = KVDedupBagContext(
            features_before_input_dist=unique,
            unbucketize_permute_tensor=permute,
            features=sparse_features,
            reverse=reverse,
        )
        return self._dist(routed)

    def context(self, base: EmbeddingShardingContext) -> KVDedupBagContext:
        """The last call's context, with what the sharded module recorded in ``base``."""
        ctx, self._last = self._last, None
        if ctx is None:
            raise RuntimeError("KVDedupBagFeaturesDist.context() before a batch went through")
        ctx.batch_size_per_feature_pre_a2a = base.batch_size_per_feature_pre_a2a
        ctx.variable_batch_per_feature = base.variable_batch_per_feature
        return ctx


class _PooledHere(Awaitable[torch.Tensor]):
    """The rows of the unique ids, once back: copied to every occurrence, pooled per
    bag (per-sample weights; MEAN divides by the bag's length), ``[stride, features
    x dim]`` in the sharding's feature order, as the stock output dist gives."""

    def __init__(
        self, rows: Awaitable[torch.Tensor], ctx: KVDedupBagContext, mean: list[bool], dim: int
    ) -> None:
        super().__init__()
        self._rows = rows
        self._ctx = ctx
        self._mean = mean
        self._dim = dim

    def _wait_impl(self) -> torch.Tensor:
        unique_rows = self._rows.wait().view(-1, self._dim)
        features = self._ctx.features
        assert features is not None and self._ctx.reverse is not None
        stride, num_keys = features.stride(), len(features.keys())
        lengths = features.lengths().to(torch.int64)
        scale = features.weights_or_none()
        if any(self._mean):
            is_mean = torch.tensor(self._mean, device=lengths.device).repeat_interleave(stride)
            divisor = torch.where(is_mean, lengths.clamp(min=1), 1).to(unique_rows.dtype)
            per_id = divisor.repeat_interleave(lengths, output_size=self._ctx.reverse.numel())
            ones = torch.ones_like(per_id)
            # why divide (not multiply by 1/len): the unsharded MEAN scales by w / len.
            scale = (ones if scale is None else scale.to(unique_rows.dtype)) / per_id
        # why embedding_bag: it gathers each occurrence's row from the unique rows and
        # pools in one pass (and reduces the gradient per unique row in backward); an
        # explicit gather, index_add and their backwards took 4x longer at 80k ids.
        pooled = nn.functional.embedding_bag(
            self._ctx.reverse,
            unique_rows,
            torch.ops.fbgemm.asynchronous_complete_cumsum(lengths),
            mode="sum",
            per_sample_weights=None if scale is None else scale.to(unique_rows.dtype),
            include_last_offset=True,
        )
        return pooled.view(num_keys, stride, self._dim).transpose(0, 1).reshape(stride, -1)


class KVDedupBagOutputDist(BaseEmbeddingDist[KVDedupBagContext, torch.Tensor, torch.Tensor]):
    """Output dist of a deduplicated row-wise KV bag sharding: TorchRec's sequence
    all-to-all brings the unique ids' rows back, the bags pool here.

    Example::

        odist = KVDedupBagOutputDist(pg, num_features=2, mean=[False, True], dim=8)
        pooled = odist(rows_of_routed_ids, ctx).wait()   # [stride, 2 * 8]
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        num_features: int,
        mean: Sequence[bool],
        dim: int,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self._dist = RwSequenceEmbeddingDist(pg, num_features, device)
        self._mean = list(mean)
        self._dim = dim

    def forward(
        self, local_embs: torch.Tensor, sharding_ctx: KVDedupBagContext | None = None
    ) -> Awaitable[torch.Tensor]:
        if not isinstance(sharding_ctx, KVDedupBagContext):
            raise RuntimeError(
                "use_index_dedup: the deduplicated sharding's context is missing (its "
                "input dist ran outside ShardedKVEmbeddingBagCollection.input_dist)"
            )
        rows = self._dist(local_embs.view(-1, self._dim), sharding_ctx)
        return _PooledHere(rows, sharding_ctx, self._mean, self._dim)


class KVRwDedupPooledEmbeddingSharding(KVRwPooledEmbeddingSharding):
    """Row-wise KV bags with ``use_index_dedup`` (see the module docstring).

    Example::

        sharding = KVRwDedupPooledEmbeddingSharding(sharding_infos, env, device, specs=specs)
    """

    # Owners send rows, not sums: the sequence lookup; bags pool on their own rank.
    kv_lookup_class: ClassVar[type[BaseEmbeddingLookup]] = KVGroupedEmbeddingsLookup

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        tables = self.embedding_tables()
        dims = {t.name: t.local_cols for t in tables}
        if len(set(dims.values())) > 1:
            raise ValueError(
                f"use_index_dedup: the row-wise KV bag tables {sorted(dims)} of one "
                f"sharding must share one embedding_dim, got {dims}; give them one dim "
                "or drop use_index_dedup"
            )
        self._dedup_dim = next(iter(dims.values()), 0)

    def create_input_dist(self, device: torch.device | None = None) -> KVDedupBagFeaturesDist:
        tables = self.embedding_tables()
        num_buckets = [
            self._kv_specs.options[t.name].total_num_buckets
            for t in tables
            for _ in range(t.num_features())
        ]
        return KVDedupBagFeaturesDist(self._pg, num_buckets, table_labels(tables))

    def create_output_dist(self, device: torch.device | None = None) -> KVDedupBagOutputDist:
        tables = self.embedding_tables()
        mean = [t.pooling == PoolingType.MEAN for t in tables for _ in t.feature_names]
        return KVDedupBagOutputDist(
            self._pg, len(mean), mean, self._dedup_dim, device or self._device
        )
