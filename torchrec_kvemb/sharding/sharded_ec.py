"""The sharded sequence collection: TorchRec's ``ShardedEmbeddingCollection`` with KV tables.

Everything a stock sharded ``EmbeddingCollection`` does stays (input dists, the
sequence all-to-all of rows back to each id's place, ``JaggedTensor`` outputs,
the combined ``fused_optimizer``); tables whose plan says ``customized_kernel``
get a KV sequence sharding (:mod:`.sequence_shardings`) and are looked up by
:class:`~torchrec_kvemb.sharding.kv_sequence.KVEmbedding`. Tables without KV
options stay stock.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
)
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection

from torchrec_kvemb.ec import KVEmbeddingCollection
from torchrec_kvemb.sharding.fused_optimizer import KVFusedOptimizer
from torchrec_kvemb.sharding.kv_embedding import KVTableSpecs
from torchrec_kvemb.sharding.kv_sequence import KVGroupedEmbeddingsLookup, kv_lookups
from torchrec_kvemb.sharding.planner import KV_COMPUTE_KERNEL
from torchrec_kvemb.sharding.sequence_shardings import KV_SEQUENCE_SHARDINGS
from torchrec_kvemb.state_dict.hooks import register_sharded_hooks
from torchrec_kvemb.state_dict.layout import TableLayout, sharded_layouts
from torchrec_kvemb.table import KVTable

#: Prefix of the ``sharding_type_to_sharding_infos`` keys of KV groups (labels only:
#: separate keys give KV tables their own input dist).
KV_GROUP_PREFIX = "kv:"


def check_sequence_plan(
    kv_tables: Mapping[str, Any],
    configs: list[EmbeddingConfig],
    plan: Mapping[str, ParameterSharding],
) -> None:
    """Every KV table planned ``customized_kernel`` with a KV sharding type, and no other."""
    for config in configs:
        name = config.name
        if name not in plan:
            raise ValueError(f"table {name!r}: the sharding plan has no entry for it")
        sharding = plan[name]
        is_kv = name in kv_tables
        if is_kv and sharding.compute_kernel != KV_COMPUTE_KERNEL:
            raise ValueError(
                f"table {name!r} has KVTableOptions but the plan gives it compute kernel "
                f"{sharding.compute_kernel!r}; KV tables need {KV_COMPUTE_KERNEL!r}"
            )
        if is_kv and sharding.sharding_type not in KV_SEQUENCE_SHARDINGS:
            raise ValueError(
                f"table {name!r}: KV tables shard {' or '.join(KV_SEQUENCE_SHARDINGS)}, "
                f"the plan says {sharding.sharding_type}"
            )
        if not is_kv and sharding.compute_kernel == KV_COMPUTE_KERNEL:
            raise ValueError(
                f"table {name!r}: the plan gives it {KV_COMPUTE_KERNEL!r} but the sharder "
                "has no KVTableOptions for it"
            )


class _KVSequenceCollectionView:
    """What ``ShardedEmbeddingCollection.__init__`` reads of the module it shards, for
    a ``KVEmbeddingCollection``: its configs and 0-row ``meta`` placeholders where a
    stock module has weights."""

    device = torch.device("meta")

    def __init__(self, module: KVEmbeddingCollection) -> None:
        self._module = module
        self._params = {
            f"embeddings.{c.name}.weight": nn.Parameter(
                torch.empty(0, c.embedding_dim, device="meta"), requires_grad=False
            )
            for c in module.embedding_configs()
        }

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._module.embedding_configs()

    def embedding_names_by_table(self) -> list[list[str]]:
        return self._module.embedding_names_by_table()

    def embedding_dim(self) -> int:
        return self._module.embedding_dim()

    def need_indices(self) -> bool:
        return self._module.need_indices()

    def use_gather_select(self) -> bool:
        return False

    def use_gather_select_per_sharding(self) -> None:
        return None

    def use_sorted_select(self) -> bool:
        return False

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self._params.items())

    def state_dict(self) -> dict[str, nn.Parameter]:
        return dict(self._params)


class ShardedKVEmbeddingCollection(ShardedEmbeddingCollection):
    """A sharded ``EmbeddingCollection`` (or ``KVEmbeddingCollection``) whose KV tables
    are sharded row-wise or table-wise over ``KVTable`` shards.

    Built by :class:`~torchrec_kvemb.KVEmbeddingCollectionSharder`; forward and
    ``fused_optimizer`` are TorchRec's. ``kv_tables()`` gives this rank's shards,
    ``metrics()`` their counters. ``state_dict()`` holds the KV tables' rows as
    ShardedTensors under ``embeddings.<table>.`` (a collective).

    Example::

        model = DistributedModelParallel(model, device=torch.device("cpu"),
                                         sharders=[KVEmbeddingCollectionSharder(options)])
        model.module.ec.kv_tables()["items"].size   # ids stored on this rank
    """

    def __init__(
        self,
        module: EmbeddingCollection | KVEmbeddingCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        specs: KVTableSpecs,
        fused_params: dict[str, Any] | None = None,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        module_fqn: str | None = None,
    ) -> None:
        check_sequence_plan(
            specs.options, module.embedding_configs(), table_name_to_parameter_sharding
        )
        # Read by create_grouped_sharding_infos / create_embedding_sharding, which the
        # base __init__ calls.
        self.__dict__["_kv_specs"] = specs
        if isinstance(module, KVEmbeddingCollection):
            module = _KVSequenceCollectionView(module)
        super().__init__(
            module,
            table_name_to_parameter_sharding,
            env,
            fused_params=fused_params,
            device=device,
            qcomm_codecs_registry=qcomm_codecs_registry,
            module_fqn=module_fqn,
        )

    # ------------------------------------------------------------- public
    def kv_tables(self) -> dict[str, KVTable]:
        """This rank's KV table shards by table name (tables with no shard here are absent)."""
        tables: dict[str, KVTable] = {}
        for lookup in kv_lookups(self._lookups, KVGroupedEmbeddingsLookup):
            tables.update(lookup.kv_tables())
        return tables

    def kv_fused_optimizers(self) -> dict[str, KVFusedOptimizer]:
        """The ``KVFusedOptimizer`` whose ``lr`` drives each of this rank's KV shards."""
        optimizers: dict[str, KVFusedOptimizer] = {}
        for lookup in kv_lookups(self._lookups, KVGroupedEmbeddingsLookup):
            optimizers.update(lookup.kv_fused_optimizers())
        return optimizers

    def kv_layouts(self) -> list[TableLayout]:
        """Every KV table as this rank sees it (state_dict and checkpoints)."""
        return sharded_layouts(
            self._embedding_configs,
            self._kv_specs.options,
            {name: p.sharding_type for name, p in self.module_sharding_plan.items()},
            self.kv_tables(),
            self.kv_fused_optimizers(),
            self._env.rank,
            self._env.world_size,
        )

    def metrics(self) -> dict[str, dict[str, float]]:
        """``KVTable.metrics()`` of this rank's shards, by table name."""
        return {name: table.metrics() for name, table in self.kv_tables().items()}

    # ------------------------------------------------- base class hooks
    def create_grouped_sharding_infos(
        self,
        module: Any,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        fused_params: dict[str, Any] | None,
    ) -> dict[str, list[EmbeddingShardingInfo]]:
        """The stock grouping, with KV tables under their own keys, KV first."""
        infos = super().create_grouped_sharding_infos(
            module, table_name_to_parameter_sharding, fused_params
        )
        kv: dict[str, list[EmbeddingShardingInfo]] = {}
        stock: dict[str, list[EmbeddingShardingInfo]] = {}
        for sharding_type, group in infos.items():
            kv_infos = [i for i in group if i.param_sharding.compute_kernel == KV_COMPUTE_KERNEL]
            stock_infos = [i for i in group if i.param_sharding.compute_kernel != KV_COMPUTE_KERNEL]
            if kv_infos:
                kv[KV_GROUP_PREFIX + sharding_type] = kv_infos
            if stock_infos:
                stock[sharding_type] = stock_infos
        return {**kv, **stock}

    def create_embedding_sharding(
        self,
        sharding_type: str,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    ) -> EmbeddingSharding:
        """A KV sequence sharding for KV groups, the stock one otherwise."""
        if not sharding_type.startswith(KV_GROUP_PREFIX):
            return super().create_embedding_sharding(
                sharding_type, sharding_infos, env, device, qcomm_codecs_registry
            )
        sharding_cls = KV_SEQUENCE_SHARDINGS[sharding_type[len(KV_GROUP_PREFIX) :]]
        return sharding_cls(
            sharding_infos,
            env,
            device,
            qcomm_codecs_registry=qcomm_codecs_registry,
            specs=self._kv_specs,
        )

    def reset_parameters(self) -> None:
        """The stock initialization for stock tables; KV rows are born from (id, seed)."""
        configs = self._embedding_configs
        self._embedding_configs = [c for c in configs if c.name not in self._kv_specs.options]
        try:
            super().reset_parameters()
        finally:
            self._embedding_configs = configs

    def _initialize_torch_state(self, skip_registering: bool = False) -> None:
        """The stock state_dict entries, plus the KV tables' (docs/checkpoint-format.md)."""
        super()._initialize_torch_state(skip_registering)
        if not skip_registering:
            register_sharded_hooks(self, self._env.process_group, attribute="embeddings")

    def update_shards(
        self,
        changed_sharding_params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None,
    ) -> None:
        raise NotImplementedError(
            "resharding a collection with KV tables in place is not supported yet; save a "
            "checkpoint (torchrec_kvemb.checkpoint.save) and load it into the new sharding"
        )
