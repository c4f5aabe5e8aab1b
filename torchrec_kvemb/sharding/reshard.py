"""Resharding a collection's KV tables in place: ``update_shards`` / ``DMP.reshard``.

A change of plan (same world size) moves KV tables among row-wise,
table-wise and table-row-wise, a table-wise table to another rank, or a
table-row-wise one to another node (column-wise tables stay: their shards
would need rows cut by columns). The collection's KV
shardings are rebuilt from its table configs and the merged plan through the
same factories that built them (``create_grouped_sharding_infos`` and the
collection's sharding factory: :mod:`.reshard_bags`, :mod:`.reshard_sequences`);
stock tables keep their shardings, lookups, rows and optimizer state. Every KV
table's rows move to their new owners by id through collectives
(:mod:`.reshard_rows`), into new shards built beside the old ones; only once
every rank holds its new rows does the collection switch to them, so a failure
on the way leaves it as it was.

Example::

    plan = {"user": ParameterSharding("table_wise", "customized_kernel", ranks=[1], ...)}
    dmp.reshard({"ebc": (0.0, plan)}, "ebc")  # or dmp.module.ebc.update_shards(plan, env, None)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.optim.keyed import CombinedOptimizer

from torchrec_kvemb.checkpoint import collectives as comm
from torchrec_kvemb.sharding.reshard_rows import exchange_tables, place_tables
from torchrec_kvemb.sharding.sharded_common import KV_GROUP_PREFIX
from torchrec_kvemb.sharding.twrw import check_node_buckets, node_ranks
from torchrec_kvemb.state_dict import CheckpointError, install_table_entries, sharded_layouts

#: What to do for a change resharding in place does not make.
CHECKPOINT_HINT = (
    "save a checkpoint (torchrec_kvemb.checkpoint.save) and load it into a model "
    "sharded by the new plan"
)
#: KV sharding types whose rows' owners :func:`.reshard_rows.destination` knows.
MOVABLE_SHARDING_TYPES = (
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
)


def _check_kv_placement(name: str, sharding: ParameterSharding, options: Any, world: int) -> None:
    ranks = list(sharding.ranks or [])
    if any(not isinstance(r, int) or not 0 <= r < world for r in ranks):
        raise ValueError(
            f"table {name!r}: the plan places it on ranks {ranks}, the world has ranks "
            f"0..{world - 1} (resharding in place keeps the world size: to change it "
            f"{CHECKPOINT_HINT})"
        )
    if sharding.sharding_type == ShardingType.TABLE_WISE.value and len(ranks) != 1:
        raise ValueError(f"table {name!r}: a table-wise table lives on one rank, got {ranks}")
    if sharding.sharding_type == ShardingType.ROW_WISE.value:
        if sorted(ranks) != list(range(world)):
            raise ValueError(
                f"table {name!r}: a row-wise KV table has a shard on every rank "
                f"(0..{world - 1}), the plan names ranks {ranks}"
            )
        if options.total_num_buckets % world:
            raise ValueError(
                f"table {name!r}: row-wise over {world} ranks needs total_num_buckets "
                f"divisible by {world}, it has {options.total_num_buckets}"
            )
    if sharding.sharding_type == ShardingType.TABLE_ROW_WISE.value:
        if not ranks:
            raise ValueError(f"table {name!r}: a table_row_wise plan names no ranks")
        local_size = get_local_size(world)  # what the table-row-wise sharding reads
        node_ranks(name, ranks, local_size, world)
        check_node_buckets(name, options.total_num_buckets, local_size)


@dataclass
class Rebuilt:
    """A collection's shardings for a new plan, built beside the current ones: by
    sharding key, its infos, sharding, lookup, and whether the lookup is new (KV)."""

    infos: dict[str, list[EmbeddingShardingInfo]]
    shardings: list[EmbeddingSharding]
    lookups: list[nn.Module]
    fresh: list[bool]


class KVResharding:
    """``update_shards`` of the sharded KV collections (mixed in before
    ``KVShardedMixin``): see the module docstring. The subclass for a collection
    builds its shardings for a plan (``_kv_rebuild``) and makes them the
    collection's (``_kv_switch``), setting the TorchRec sharded collection's own
    attributes as its constructor does.

    Example::

        sharded = dmp.module.ebc   # a ShardedKVEmbeddingBagCollection
        sharded.update_shards({"user": new_parameter_sharding}, sharded_env, None)
    """

    #: The prefix TorchRec's constructor gives fused optimizer params and state_dict
    #: entries (``embedding_bags`` or ``embeddings``).
    kv_attribute: str

    def update_shards(
        self,
        changed_sharding_params: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None,
    ) -> None:
        """Reshard in place to the plan with ``changed_sharding_params`` (table name ->
        new ``ParameterSharding``; the same world size): KV tables move among
        row-wise, table-wise and table-row-wise, between ranks and nodes, with their
        rows, optimizer state, scores, counters and learning rates; stock tables stay
        as they are (a change naming one is refused). What
        ``DistributedModelParallel.reshard`` calls; a collective over the collection's
        process group. Bad plans raise ``ValueError`` and a failure on the way
        ``RuntimeError``, the collection unchanged."""
        plan = self.kv_merged_plan(changed_sharding_params, env)
        if plan == self.module_sharding_plan:
            return  # nothing moves (the same answer on every rank: no collective)
        device = device if device is not None else self._device
        rebuilt = self._kv_rebuild(plan, env, device)
        tables, optimizers = kv_parts(rebuilt.lookups, self.kv_lookup_type)
        new_layouts = sharded_layouts(
            getattr(self, self.kv_configs_attribute),
            self._kv_specs.options,
            {name: p.sharding_type for name, p in plan.items()},
            tables,
            optimizers,
            self._env.rank,
            self._env.world_size,
            {name: p.ranks for name, p in plan.items()},
        )
        group = self._env.process_group
        ranks = {layout.name: list(plan[layout.name].ranks or []) for layout in new_layouts}
        try:
            moved = exchange_tables(
                self.kv_layouts(), new_layouts, ranks, self._env.world_size, group, device
            )
            place_tables(new_layouts, moved, group)
        except CheckpointError as e:  # agreed by every rank: none switches
            raise RuntimeError(
                f"resharding in place failed, the collection keeps its plan and rows: {e}"
            ) from e
        saved = self._kv_snapshot()
        error = None
        try:
            self._kv_switch(plan, rebuilt, tables)
        except Exception as e:
            error = e
        try:  # every rank switches, or none: one that switched goes back too
            comm.agree(error, group)
        except CheckpointError as e:
            self._kv_restore(saved)
            raise RuntimeError(
                f"resharding in place failed, the collection keeps its plan and rows: {e}"
            ) from e

    def kv_merged_plan(
        self, changed: Mapping[str, ParameterSharding], env: ShardingEnv
    ) -> dict[str, ParameterSharding]:
        """The collection's plan with ``changed`` applied, checked: the same world size,
        known tables, stock tables unchanged, KV tables planned as ``shard()`` requires
        (``customized_kernel``, a KV sharding type) on ranks of this world, no SSD tier.
        Raises ``ValueError`` naming the table; nothing is changed."""
        world = self._env.world_size
        if env.world_size != world:
            raise ValueError(
                f"resharding in place keeps the world size ({world}); the new environment "
                f"has {env.world_size} ranks: to change the world size {CHECKPOINT_HINT}"
            )
        current = self.module_sharding_plan
        unknown = sorted(set(changed) - set(current))
        if unknown:
            raise ValueError(
                f"tables {unknown} are not tables of this collection (its tables: "
                f"{sorted(current)})"
            )
        options = self._kv_specs.options
        for name, sharding in changed.items():
            if name not in options and sharding != current[name]:
                raise ValueError(
                    f"table {name!r} is a stock table: resharding in place moves KV tables "
                    f"only (it is planned {current[name].sharding_type} on ranks "
                    f"{current[name].ranks}); to move it {CHECKPOINT_HINT}"
                )
        if getattr(self, "enable_embedding_update", False):
            raise ValueError(
                "resharding in place: this collection has tables with "
                f"enable_embedding_update; {CHECKPOINT_HINT}"
            )
        plan = {**current, **changed}
        self.check_kv_plan(plan)
        for name in options:
            for when, sharding in (("is", current[name]), ("would be", plan[name])):
                if sharding.sharding_type not in MOVABLE_SHARDING_TYPES:
                    why = ""
                    if sharding.sharding_type == ShardingType.COLUMN_WISE.value:
                        why = (
                            " (a column-wise shard holds some columns of its rows: moving "
                            "them would need rows cut or joined by columns)"
                        )
                    raise ValueError(
                        f"table {name!r} {when} planned {sharding.sharding_type}{why}: "
                        "resharding in place moves KV tables sharded "
                        f"{', '.join(MOVABLE_SHARDING_TYPES)}; {CHECKPOINT_HINT}"
                    )
        for name in changed:
            if name in options:
                _check_kv_placement(name, plan[name], options[name], world)
        if plan != current:  # every KV shard of the collection is built again
            for name, table_options in options.items():
                if table_options.ssd is not None:
                    raise ValueError(
                        f"table {name!r} has an SSD tier, whose files belong to its shard "
                        "on each rank: a collection holding it does not reshard in place; "
                        f"{CHECKPOINT_HINT}"
                    )
        return plan

    def _kv_snapshot(self) -> dict[str, Any]:
        """The attributes ``_kv_switch`` changes (lists and dicts copied: some it
        clears in place), for ``_kv_restore``."""
        state = {
            key: copy.copy(value) if type(value) in (list, dict) else value
            for key, value in self.__dict__.items()
        }
        for key in ("_modules", "_parameters", "_buffers"):
            state[key] = dict(self.__dict__[key])
        state["module_sharding_plan"] = dict(self.module_sharding_plan)
        return state

    def _kv_restore(self, saved: dict[str, Any]) -> None:
        plan = self.module_sharding_plan
        self.__dict__.clear()
        self.__dict__.update(saved)
        plan.clear()
        plan.update(saved["module_sharding_plan"])
        self.__dict__["module_sharding_plan"] = plan

    def kv_switch_optimizer_and_entries(self, rebuilt: Rebuilt, tables: dict) -> None:
        """The last part of a switch, the same for every collection: the combined fused
        optimizer (new KV kernels' params keyed as the TorchRec constructor keys them,
        stock ones as they were) and the KV tables' state_dict entries (TorchRec's
        ``_initialize_torch_state`` is not called: it ends in ``reset_parameters``,
        which would re-initialize the stock tables' weights)."""
        optims = []
        for lookup, fresh in zip(rebuilt.lookups, rebuilt.fresh, strict=True):
            for _, kernel in lookup.named_modules():
                if isinstance(kernel, FusedOptimizerModule):
                    optimizer = kernel.fused_optimizer
                    if fresh:
                        optimizer.params = {
                            f"{self.kv_attribute}.{key}": value
                            for key, value in optimizer.params.items()
                        }
                    optims.append(("", optimizer))
        self._optim = CombinedOptimizer(optims)
        kv_dims = {
            c.name: c.embedding_dim
            for c in getattr(self, self.kv_configs_attribute)
            if c.name in self._kv_specs.options
        }
        container = getattr(self, self.kv_attribute)
        for name in kv_dims:
            if name in container._modules:
                container[name] = nn.Module()
        devices = [table.device for table in tables.values()]
        install_table_entries(self, self.kv_attribute, kv_dims, devices[0] if devices else None)


