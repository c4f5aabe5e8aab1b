"""The drop-in sharders for ``DistributedModelParallel``.

Hand them to DMP (and to the planner) in place of TorchRec's
``EmbeddingBagCollectionSharder`` / ``EmbeddingCollectionSharder``. Tables they
have ``KVTableOptions`` for become KV tables (compute kernel
``customized_kernel``, sharded row-wise, table-wise, column-wise or
table-row-wise); the others are sharded exactly as the stock sharder would.
Planning answers per table
(:mod:`.sharder_base`).
"""

from __future__ import annotations

import torch
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingEnv
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from torchrec_kvemb.ebc import KVEmbeddingBagCollection
from torchrec_kvemb.ec import KVEmbeddingCollection
from torchrec_kvemb.sharding.sequence_shardings import KV_SEQUENCE_SHARDINGS
from torchrec_kvemb.sharding.sharded_ebc import ShardedKVEmbeddingBagCollection
from torchrec_kvemb.sharding.sharded_ec import ShardedKVEmbeddingCollection
from torchrec_kvemb.sharding.sharder_base import KVSharderBase


class KVEmbeddingBagCollectionSharder(KVSharderBase, EmbeddingBagCollectionSharder):
    """Shards an ``EmbeddingBagCollection`` whose tables named in ``table_options`` are
    KV tables (row-wise, table-wise, column-wise or table-row-wise); the other
    tables stay stock.

    * ``table_options``: ``KVTableOptions`` by table name. ``capacity`` /
      ``memory_budget_bytes`` are per table: a row-wise shard gets ``1 / W`` of
      them, a table-row-wise one ``1 / L`` (L ranks per node), a table-wise one all.
    * ``fused_params``: TorchRec's ``fused_params`` (optimizer, learning_rate,
      ...), for KV and stock tables alike.
    * ``module_type``: ``EmbeddingBagCollection`` (default, or None; build it on
      ``torch.device("meta")`` so that KV tables allocate nothing) or
      ``KVEmbeddingBagCollection``, whose options and optimizer then come from the
      module itself (``table_options`` may be omitted). DMP picks a sharder by
      exact module type: pass one sharder per type.

    Example::

        ebc = EmbeddingBagCollection(tables, device=torch.device("meta"))
        sharder = KVEmbeddingBagCollectionSharder(
            {"user": KVTableOptions(capacity=10_000_000)},
            fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05},
        )
        model = DistributedModelParallel(Model(ebc), device=torch.device("cpu"),
                                         sharders=[sharder])
    """

    stock_module = EmbeddingBagCollection
    kv_module = KVEmbeddingBagCollection
    configs_method = "embedding_bag_configs"

    @property
    def sharded_module_type(self) -> type[ShardedKVEmbeddingBagCollection]:
        return ShardedKVEmbeddingBagCollection


class KVEmbeddingCollectionSharder(KVSharderBase, EmbeddingCollectionSharder):
    """Shards an ``EmbeddingCollection`` (sequence embeddings: one row per id) whose
    tables named in ``table_options`` are KV tables (row-wise, table-wise,
    column-wise or table-row-wise); the other tables stay stock. Arguments as for
    :class:`KVEmbeddingBagCollectionSharder`; ``module_type`` is
    ``EmbeddingCollection`` (default) or ``KVEmbeddingCollection``.

    Example::

        ec = EmbeddingCollection(tables, device=torch.device("meta"))
        sharder = KVEmbeddingCollectionSharder(
            {"items": KVTableOptions(capacity=10_000_000)},
            fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05},
        )
        model = DistributedModelParallel(Model(ec), device=torch.device("cpu"),
                                         sharders=[sharder])
    """

    stock_module = EmbeddingCollection
    kv_module = KVEmbeddingCollection
    kv_sharding_types = list(KV_SEQUENCE_SHARDINGS)
    configs_method = "embedding_configs"

    @property
    def sharded_module_type(self) -> type[ShardedKVEmbeddingCollection]:
        return ShardedKVEmbeddingCollection

    def reshard(
        self,
        sharded_module: ShardedKVEmbeddingCollection,
        changed_shard_to_params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
    ) -> ShardedKVEmbeddingCollection:
        """What ``DistributedModelParallel.reshard`` calls (TorchRec's bag sharder has
        it, its sequence sharder not): ``sharded_module.update_shards`` in place."""
        if changed_shard_to_params:
            sharded_module.update_shards(changed_shard_to_params, env, device)
        return sharded_module
