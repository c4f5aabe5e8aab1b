"""What every KV sharding shares: its constructor and ``create_lookup``, for row-wise
and table-wise, pooled (bags) and sequence shardings alike.

TorchRec's shardings build their lookup in ``create_lookup``; a KV sharding
builds its ``kv_lookup_class`` instead (a grouped pooled or sequence lookup),
whose KV tables hold ``1 / num_shards`` of their capacity: the world size
row-wise (one shard of every table per rank), 1 table-wise (the whole table on
one rank).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_lookup import BaseEmbeddingLookup
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import BaseGroupedFeatureProcessor, GroupedEmbeddingConfig
from torchrec.distributed.types import QuantizedCommCodecs, ShardingEnv, ShardingType

from torchrec_kvemb.sharding.kv_embedding import KVGroupedPooledEmbeddingsLookup, KVTableSpecs


def check_num_buckets(table: str, num_buckets: int, world_size: int) -> None:
    """Row-wise needs ``world_size`` to divide the table's ``total_num_buckets``."""
    if num_buckets % world_size != 0:
        raise ValueError(
            f"table {table!r}: row-wise sharding over {world_size} ranks needs "
            f"KVTableOptions.total_num_buckets to be a multiple of {world_size}, "
            f"got {num_buckets}"
        )


class KVLookupMixin:
    """The constructor and ``create_lookup`` of a TorchRec sharding whose tables are
    KV tables.

    Mixed in before the TorchRec sharding class, which provides ``_pg``,
    ``_device``, ``_env`` and ``_grouped_embedding_configs``; the sharding names
    its ``kv_sharding_type`` (and ``kv_lookup_class``, the pooled lookup by
    default). It is built as TorchRec's, plus ``specs`` (the KV tables'
    options); row-wise, every table's routing buckets must split evenly over
    the ranks.

    Example::

        class KVTwPooledEmbeddingSharding(KVLookupMixin, TwPooledEmbeddingSharding):
            kv_sharding_type = ShardingType.TABLE_WISE

        sharding = KVTwPooledEmbeddingSharding(sharding_infos, env, device, specs=specs)
    """

    kv_sharding_type: ClassVar[ShardingType]
    kv_lookup_class: ClassVar[type[BaseEmbeddingLookup]] = KVGroupedPooledEmbeddingsLookup
    _kv_specs: KVTableSpecs
    _pg: dist.ProcessGroup
    _device: torch.device | None
    _env: ShardingEnv
    _grouped_embedding_configs: list[GroupedEmbeddingConfig]

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
        if self.kv_sharding_type == ShardingType.ROW_WISE:
            for info in sharding_infos:
                name = info.embedding_config.name
                check_num_buckets(name, specs.options[name].total_num_buckets, self._pg.size())

    def kv_num_shards(self) -> int:
        """How many ranks share each table: the world size row-wise, 1 table-wise."""
        if self.kv_sharding_type == ShardingType.ROW_WISE:
            return self._pg.size()
        if self.kv_sharding_type == ShardingType.TABLE_WISE:
            return 1
        raise ValueError(f"KV tables: no lookup for sharding type {self.kv_sharding_type}")

    def create_lookup(
        self,
        device: torch.device | None = None,
        fused_params: dict[str, Any] | None = None,
        feature_processor: BaseGroupedFeatureProcessor | None = None,
    ) -> BaseEmbeddingLookup:
        if feature_processor is not None:
            raise ValueError("KV tables: feature processors are not supported yet")
        return self.kv_lookup_class(
            self._kv_specs,
            num_shards=self.kv_num_shards(),
            grouped_configs=self._grouped_embedding_configs,
            pg=self._pg,
            device=device if device is not None else self._device,
            sharding_type=self.kv_sharding_type,
            env=self._env,
        )
