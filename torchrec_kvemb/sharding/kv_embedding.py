"""The ``customized_kernel`` compute kernel: KV tables inside TorchRec's sharded lookups.

``KVEmbeddingBag`` plays the part fbgemm's TBE plays for stock tables: one
module per grouped config of a sharding, holding this rank's shard of each of
its tables as a :class:`~torchrec_kvemb.table.KVTable`, with the optimizer fused
into backward. ``KVFusedOptimizer`` is what TorchRec's ``fused_optimizer`` sees
of it (its ``lr`` drives the update). ``KVGroupedPooledEmbeddingsLookup`` is the
stock grouped lookup that builds a ``KVEmbeddingBag`` for KV groups.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import (
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
    ShardedEmbeddingTable,
)
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb.bag_lookup import BagTable, KVBagLookup
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import KVTableOptions, with_config_init
from torchrec_kvemb.sequence_lookup import KVSequenceLookup
from torchrec_kvemb.sharding.cw_columns import column_offset, column_shard_options
from torchrec_kvemb.sharding.fused_optimizer import KVFusedOptimizer
from torchrec_kvemb.table import KVTable


def optim_config(
    fused_params: Mapping[str, Any] | None, table: str | None = None
) -> FusedOptimConfig:
    """The fused optimizer a grouped config's ``fused_params`` describe for ``table``.

    They hold the sharder's ``fused_params``, the table's plan's (cache, bounds
    check, output dtype...) and the kwargs of the optimizer
    ``apply_optimizer_in_backward`` gave its weight (TorchRec merges them all):
    every key is read by ``FusedOptimConfig.from_fused_params``, which refuses, naming
    the key and the table, what a KV table cannot run as FBGEMM's TBE would.
    """
    return FusedOptimConfig.from_fused_params(fused_params, table)


def shard_options(options: KVTableOptions, num_shards: int) -> KVTableOptions:
    """The options of one of ``num_shards`` equal shards of a table.

    ``capacity``, ``memory_budget_bytes``, ``admission_counter_capacity``,
    ``initial_capacity`` and the lower tiers' capacities and budgets are per
    table: each shard gets ``ceil(1 / num_shards)`` of them.
    """
    if num_shards == 1:
        return options

    def part(value: int | None) -> int | None:
        return None if value is None else math.ceil(value / num_shards)

    return replace(
        options,
        capacity=part(options.capacity),
        memory_budget_bytes=part(options.memory_budget_bytes),
        admission_counter_capacity=part(options.admission_counter_capacity),
        initial_capacity=part(options.initial_capacity),
        ssd=None
        if options.ssd is None
        else replace(options.ssd, capacity=part(options.ssd.capacity)),
        host_tier=None
        if options.host_tier is None
        else replace(
            options.host_tier,
            capacity=part(options.host_tier.capacity),
            memory_budget_bytes=part(options.host_tier.memory_budget_bytes),
        ),
    )


@dataclass(frozen=True)
class KVTableSpecs:
    """How a sharded collection's KV kernels build their tables.

    ``options`` are whole-table options by table name; ``optims`` the optimizer
    of tables that bring their own (a ``KVEmbeddingBagCollection``'s), others
    take theirs from their grouped config's ``fused_params``.

    Example::

        specs = KVTableSpecs({"user": KVTableOptions(capacity=1 << 20)})
        lookup = specs.bag_lookup(grouped_config, device, num_shards=4, pool_by_sum=True)
    """

    options: Mapping[str, KVTableOptions]
    optims: Mapping[str, FusedOptimConfig] = field(default_factory=dict)

    def table_options(
        self,
        table: ShardedEmbeddingTable,
        num_shards: int,
        optim: FusedOptimConfig | None = None,
    ) -> KVTableOptions:
        """A table's options on this rank: one of ``num_shards`` equal shards, its
        initial rows drawn as TorchRec's sharded table would (its config's range); a
        column shard draws its columns of them (``optim``: the table's optimizer)."""
        options = with_config_init(self.options[table.name], table)
        if table.local_cols != table.embedding_dim:
            options = column_shard_options(
                options, table.name, table.embedding_dim, column_offset(table), optim
            )
        return shard_options(options, num_shards)

    def table_optim(
        self, config: GroupedEmbeddingConfig, table: ShardedEmbeddingTable
    ) -> FusedOptimConfig:
        """The fused optimizer of one of a grouped config's tables."""
        return self.optims.get(table.name) or optim_config(config.fused_params, table.name)

    def bag_lookup(
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | None,
        num_shards: int,
        pool_by_sum: bool,
    ) -> KVBagLookup:
        """This rank's shards (one of ``num_shards`` each; 1 for table-wise) of the
        grouped config's tables, grouped. ``pool_by_sum``: MEAN tables pool by sum (their
        ``1 / bag length`` comes as per-sample weights)."""
        tables: list[ShardedEmbeddingTable] = config.embedding_tables
        return KVBagLookup(
            [
                BagTable(
                    t.name,
                    t.local_cols,
                    tuple(t.feature_names),
                    t.pooling == PoolingType.MEAN and not pool_by_sum,
                )
                for t in tables
            ],
            {
                t.name: self.table_options(t, num_shards, self.table_optim(config, t))
                for t in tables
            },
            {t.name: self.table_optim(config, t) for t in tables},
            device,
            weights="if_present",
        )

    def sequence_lookup(
        self, config: GroupedEmbeddingConfig, device: torch.device | None, num_shards: int
    ) -> KVSequenceLookup:
        """This rank's shards of a sequence collection's grouped config, grouped."""
        tables: list[ShardedEmbeddingTable] = config.embedding_tables
        return KVSequenceLookup(
            [BagTable(t.name, t.local_cols, tuple(t.feature_names)) for t in tables],
            {
                t.name: self.table_options(t, num_shards, self.table_optim(config, t))
                for t in tables
            },
            {t.name: self.table_optim(config, t) for t in tables},
            device,
        )


class KVEmbeddingBag(BaseEmbedding, FusedOptimizerModule):
    """This rank's KV tables of one grouped config: the ``customized_kernel`` module.

    ``forward(kjt) -> [stride, sum of feature dims]``, features in the group's
    order, like a TBE's output. Training forward stores new ids (admission and
    eviction apply) and backward applies the fused optimizer; eval forward is
    read-only and pools missing ids as zeros, as in ``KVEmbeddingBagCollection``.

    ``pool_by_sum``: row-wise sharding sends MEAN pooling's ``1 / bag length``
    with each id as its per-sample weight (a bag is split over ranks), so every
    table pools by weighted sum here. ``group`` / ``row_wise``: how the tables are
    sharded, for the fused optimizer's state_dict (None: plain tensors).

    The module has no parameters or buffers: DDP and ``state_dict`` see nothing.

    Example::

        lookup = KVTableSpecs({"t": KVTableOptions(capacity=64)}).bag_lookup(
            grouped_config, device=None, num_shards=1, pool_by_sum=False)
        kernel = KVEmbeddingBag(grouped_config, lookup)
        pooled = kernel(kjt)  # [kjt.stride(), 8 * features of "t"]
    """

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        lookup: KVBagLookup,
        group: dist.ProcessGroup | None = None,
        row_wise: bool = False,
    ) -> None:
        super().__init__()
        names = list(lookup.tables())
        if names != config.table_names():
            raise ValueError(
                f"KVEmbeddingBag: tables {names} do not match the grouped config's "
                f"{config.table_names()}"
            )
        self._config = config
        self._lookup = lookup
        self.tables = list(lookup.tables().values())
        self._optim = KVFusedOptimizer(self.tables, group, row_wise)

    @property
    def config(self) -> GroupedEmbeddingConfig:
        return self._config

    @property
    def fused_optimizer(self) -> KVFusedOptimizer:
        return self._optim

    def named_parameters_by_table(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Nothing: KV rows are not parameters (TorchRec registers none for them)."""
        return iter(())

    def flush(self) -> None:
        """Nothing to write back (called before ``state_dict``)."""

    def purge(self) -> None:
        """Nothing cached (called after ``load_state_dict``)."""

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """``[stride, sum of feature dims]``; with a batch size per feature and source
        rank (VBE), TorchRec's flat VBE layout (rank, feature, sample, column), as a
        TBE gives for ``batch_size_per_feature_per_rank``."""
        return self._lookup.pooled(features, self.training, variable_batch=True)


class KVGroupedPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """TorchRec's grouped pooled lookup, with ``KVEmbeddingBag`` for KV groups.

    ``num_shards``: how many ranks share each table (world size for row-wise,
    1 for table-wise); every table of the lookup is built from ``specs``.

    Example::

        lookup = KVGroupedPooledEmbeddingsLookup(specs, num_shards=1,
                                                 grouped_configs=configs, pg=pg, device=device,
                                                 sharding_type=ShardingType.TABLE_WISE)
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
    ) -> None:
        # Read by _create_embedding_kernel, which the base __init__ calls.
        self.__dict__["_kv_specs"] = specs
        self.__dict__["_kv_num_shards"] = num_shards
        super().__init__(
            grouped_configs=grouped_configs,
            device=device,
            pg=pg,
            sharding_type=sharding_type,
            env=env,
        )

    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | None,
        pg: dist.ProcessGroup | None,
        sharding_type: ShardingType | None,
        env: ShardingEnv | None,
    ) -> BaseEmbedding:
        if config.compute_kernel != EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return super()._create_embedding_kernel(config, device, pg, sharding_type, env)
        row_wise = sharding_type == ShardingType.ROW_WISE
        lookup = self._kv_specs.bag_lookup(config, device, self._kv_num_shards, row_wise)
        return KVEmbeddingBag(config, lookup, group=pg, row_wise=row_wise)

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        """The stock lookup; with VBE and several KV kernels, their flat outputs are
        merged rank-major (TorchRec's layout for several TBEs), since KV kernels
        make their own output rather than write into a preallocated one."""
        if sparse_features.variable_stride_per_key() and len(self._emb_modules) > 1:
            features_by_group = sparse_features.split(self._feature_splits)
            embeddings = self._forward(features_by_group)
            return self._merge_variable_batch_embeddings(
                embeddings, self._vbe_splits(features_by_group)
            )
        return super().forward(sparse_features)

    def kv_tables(self) -> dict[str, KVTable]:
        """This rank's KV table shards, by table name."""
        return {
            t.name: t
            for module in self._emb_modules
            if isinstance(module, KVEmbeddingBag)
            for t in module.tables
        }

    def kv_fused_optimizers(self) -> dict[str, KVFusedOptimizer]:
        """The fused optimizer driving each of this rank's KV table shards, by table
        name (the tables of one grouped config share one, and its ``lr``)."""
        return {
            t.name: module.fused_optimizer
            for module in self._emb_modules
            if isinstance(module, KVEmbeddingBag)
            for t in module.tables
        }
