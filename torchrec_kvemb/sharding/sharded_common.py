"""What the two sharded KV collections (bags and sequences) share on top of TorchRec's
sharded modules: this rank's KV tables, their optimizers, layouts and metrics,
the grouping that gives KV tables their own shardings, and the stock hooks
they adjust.

Example::

    class ShardedKVEmbeddingCollection(KVShardedMixin, ShardedEmbeddingCollection):
        kv_lookup_type = KVGroupedEmbeddingsLookup
        kv_configs_attribute = "_embedding_configs"
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingEnv2D,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb.sharding.fused_optimizer import KVFusedOptimizer
from torchrec_kvemb.sharding.index_dedup import dedup_features, table_labels
from torchrec_kvemb.sharding.kv_embedding import KVTableSpecs
from torchrec_kvemb.sharding.planner import KV_COMPUTE_KERNEL
from torchrec_kvemb.state_dict.layout import TableLayout, sharded_layouts
from torchrec_kvemb.table import KVTable

#: Prefix of the ``sharding_type_to_sharding_infos`` keys of KV groups. The keys
#: are labels only; separate keys give KV tables their own input dist.
KV_GROUP_PREFIX = "kv:"


def sharding_group(env: ShardingEnv) -> Any:
    """The process group a sharded collection's shards span: ``sharding_pg`` under
    ``ShardingEnv2D`` (whose ``process_group`` is the global group), else the env's."""
    return env.sharding_pg if isinstance(env, ShardingEnv2D) else env.process_group


def kv_groups_first(
    infos: dict[str, list[EmbeddingShardingInfo]],
) -> dict[str, list[EmbeddingShardingInfo]]:
    """TorchRec's sharding infos by sharding type, with KV tables under their own keys
    (``"kv:" + type``), KV first (so that ``fused_optimizer.param_groups[0]`` is a KV
    group on ranks that hold one)."""
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


class KVModuleView:
    """What TorchRec's sharded collection reads of the module it shards, for a KV
    collection: 0-row ``meta`` placeholders (under ``<attribute>.<table>.weight``)
    where a stock module has weights (a KV table may have ``2**63 - 1`` rows, which
    no tensor can hold). Subclasses add the module's config accessors.

    Example::

        view = KVModuleView(kv_ebc, "embedding_bags", kv_ebc.embedding_bag_configs())
        dict(view.named_parameters())   # {"embedding_bags.user.weight": <meta [0, 8]>}
    """

    device = torch.device("meta")

    def __init__(self, module: nn.Module, attribute: str, configs: list[Any]) -> None:
        self._module = module
        self._params = {
            f"{attribute}.{c.name}.weight": nn.Parameter(
                torch.empty(0, c.embedding_dim, device="meta"), requires_grad=False
            )
            for c in configs
        }

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self._params.items())

    def state_dict(self) -> dict[str, nn.Parameter]:
        return dict(self._params)


