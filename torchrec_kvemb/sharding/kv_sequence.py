"""The ``customized_kernel`` of sequence (unpooled) collections: KV tables inside
TorchRec's sharded ``EmbeddingCollection``.

``KVEmbedding`` is the sequence twin of
:class:`~torchrec_kvemb.sharding.kv_embedding.KVEmbeddingBag` (same tables, fused
optimizer and state; its forward gives one row per id, ``[ids, dim]``, as
FBGEMM's sequence TBE does). ``KVGroupedEmbeddingsLookup`` is TorchRec's grouped
sequence lookup, building a ``KVEmbedding`` for KV groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb.sequence_lookup import KVSequenceLookup
from torchrec_kvemb.sharding.fused_optimizer import KVFusedOptimizer
from torchrec_kvemb.sharding.kv_embedding import KVEmbeddingBag, KVTableSpecs
from torchrec_kvemb.table import KVTable


class KVEmbedding(KVEmbeddingBag):
    """This rank's KV tables of one grouped config of a sequence collection.

    ``forward(kjt) -> [ids, dim]``: one row per id in the KJT's value order.

    Example::

        lookup = KVTableSpecs({"t": KVTableOptions(capacity=64)}).sequence_lookup(
            grouped_config, device=None, num_shards=1)
        rows = KVEmbedding(grouped_config, lookup)(kjt)
    """

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        if features.variable_stride_per_key():
            raise ValueError("KV tables: variable batch size per feature is not supported yet")
        lookup: KVSequenceLookup = self._lookup
        return lookup.embeddings(features, self.training)


class KVGroupedEmbeddingsLookup(GroupedEmbeddingsLookup):
    """TorchRec's grouped sequence lookup, with ``KVEmbedding`` for KV groups.

    ``num_shards``: how many ranks share each table (world size for row-wise, 1
    for table-wise).

    Example::

        lookup = KVGroupedEmbeddingsLookup(specs, num_shards=2, grouped_configs=configs,
                                           pg=pg, sharding_type=ShardingType.ROW_WISE)
    """

    def __init__(
        self,
        specs: KVTableSpecs,
        num_shards: int,
        grouped_configs: list[GroupedEmbeddingConfig],
        pg: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        env: ShardingEnv | None = None,
        sharding_type: ShardingType | None = None,
    ) -> None:
        # Read by _create_embedding_kernel, which the base __init__ calls.
        self.__dict__["_kv_specs"] = specs
        self.__dict__["_kv_num_shards"] = num_shards
        self.__dict__["_kv_row_wise"] = sharding_type == ShardingType.ROW_WISE
        super().__init__(grouped_configs=grouped_configs, pg=pg, device=device, env=env)

    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        pg: dist.ProcessGroup | None,
        device: torch.device | None,
        env: ShardingEnv | None = None,
    ) -> BaseEmbedding:
        if config.compute_kernel != EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return super()._create_embedding_kernel(config, pg, device, env)
        lookup = self._kv_specs.sequence_lookup(config, device, self._kv_num_shards)
        return KVEmbedding(config, lookup, group=pg, row_wise=self._kv_row_wise)

    def _kv_kernels(self) -> list[KVEmbedding]:
        return [m for m in self._emb_modules if isinstance(m, KVEmbedding)]

    def kv_tables(self) -> dict[str, KVTable]:
        """This rank's KV table shards, by table name."""
        return {t.name: t for module in self._kv_kernels() for t in module.tables}

    def kv_fused_optimizers(self) -> dict[str, KVFusedOptimizer]:
        """The fused optimizer driving each of this rank's KV table shards."""
        return {t.name: m.fused_optimizer for m in self._kv_kernels() for t in m.tables}
