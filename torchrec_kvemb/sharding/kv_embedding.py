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
from collections.abc import Iterator, Mapping, Sequence
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

from torchrec_kvemb.lookup import KVPooledLookup, pooled_forward
from torchrec_kvemb.optimizer import OPTIMIZER_KEYS, FusedOptimConfig
from torchrec_kvemb.options import KVTableOptions
from torchrec_kvemb.sharding.fused_optimizer import KVFusedOptimizer
from torchrec_kvemb.table import KVTable
from torchrec_kvemb.validation import check_ids


def optim_config(fused_params: Mapping[str, Any] | None) -> FusedOptimConfig:
    """The fused optimizer a grouped config's ``fused_params`` describe.

    Sharders and plan constraints add keys of their own (cache, bounds check,
    output dtype...) that do not change the update: only the optimizer's keys
    are read.
    """
    known = {k: v for k, v in (fused_params or {}).items() if k in OPTIMIZER_KEYS}
    return FusedOptimConfig.from_fused_params(known)


def shard_options(options: KVTableOptions, num_shards: int) -> KVTableOptions:
    """The options of one of ``num_shards`` equal shards of a table.

    ``capacity``, ``memory_budget_bytes`` and ``admission_counter_capacity`` are
    per table: each shard gets ``ceil(1 / num_shards)`` of them.
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
    )


@dataclass(frozen=True)
class KVTableSpecs:
    """How a sharded collection's KV kernels build their tables.

    ``options`` are whole-table options by table name; ``optims`` the optimizer
    of tables that bring their own (a ``KVEmbeddingBagCollection``'s), others
    take theirs from their grouped config's ``fused_params``.

    Example::

        specs = KVTableSpecs({"user": KVTableOptions(capacity=1 << 20)})
        table = specs.build(sharded_table_config, fused_params, device, num_shards=4)
    """

    options: Mapping[str, KVTableOptions]
    optims: Mapping[str, FusedOptimConfig] = field(default_factory=dict)

    def build(
        self,
        table: ShardedEmbeddingTable,
        fused_params: Mapping[str, Any] | None,
        device: torch.device | None,
        num_shards: int,
    ) -> KVTable:
        """This rank's shard of ``table``, one of ``num_shards`` (1 for table-wise)."""
        optim = self.optims.get(table.name) or optim_config(fused_params)
        options = shard_options(self.options[table.name], num_shards)
        return KVTable(table.name, table.local_cols, options, optim, device)


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

        kernel = KVEmbeddingBag(grouped_config, [KVTable("t", 8, KVTableOptions(capacity=64))])
        pooled = kernel(kjt)  # [kjt.stride(), 8 * features of "t"]
    """

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        tables: Sequence[KVTable],
        pool_by_sum: bool = False,
        group: dist.ProcessGroup | None = None,
        row_wise: bool = False,
    ) -> None:
        super().__init__()
        if [t.name for t in tables] != config.table_names():
            raise ValueError(
                f"KVEmbeddingBag: tables {[t.name for t in tables]} do not match the "
                f"grouped config's {config.table_names()}"
            )
        self._config = config
        self.tables = list(tables)
        self._mean = [
            c.pooling == PoolingType.MEAN and not pool_by_sum for c in config.embedding_tables
        ]
        self._splits = [c.num_features() for c in config.embedding_tables]
        # why: an empty tensor that requires grad ties the pooled output into autograd.
        self._anchor = torch.empty(0, requires_grad=True)
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
        if features.variable_stride_per_key():
            raise ValueError("KV tables: variable batch size per feature is not supported yet")
        stride = features.stride()
        pooled = []
        for table, mean, kjt in zip(self.tables, self._mean, features.split(self._splits)):
            ids = check_ids(table.name, kjt.values())
            offsets = kjt.offsets().to(torch.int64)
            weights = kjt.weights_or_none()
            if weights is not None:
                weights = weights.to(torch.float32)
            if self.training:
                slots = table.lookup_train(ids)
                out = KVPooledLookup.apply(
                    self._anchor, table, slots, ids, offsets, weights, mean, True
                )
            else:
                slots = table.lookup_eval(ids)
                out = pooled_forward(table, slots, ids, offsets, weights, mean, True)
            num_features = len(kjt.keys())
            # [features * stride, dim] (feature-major bags) -> [stride, features * dim]
            out = out.view(num_features, stride, table.dim).transpose(0, 1)
            pooled.append(out.reshape(stride, num_features * table.dim))
        if not pooled:
            return torch.empty(stride, 0, device=features.device())
        return torch.cat(pooled, dim=1)


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
        tables = [
            self._kv_specs.build(t, config.fused_params, device, self._kv_num_shards)
            for t in config.embedding_tables
        ]
        row_wise = sharding_type == ShardingType.ROW_WISE
        return KVEmbeddingBag(config, tables, pool_by_sum=row_wise, group=pg, row_wise=row_wise)

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