class KVShardedMixin:
    """Mixed in before TorchRec's sharded collection (which provides ``_lookups``,
    ``_env`` and ``module_sharding_plan``); the subclass names the lookup type that
    holds KV tables and the attribute of its table configs, and checks a plan in
    ``kv_module_to_shard``. It is built as TorchRec's sharded collection, plus
    ``specs`` (the KV tables' options).
    """

    kv_lookup_type: ClassVar[type]
    kv_configs_attribute: ClassVar[str]
    _kv_specs: KVTableSpecs
    _lookups: list[nn.Module]
    _env: ShardingEnv
    module_sharding_plan: EmbeddingModuleShardingPlan

    def __init__(
        self,
        module: nn.Module,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        specs: KVTableSpecs,
        fused_params: dict[str, Any] | None = None,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        module_fqn: str | None = None,
        use_index_dedup: bool = False,
    ) -> None:
        module = self.kv_module_to_shard(module, specs, table_name_to_parameter_sharding)
        # Read by the sharding factories, which the TorchRec base __init__ calls.
        self.__dict__["_kv_specs"] = specs
        self.__dict__["_use_index_dedup"] = use_index_dedup
        #: The sharder's fused params: a reshard groups tables again from them.
        self.__dict__["_kv_fused_params"] = fused_params
        super().__init__(  # type: ignore[call-arg]
            module,
            table_name_to_parameter_sharding,
            env,
            fused_params=fused_params,
            device=device,
            qcomm_codecs_registry=qcomm_codecs_registry,
            module_fqn=module_fqn,
        )
        #: Send each id once per table per batch (read by the input dist).
        self._use_index_dedup = use_index_dedup

    def kv_module_to_shard(
        self, module: nn.Module, specs: KVTableSpecs, plan: dict[str, ParameterSharding]
    ) -> nn.Module:
        """Check ``plan`` against the module's tables and ``specs``; the module the
        TorchRec base shards (a KV module's configuration seen as a stock one's)."""
        return module

    # ------------------------------------------------------------- public
    def kv_tables(self) -> dict[str, KVTable]:
        """This rank's KV table shards by table name (tables with no shard here are absent)."""
        tables: dict[str, KVTable] = {}
        for lookup in self._kv_lookups():
            tables.update(lookup.kv_tables())
        return tables

    @property
    def replica_group(self) -> Any:
        """The group of this collection's replicas under ``ShardingEnv2D``
        (``replica_pg``), else None."""
        return self._env.replica_pg if isinstance(self._env, ShardingEnv2D) else None

    def kv_fused_optimizers(self) -> dict[str, KVFusedOptimizer]:
        """The ``KVFusedOptimizer`` (part of ``fused_optimizer``) whose ``lr`` drives each
        of this rank's KV table shards, by table name; tables of one grouped config
        share one."""
        optimizers: dict[str, KVFusedOptimizer] = {}
        for lookup in self._kv_lookups():
            optimizers.update(lookup.kv_fused_optimizers())
        return optimizers

    def kv_layouts(self) -> list[TableLayout]:
        """Every KV table of the collection as this rank sees it: its shard here (if
        any) and the routing buckets this rank owns (state_dict and checkpoints)."""
        return sharded_layouts(
            getattr(self, self.kv_configs_attribute),
            self._kv_specs.options,
            {name: p.sharding_type for name, p in self.module_sharding_plan.items()},
            self.kv_tables(),
            self.kv_fused_optimizers(),
            self._env.rank,
            self._env.world_size,
            {name: p.ranks for name, p in self.module_sharding_plan.items()},
        )

    def metrics(self) -> dict[str, dict[str, float]]:
        """``KVTable.metrics()`` of this rank's shards, by table name."""
        return {name: table.metrics() for name, table in self.kv_tables().items()}

    def prefetch(
        self,
        dist_input: KJTList,
        forward_stream: torch.Stream | None = None,
        ctx: Any | None = None,
    ) -> None:
        """TorchRec's prefetch hook (``PrefetchTrainPipelineSparseDist`` calls it with a
        coming batch's ids after the input all-to-all, while the current batch runs):
        every KV table shard with an SSD tier starts reading the rows of the ids routed
        to it (``KVTable.prefetch``); stock lookups prefetch as TorchRec's do."""
        for features, lookup in zip(dist_input, self._lookups, strict=True):
            while isinstance(lookup, nn.parallel.DistributedDataParallel):
                lookup = lookup.module
            if isinstance(lookup, self.kv_lookup_type):
                prefetch_kv_lookup(lookup, features)
            else:
                lookup.prefetch(sparse_features=features, forward_stream=forward_stream)

    def _kv_lookups(self) -> list[Any]:
        """The lookups that hold KV tables (unwrapped from DDP)."""
        found = []
        for lookup in self._lookups:
            while isinstance(lookup, nn.parallel.DistributedDataParallel):
                lookup = lookup.module
            if isinstance(lookup, self.kv_lookup_type):
                found.append(lookup)
        return found

    # ------------------------------------------------- base class hooks
    def _create_hash_size_info(self, feature_names: list[str], ctx: Any | None = None) -> None:
        """The sequence collection's index dedup set-up: which table each feature of
        each sharding's batch belongs to (TorchRec's linearizes ids by table size, which
        a KV table, keyed by any int64, does not have)."""
        self._kv_dedup_labels = [
            table_labels(sharding.embedding_tables())
            for sharding in self._sharding_type_to_sharding.values()
        ]

    def _dedup_indices(self, ctx: Any, input_feature_splits: list[KeyedJaggedTensor]) -> list:
        """The sequence collection's index dedup (``use_index_dedup``), by
        :func:`~torchrec_kvemb.sharding.index_dedup.dedup_features` for KV and stock
        tables alike (TorchRec's op for it has no CPU kernel): each sharding's batch with
        each (table, id) once; the output's rows go back to every occurrence through
        ``ctx.reverse_indices``, as TorchRec's do."""
        deduped = []
        for features, labels in zip(input_feature_splits, self._kv_dedup_labels, strict=True):
            dedup, reverse = dedup_features(features, labels)
            ctx.input_features.append(features)
            ctx.reverse_indices.append(reverse)
            deduped.append(dedup)
        return deduped

    def reset_parameters(self) -> None:
        """The stock initialization for stock tables; KV rows are born from (id, seed)."""
        configs = getattr(self, self.kv_configs_attribute)
        stock = [c for c in configs if c.name not in self._kv_specs.options]
        setattr(self, self.kv_configs_attribute, stock)
        try:
            super().reset_parameters()  # type: ignore[misc]
        finally:
            setattr(self, self.kv_configs_attribute, configs)


def prefetch_kv_lookup(lookup: Any, features: KeyedJaggedTensor) -> None:
    """Start the SSD reads of a grouped lookup's KV tables for ``features`` (the
    lookup's share of a batch after the input dist: its groups' features in order,
    a feature once per table that reads it): each table shard with an SSD tier gets
    the ids of its features (a KV lookup holds KV kernels only: ``kv_groups_first``)."""
    per_group = features.split(lookup._feature_splits)
    for module, group_features in zip(lookup._emb_modules, per_group, strict=True):
        tables = getattr(module, "tables", None)
        if tables is None:
            continue
        counts = group_features.length_per_key()
        ids = group_features.values()
        start = 0
        k = 0
        for config, table in zip(module.config.embedding_tables, tables, strict=True):
            n = sum(counts[k : k + config.num_features()])
            k += config.num_features()
            if table.ssd is not None and n:
                table.prefetch(ids[start : start + n])
            start += n
