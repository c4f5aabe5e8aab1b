"""``KVStorageEstimator``: TorchRec's storage estimator, with KV tables' lower tiers.

The stock estimator sees a KV table through its storage stand-in
(``planner.storage_proxy``): the table's own arrays, in ``hbm`` on CUDA and in
``ddr`` on the CPU, as a stock table's weight. A KV table's lower tiers live
elsewhere whatever the device: a host tier's rows and the SSD tier's index in
host memory (``ddr``), the SSD tier's slab on disk (``ssd``). This estimator
runs the stock one, then adds each KV shard's lower tiers to its ``Storage``
(``ssd.estimate.storage_estimate`` of the shard's options), so the planner
checks the device memory, the host memory and the disk apart, as it does for
TorchRec's own virtual tables.

Example::

    topology = Topology(world_size=8, compute_device="cuda")
    estimators = [EmbeddingPerfEstimator(topology), KVStorageEstimator(topology, [sharder])]
    enumerator = EmbeddingEnumerator(topology, batch_size, estimator=estimators)
    planner = EmbeddingShardingPlanner(topology, batch_size, enumerator=enumerator)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from torch import nn
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.types import ParameterConstraints, ShardingOption, Topology
from torchrec.distributed.types import ShardingType

from torchrec_kvemb.sharding.kv_embedding import shard_options
from torchrec_kvemb.sharding.planner import KV_COMPUTE_KERNEL
from torchrec_kvemb.ssd.estimate import storage_estimate


class KVStorageEstimator(EmbeddingStorageEstimator):
    """The stock storage estimator, with each KV shard's host tier and SSD tier index
    added to its ``ddr`` and its SSD slab to its ``ssd`` (see the module docstring).

    * ``sharders``: the KV sharders the plan uses (they know each table's options).
    * ``lower_tier_rows``: rows expected in the lower tiers of a table (by table
      name, for the whole table) whose tier has no capacity of its own; such a
      table without an entry is refused, naming it.

    Other arguments are the stock estimator's.

    Example::

        KVStorageEstimator(topology, sharders=[sharder], lower_tier_rows={"user": 10**9})
    """

    def __init__(
        self,
        topology: Topology,
        sharders: Sequence[Any],
        constraints: dict[str, ParameterConstraints] | None = None,
        lower_tier_rows: Mapping[str, int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(topology, constraints, **kwargs)
        self._kv_sharders = [s for s in sharders if hasattr(s, "kv_table")]
        if not self._kv_sharders:
            raise ValueError("KVStorageEstimator: no KV sharder among sharders")
        self._lower_tier_rows = dict(lower_tier_rows or {})

    def estimate(self, sharding_options: list[ShardingOption], *args: Any, **kwargs: Any) -> None:
        super().estimate(sharding_options, *args, **kwargs)
        for option in sharding_options:
            if option.compute_kernel != KV_COMPUTE_KERNEL:
                continue
            extra = self._lower_tiers(option)
            for shard in option.shards:
                if shard.storage is not None:
                    shard.storage = replace(
                        shard.storage,
                        ddr=shard.storage.ddr + extra["host_bytes"],
                        ssd=shard.storage.ssd + extra["disk_bytes"],
                    )

    def _sharder_of(self, module: nn.Module) -> Any:
        for sharder in self._kv_sharders:
            if isinstance(module, sharder.module_type):
                return sharder
        raise ValueError(
            f"KVStorageEstimator: no KV sharder for a {type(module).__name__} "
            "(pass the sharders the plan uses)"
        )

    def _lower_tiers(self, option: ShardingOption) -> dict[str, int]:
        """One shard's host and disk bytes of ``option``'s table."""
        module = option.module[1]
        options, optim = self._sharder_of(module).kv_table(module, option.name)
        if not options.tiered:
            return {"host_bytes": 0, "disk_bytes": 0}
        split = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)
        num_shards = len(option.shards) if option.sharding_type in split else 1
        shard = shard_options(options, num_shards)
        rows = self._lower_tier_rows.get(option.name)
        unbounded = (options.ssd is not None and options.ssd.capacity is None) or (
            options.host_tier is not None
            and options.host_tier.capacity is None
            and options.host_tier.memory_budget_bytes is None
        )
        if unbounded and rows is None:
            raise ValueError(
                f"table {option.name!r}: a lower tier without a capacity; give "
                "KVStorageEstimator(lower_tier_rows={table: rows expected there})"
            )
        part = None if rows is None else -(-rows // num_shards)
        estimate = storage_estimate(
            shard, option.tensor.shape[1], optim, ssd_rows=part, host_rows=part
        )
        return {"host_bytes": estimate["host_bytes"], "disk_bytes": estimate["disk_bytes"]}
