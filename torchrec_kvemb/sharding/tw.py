"""Table-wise sharding of KV tables: each table lives whole on one rank.

TorchRec's table-wise sharding as is (ids travel to the table's rank by
all-to-all, pooled rows come back the same way); only the lookup differs: the
table is a :class:`~torchrec_kvemb.table.KVTable` with its full capacity.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrec.distributed.embedding_lookup import BaseEmbeddingLookup
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import BaseGroupedFeatureProcessor
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.types import QuantizedCommCodecs, ShardingEnv, ShardingType

from torchrec_kvemb.sharding.kv_embedding import KVGroupedPooledEmbeddingsLookup, KVTableSpecs


class KVTwPooledEmbeddingSharding(TwPooledEmbeddingSharding):
    """TorchRec's table-wise pooled sharding with KV lookups.

    Example::

        sharding = KVTwPooledEmbeddingSharding(sharding_infos, env, device, specs=specs)
    """

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
            num_shards=1,
            grouped_configs=self._grouped_embedding_configs,
            pg=self._pg,
            device=device if device is not None else self._device,
            sharding_type=ShardingType.TABLE_WISE,
            env=self._env,
        )
