"""What the two KV sharders share: per-table planning answers, KV table specs from
the sharder's options or from a KV module, and the checks made before sharding.

The planner asks a sharder for sharding types and kernels without naming the
table (``sharding_types(device)``, ``compute_kernels(type, device)``), but asks
inside its loop over ``shardable_parameters(module).items()``. That mapping
tells the sharder which table the loop is on, so the answers are per table:
``kv_sharding_types`` (bags: row_wise, table_wise, column_wise, table_row_wise;
sequences: the same) x ``[customized_kernel]`` for KV tables, the stock
answers for the others.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch
from torch import nn
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingEnv2D

from torchrec_kvemb.optimizer import FusedOptimConfig, marked_fused_params
from torchrec_kvemb.options import KVTableOptions, with_config_init
from torchrec_kvemb.sharding.kv_embedding import KVTableSpecs, optim_config
from torchrec_kvemb.sharding.planner import KV_COMPUTE_KERNEL, storage_proxy
from torchrec_kvemb.sharding.replica_sync import check_replicable, replica_sync_is_enabled
from torchrec_kvemb.sharding.sharded_ebc import KV_SHARDING_TYPES


class TablesInPlanning(dict):
    """``shardable_parameters()``'s answer: while the planner iterates ``items()``,
    the sharder knows whether the current table is a KV table.

    Example::

        params = TablesInPlanning(sharder, {"t": weight}, kv={"t"})
        for name, _ in params.items():
            sharder.sharding_types("cpu")   # the KV answer while name == "t"
    """

    def __init__(self, sharder: KVSharderBase, params: dict, kv: set) -> None:
        super().__init__(params)
        self._sharder = sharder
        self._kv = kv

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        try:
            for name, param in super().items():
                self._sharder.planning_kv = name in self._kv
                yield name, param
        finally:
            self._sharder.planning_kv = None


class KVSharderBase:
    """Mixed in before a stock TorchRec sharder (bag or sequence collection): KV
    tables by name, planned ``customized_kernel`` with one of ``kv_sharding_types``.

    Subclasses name their module types (``stock_module``, ``kv_module``), the
    method that lists a module's table configs (``configs_method``) and the
    sharded module they build (``sharded_module_type``).

    Example::

        class KVEmbeddingBagCollectionSharder(KVSharderBase, EmbeddingBagCollectionSharder):
            stock_module, kv_module = EmbeddingBagCollection, KVEmbeddingBagCollection
            configs_method = "embedding_bag_configs"
    """

    stock_module: type[nn.Module]
    kv_module: type[nn.Module]
    #: The sharding types KV tables of this sharder's module may have.
    kv_sharding_types: ClassVar[list[str]] = KV_SHARDING_TYPES
    #: The method that lists a module's table configs (``embedding_bag_configs``, ...).
    configs_method: str

    def __init__(
        self,
        table_options: Mapping[str, KVTableOptions] | None = None,
        fused_params: dict[str, Any] | None = None,
        qcomm_codecs_registry: dict[str, Any] | None = None,
        module_type: type[nn.Module] | None = None,
        use_index_dedup: bool = False,
    ) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        who = type(self).__name__
        if not isinstance(use_index_dedup, bool):
            raise TypeError(f"{who}: use_index_dedup must be a bool, got {use_index_dedup!r}")
        self._use_index_dedup = use_index_dedup
        module_type = module_type or self.stock_module
        if module_type not in (self.stock_module, self.kv_module):
            raise TypeError(
                f"{who}: module_type must be {self.stock_module.__name__} "
                f"or {self.kv_module.__name__}, got {module_type!r}"
            )
        if table_options is not None and not isinstance(table_options, Mapping):
            raise TypeError(
                f"{who}: table_options must be a dict of KVTableOptions by table name, "
                f"got {type(table_options).__name__}"
            )
        options = dict(table_options or {})
        for name, value in options.items():
            if not isinstance(value, KVTableOptions):
                raise TypeError(
                    f"table {name!r}: expected KVTableOptions, got {type(value).__name__}"
                )
        if not options and module_type is self.stock_module:
            raise ValueError(
                f"{who}: table_options names no table; use TorchRec's "
                f"{self.stock_module.__name__} sharder for a collection without KV tables"
            )
        self._table_options = options
        self._module_type = module_type
        # Refuse an optimizer KV tables cannot run now rather than at shard time.
        self._optim = optim_config(fused_params)
        #: Set while the planner iterates shardable_parameters(): is its table KV?
        self.planning_kv: bool | None = None

    def table_configs(self, module: nn.Module) -> list:
        """The table configs of a module this sharder shards (its ``configs_method``)."""
        return getattr(module, self.configs_method)()

    @property
    def module_type(self) -> type[nn.Module]:
        return self._module_type

    @property
    def use_index_dedup(self) -> bool:
        """Whether the sharded module sends each id once per table per batch
        (:mod:`torchrec_kvemb.sharding.index_dedup`, docs/sharding.md)."""
        return self._use_index_dedup

    @property
    def table_options(self) -> dict[str, KVTableOptions]:
        """The KV tables' options by table name (as given)."""
        return dict(self._table_options)

    # ---------------------------------------------------------- planning
    def sharding_types(self, compute_device_type: str) -> list[str]:
        stock = super().sharding_types(compute_device_type)
        if self.planning_kv is None:
            return stock + [t for t in self.kv_sharding_types if t not in stock]
        return list(self.kv_sharding_types) if self.planning_kv else stock

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        if self.planning_kv:
            return [KV_COMPUTE_KERNEL]
        stock = super().compute_kernels(sharding_type, compute_device_type)
        if self.planning_kv is None and sharding_type in self.kv_sharding_types:
            return stock + [KV_COMPUTE_KERNEL]
        return stock

    def shardable_parameters(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Stock weights for stock tables; for KV tables a ``meta`` stand-in whose
        bytes are the table's memory (see :mod:`torchrec_kvemb.sharding.planner`)."""
        specs = self.table_specs(module)
        if isinstance(module, self.kv_module):
            params: dict[str, torch.Tensor] = {}
        else:
            params = dict(super().shardable_parameters(module))
        kv = set()
        for config in self.table_configs(module):
            if config.name in specs.options:
                optim = specs.optims.get(config.name) or self._marked_optim(
                    params.get(config.name), config.name
                )
                params[config.name] = storage_proxy(
                    specs.options[config.name], config.embedding_dim, optim
                )
                kv.add(config.name)
        return TablesInPlanning(self, params, kv)

    def kv_table(self, module: nn.Module, table: str) -> tuple[KVTableOptions, FusedOptimConfig]:
        """The options and optimizer ``table`` of ``module`` is sharded with (the planner's
        storage estimates read them; see :mod:`.storage_estimator`)."""
        specs = self.table_specs(module)
        if table not in specs.options:
            raise ValueError(f"table {table!r}: not a KV table of this sharder")
        optim = specs.optims.get(table)
        if optim is None:
            stock = (
                {} if isinstance(module, self.kv_module) else super().shardable_parameters(module)
            )
            optim = self._marked_optim(stock.get(table), table)
        return specs.options[table], optim

    def _check_2d(self, module: nn.Module) -> None:
        """Under ``ShardingEnv2D`` KV tables need their replicas synced by id: shard only
        inside ``kv_replica_sync_enabled()`` (``KVDMPCollection`` enters it), and only
        tables replica sync serves."""
        options = self.table_specs(module).options
        if not replica_sync_is_enabled():
            raise NotImplementedError(
                f"KV tables {sorted(options)}: 2D parallelism (ShardingEnv2D) needs the KV "
                "replicas synced by id, which DMPCollection.sync() does not do (it averages "
                "weights by row position, and KV replicas hold other ids in other slots). "
                "Use torchrec_kvemb.sharding.KVDMPCollection, or shard inside "
                "kv_replica_sync_enabled() and call KVReplicaSync.sync() yourself "
                "(docs/sharding-design.md, '2D parallelism')"
            )
        check_replicable(options)

    def _marked_optim(self, weight: torch.Tensor | None, table: str) -> FusedOptimConfig:
        """The optimizer a stock table's KV shards will run: the sharder's
        ``fused_params`` merged with what ``apply_optimizer_in_backward`` marked the
        table's weight with, as TorchRec merges them at shard time (so the planner
        counts that optimizer's state)."""
        merged = marked_fused_params(weight, self.fused_params, table)
        return self._optim if merged is None else optim_config(merged, table)

    def table_specs(self, module: nn.Module) -> KVTableSpecs:
        """The options (and, for a KV module, optimizers) of ``module``'s KV tables."""
        if not isinstance(module, self.kv_module):
            given = self._table_options
            configs = [c for c in self.table_configs(module) if c.name in given]
            return KVTableSpecs({c.name: with_config_init(given[c.name], c) for c in configs})
        kind = self.kv_module.__name__
        options: dict[str, KVTableOptions] = {}
        optims: dict[str, FusedOptimConfig] = {}
        for name, table in module.kv_tables().items():
            given = self._table_options.get(name)
            if given is not None and given != table.options:
                raise ValueError(
                    f"table {name!r}: the sharder's KVTableOptions differ from the "
                    f"{kind}'s; its own options are used, drop them from the sharder"
                )
            # what the sharder would give a stock table: its fused_params, with what
            # apply_optimizer_in_backward marked the module's weight with merged over them
            expected = self._marked_optim(module.table_weight(name), name)
            if self.fused_params is not None and expected != table.optim:
                raise ValueError(
                    f"table {name!r}: the sharder's fused_params (with the optimizer "
                    f"apply_optimizer_in_backward marked) describe {expected}, the {kind} "
                    f"runs {table.optim}; its own optimizer is used, drop fused_params "
                    "from the sharder"
                )
            options[name] = table.options
            optims[name] = table.optim
        return KVTableSpecs(options, optims)

    # ----------------------------------------------------------- sharding
    def shard(
        self,
        module: nn.Module,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> nn.Module:
        """The sharded module (``sharded_module_type``) of ``module`` under ``params``."""
        if isinstance(env, ShardingEnv2D):
            self._check_2d(module)
        if isinstance(module, self.kv_module):
            stored = {n: t.size for n, t in module.kv_tables().items() if t.size}
            if stored:
                raise ValueError(
                    f"{self.kv_module.__name__} tables already hold rows {stored}: shard a "
                    "freshly built collection (moving stored rows into shards is not "
                    "supported yet)"
                )
        return self.sharded_module_type(
            module,
            params,
            env,
            specs=self.table_specs(module),
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            use_index_dedup=self._use_index_dedup,
        )
