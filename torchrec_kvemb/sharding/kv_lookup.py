"""The lookup of a KV sharding: ``create_lookup`` shared by row-wise and table-wise.

TorchRec's pooled shardings build their lookup in ``create_lookup``; a KV
sharding builds a :class:`KVGroupedPooledEmbeddingsLookup` instead, whose KV
tables hold ``1 / num_shards`` of their capacity: the world size row-wise (one
shard of every table per rank), 1 table-wise (the whole table on one rank).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_lookup import BaseEmbeddingLookup
from torchrec.distributed.embedding_types import BaseGroupedFeatureProcessor, GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingEnv, ShardingType

from torchrec_kvemb.sharding.kv_embedding import KVGroupedPooledEmbeddingsLookup, KVTableSpecs


class KVLookupMixin:
    """``create_lookup`` for a TorchRec pooled sharding whose tables are KV tables.

    Mixed in before the TorchRec sharding class, which provides ``_pg``,
    ``_device``, ``_env`` and ``_grouped_embedding_configs``; the sharding sets
    ``_kv_specs`` and names its ``kv_sharding_type``.

    Example::

        class KVTwPooledEmbeddingSharding(KVLookupMixin, TwPooledEmbeddingSharding):
            kv_sharding_type = ShardingType.TABLE_WISE
    """

    kv_sharding_type: ClassVar[ShardingType]
    _kv_specs: KVTableSpecs
    _pg: dist.ProcessGroup
    _device: torch.device | None
    _env: ShardingEnv
    _grouped_embedding_configs: list[GroupedEmbeddingConfig]

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
        return KVGroupedPooledEmbeddingsLookup(
            self._kv_specs,
            num_shards=self.kv_num_shards(),
            grouped_configs=self._grouped_embedding_configs,
            pg=self._pg,
            device=device if device is not None else self._device,
            sharding_type=self.kv_sharding_type,
            env=self._env,
        )
