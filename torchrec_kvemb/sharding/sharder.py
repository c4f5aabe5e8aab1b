"""``KVEmbeddingBagCollectionSharder``: the drop-in sharder for ``DistributedModelParallel``.

Hand it to DMP (and to the planner) in place of TorchRec's
``EmbeddingBagCollectionSharder``. Tables it has ``KVTableOptions`` for become
KV tables (compute kernel ``customized_kernel``, sharded row-wise or
table-wise); the others are sharded exactly as the stock sharder would.

The planner asks a sharder for sharding types and kernels without naming the
table (``sharding_types(device)``, ``compute_kernels(type, device)``), but asks
inside its loop over ``shardable_parameters(module).items()``. That mapping
tells the sharder which table the loop is on, so the answers are per table:
``[row_wise, table_wise]`` x ``[customized_kernel]`` for KV tables, the stock
answers for the others.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ParameterSharding, QuantizedCommCodecs, ShardingEnv
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_kvemb.ebc import KVEmbeddingBagCollection
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import KVTableOptions
from torchrec_kvemb.sharding.kv_embedding import KVTableSpecs, optim_config
from torchrec_kvemb.sharding.planner import KV_COMPUTE_KERNEL, storage_proxy
from torchrec_kvemb.sharding.sharded_ebc import KV_SHARDING_TYPES, ShardedKVEmbeddingBagCollection

_MODULE_TYPES = (EmbeddingBagCollection, KVEmbeddingBagCollection)


class _TablesInPlanning(dict):
    """``shardable_parameters()``'s answer: while the planner iterates ``items()``,
    the sharder knows whether the current table is a KV table."""

    def __init__(self, sharder: KVEmbeddingBagCollectionSharder, params: dict, kv: set) -> None:
        super().__init__(params)
        self._sharder = sharder
        self._kv = kv

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        try:
            for name, param in super().items():
                self._sharder._planning_kv = name in self._kv
                yield name, param
        finally:
            self._sharder._planning_kv = None


class KVEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """Shards an ``EmbeddingBagCollection`` whose tables named in ``table_options`` are
    KV tables (row-wise or table-wise); the other tables stay stock.

    * ``table_options``: ``KVTableOptions`` by table name. ``capacity`` /
      ``memory_budget_bytes`` are per table: a row-wise shard gets ``1 / W`` of
      them, a table-wise one all.
    * ``fused_params``: TorchRec's ``fused_params`` (optimizer, learning_rate,
      ...), for KV and stock tables alike.
    * ``module_type``: ``EmbeddingBagCollection`` (default; build it on
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

    def __init__(
        self,
        table_options: Mapping[str, KVTableOptions] | None = None,
        fused_params: dict[str, Any] | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        module_type: type[nn.Module] = EmbeddingBagCollection,
    ) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        if module_type not in _MODULE_TYPES:
            raise TypeError(
                "KVEmbeddingBagCollectionSharder: module_type must be EmbeddingBagCollection "
                f"or KVEmbeddingBagCollection, got {module_type!r}"
            )
        if table_options is not None and not isinstance(table_options, Mapping):
            raise TypeError(
                "KVEmbeddingBagCollectionSharder: table_options must be a dict of "
                f"KVTableOptions by table name, got {type(table_options).__name__}"
            )
        options = dict(table_options or {})
        for name, value in options.items():
            if not isinstance(value, KVTableOptions):
                raise TypeError(
                    f"table {name!r}: expected KVTableOptions, got {type(value).__name__}"
                )
        if not options and module_type is EmbeddingBagCollection:
            raise ValueError(
                "KVEmbeddingBagCollectionSharder: table_options names no table; use "
                "TorchRec's EmbeddingBagCollectionSharder for a collection without KV tables"
            )
        self._table_options = options
        self._module_type = module_type
        # Refuse an optimizer KV tables cannot run now rather than at shard time.
        self._optim = optim_config(fused_params)
        # Set while the planner iterates shardable_parameters(): is its table KV?
        self._planning_kv: bool | None = None

    @property
    def module_type(self) -> type[nn.Module]:
        return self._module_type

    @property
    def sharded_module_type(self) -> type[ShardedKVEmbeddingBagCollection]:
        return ShardedKVEmbeddingBagCollection

    @property
    def table_options(self) -> dict[str, KVTableOptions]:
        """The KV tables' options by table name (as given)."""
        return dict(self._table_options)

    # ---------------------------------------------------------- planning
    def sharding_types(self, compute_device_type: str) -> list[str]:
        stock = super().sharding_types(compute_device_type)
        if self._planning_kv is None:
            return stock + [t for t in KV_SHARDING_TYPES if t not in stock]
        return list(KV_SHARDING_TYPES) if self._planning_kv else stock

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        if self._planning_kv:
            return [KV_COMPUTE_KERNEL]
        stock = super().compute_kernels(sharding_type, compute_device_type)
        if self._planning_kv is None and sharding_type in KV_SHARDING_TYPES:
            return stock + [KV_COMPUTE_KERNEL]
        return stock

    def shardable_parameters(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Stock weights for stock tables; for KV tables a ``meta`` stand-in whose
        bytes are the table's memory (see :mod:`torchrec_kvemb.sharding.planner`)."""
        specs = self.table_specs(module)
        if isinstance(module, KVEmbeddingBagCollection):
            params: dict[str, torch.Tensor] = {}
        else:
            params = dict(super().shardable_parameters(module))
        kv = set()
        for config in module.embedding_bag_configs():
            if config.name in specs.options:
                optim = specs.optims.get(config.name, self._optim)
                params[config.name] = storage_proxy(
                    specs.options[config.name], config.embedding_dim, optim
                )
                kv.add(config.name)
        return _TablesInPlanning(self, params, kv)

    def table_specs(self, module: nn.Module) -> KVTableSpecs:
        """The options (and, for a ``KVEmbeddingBagCollection``, optimizers) of
        ``module``'s KV tables."""
        if not isinstance(module, KVEmbeddingBagCollection):
            names = {c.name for c in module.embedding_bag_configs()}
            return KVTableSpecs({n: o for n, o in self._table_options.items() if n in names})
        options: dict[str, KVTableOptions] = {}
        optims: dict[str, FusedOptimConfig] = {}
        for name, table in module.kv_tables().items():
            given = self._table_options.get(name)
            if given is not None and given != table.options:
                raise ValueError(
                    f"table {name!r}: the sharder's KVTableOptions differ from the "
                    "KVEmbeddingBagCollection's; its own options are used, drop them "
                    "from the sharder"
                )
            if self.fused_params is not None and self._optim != table.optim:
                raise ValueError(
                    f"table {name!r}: the sharder's fused_params describe {self._optim}, the "
                    f"KVEmbeddingBagCollection was built with {table.optim}; its own "
                    "optimizer is used, drop fused_params from the sharder"
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
    ) -> ShardedKVEmbeddingBagCollection:
        if isinstance(module, KVEmbeddingBagCollection):
            stored = {n: t.size for n, t in module.kv_tables().items() if t.size}
            if stored:
                raise ValueError(
                    f"KVEmbeddingBagCollection tables already hold rows {stored}: shard a "
                    "freshly built collection (moving stored rows into shards is not "
                    "supported yet)"
                )
        return ShardedKVEmbeddingBagCollection(
            module,
            params,
            env,
            specs=self.table_specs(module),
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
        )