def kv_parts(lookups: list[nn.Module], kv_lookup_type: Any) -> tuple[dict, dict]:
    """The KV table shards and the fused optimizers driving them, by table name, of
    ``lookups`` (unwrapped from DDP)."""
    tables, optimizers = {}, {}
    for lookup in lookups:
        while isinstance(lookup, nn.parallel.DistributedDataParallel):
            lookup = lookup.module
        if isinstance(lookup, kv_lookup_type):
            tables.update(lookup.kv_tables())
            optimizers.update(lookup.kv_fused_optimizers())
    return tables, optimizers


def held_like(current: Any, modules: list[nn.Module]) -> Any:
    """``modules`` held as TorchRec's constructor holds ``current`` (a list or an
    ``nn.ModuleList``)."""
    return nn.ModuleList(modules) if isinstance(current, nn.ModuleList) else list(modules)


def rebuild_shardings(
    infos: dict[str, list[EmbeddingShardingInfo]],
    old_infos: Mapping[str, list[EmbeddingShardingInfo]],
    old_shardings: Mapping[str, EmbeddingSharding],
    old_lookups: Mapping[str, nn.Module],
    create: Any,
) -> Rebuilt:
    """New shardings and lookups for the ``"kv:"`` groups of ``infos`` (``create(key,
    group)`` gives a sharding), the old ones (and their infos) for stock groups."""
    shardings, lookups, fresh = [], [], []
    for key, group in infos.items():
        if not key.startswith(KV_GROUP_PREFIX):
            infos[key] = old_infos[key]
            shardings.append(old_shardings[key])
            lookups.append(old_lookups[key])
            fresh.append(False)
            continue
        sharding = create(key, group)
        shardings.append(sharding)
        lookups.append(sharding.create_lookup())
        fresh.append(True)
    return Rebuilt(infos, shardings, lookups, fresh)


class ParamsView:
    """What ``create_grouped_sharding_infos`` reads of a module, from a sharded
    collection: its configs (under the accessor name the stock module has), and the
    parameters its infos hold, under ``<attribute>.<table>.weight``.

    Example::

        view = ParamsView("embedding_bag_configs", configs, "embedding_bags", infos)
    """

    device = torch.device("meta")

    def __init__(
        self,
        accessor: str,
        configs: list[Any],
        attribute: str,
        infos: Mapping[str, list[EmbeddingShardingInfo]],
    ) -> None:
        self._params = {
            f"{attribute}.{info.embedding_config.name}.weight": info.param
            for group in infos.values()
            for info in group
        }
        setattr(self, accessor, lambda: configs)

    def named_parameters(self) -> Any:
        return iter(self._params.items())

    def state_dict(self) -> dict[str, Any]:
        return dict(self._params)
