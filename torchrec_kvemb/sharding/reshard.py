"""Resharding a bag collection's KV tables in place: ``update_shards`` / ``DMP.reshard``.

A change of plan (same world size) moves KV tables among row-wise and
table-wise, or a table-wise table to another rank. The collection's KV
shardings are rebuilt from its table configs and the merged plan through the
same factory that built them (``create_grouped_sharding_infos`` and
``create_embedding_bag_sharding``, so every KV sharding type registered there
reshards too); stock tables keep their shardings, lookups, rows and optimizer
state. Every KV table's rows move to their new owners by id through
collectives (:mod:`.reshard_rows`), into new shards built beside the old ones;
only once every rank holds its new rows does the collection switch to them, so a
failure on the way leaves it as it was.

Example::

    plan = {"user": ParameterSharding("table_wise", "customized_kernel", ranks=[1], ...)}
    dmp.reshard({"ebc": (0.0, plan)}, "ebc")  # or dmp.module.ebc.update_shards(plan, env, None)
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.feature_score_utils import create_sharding_type_to_feature_score_mapping
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.optim.keyed import CombinedOptimizer

from torchrec_kvemb.sharding.reshard_rows import exchange_tables, place_tables
from torchrec_kvemb.sharding.sharded_common import KV_GROUP_PREFIX
from torchrec_kvemb.state_dict import CheckpointError, install_table_entries, sharded_layouts

#: What to do for a change resharding in place does not make.
CHECKPOINT_HINT = (
    "save a checkpoint (torchrec_kvemb.checkpoint.save) and load it into a model "
    "sharded by the new plan"
)
#: KV sharding types whose rows' owners :func:`.reshard_rows.destination` knows.
MOVABLE_SHARDING_TYPES = (ShardingType.ROW_WISE.value, ShardingType.TABLE_WISE.value)
_ROW_WISE_TYPES = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)


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
    if options.ssd is not None:
        raise ValueError(
            f"table {name!r} has an SSD tier, whose files belong to its shard on each "
            f"rank: resharding it in place is not supported; {CHECKPOINT_HINT}"
        )


@dataclass
class _Rebuilt:
    """The collection's shardings for a new plan, built beside the current ones."""

    infos: dict[str, list[EmbeddingShardingInfo]]
    shardings: list[EmbeddingSharding]
    lookups: list[nn.Module]
    fresh: list[bool]


class _InfosView:
    """What ``create_grouped_sharding_infos`` reads of a module, from a sharded
    collection: its configs, weightedness and the parameters its infos hold."""

    device = torch.device("meta")

    def __init__(
        self,
        configs: list[EmbeddingBagConfig],
        weighted: bool,
        infos: Mapping[str, list[EmbeddingShardingInfo]],
    ) -> None:
        self._configs = configs
        self._weighted = weighted
        self._params = {
            f"embedding_bags.{info.embedding_config.name}.weight": info.param
            for group in infos.values()
            for info in group
        }

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._weighted

    def named_parameters(self) -> Any:
        return iter(self._params.items())

    def state_dict(self) -> dict[str, Any]:
        return dict(self._params)


class KVBagResharding:
    """``update_shards`` of ``ShardedKVEmbeddingBagCollection`` (mixed in before it):
    see the module docstring. Reads and sets the TorchRec sharded collection's own
    attributes, as its constructor and its ``update_shards`` do.

    Example::

        sharded = dmp.module.ebc   # a ShardedKVEmbeddingBagCollection
        sharded.update_shards({"user": new_parameter_sharding}, sharded_env, None)
    """

    def update_shards(
        self,
        changed_sharding_params: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None,
    ) -> None:
        """Reshard in place to the plan with ``changed_sharding_params`` (table name ->
        new ``ParameterSharding``; the same world size): KV tables move among
        row-wise and table-wise and between ranks, with their rows, optimizer state,
        scores, counters and learning rates; stock tables stay as they are (a change
        naming one is refused). What ``DistributedModelParallel.reshard`` calls; a
        collective over the collection's process group. Bad plans raise ``ValueError``
        and a failure on the way ``RuntimeError``, the collection unchanged."""
        plan = self.kv_merged_plan(changed_sharding_params, env)
        device = device if device is not None else self._device
        rebuilt = self._kv_rebuild(plan, env, device)
        tables, optimizers = _kv_parts(rebuilt.lookups, self.kv_lookup_type)
        new_layouts = sharded_layouts(
            self._embedding_bag_configs,
            self._kv_specs.options,
            {name: p.sharding_type for name, p in plan.items()},
            tables,
            optimizers,
            self._env.rank,
            self._env.world_size,
        )
        group = self._env.process_group
        ranks = {layout.name: list(plan[layout.name].ranks or []) for layout in new_layouts}
        try:
            moved = exchange_tables(
                self.kv_layouts(), new_layouts, ranks, self._env.world_size, group
            )
            place_tables(new_layouts, moved, group)
        except CheckpointError as e:  # agreed by every rank: none switches
            raise RuntimeError(
                f"resharding in place failed, the collection keeps its plan and rows: {e}"
            ) from e
        saved = self._kv_snapshot()
        try:
            self._kv_switch(plan, rebuilt, tables)
        except BaseException:
            self._kv_restore(saved)
            raise

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
        plan = {**current, **changed}
        self.check_kv_plan(plan)
        for name in options:
            for when, sharding in (("is", current[name]), ("would be", plan[name])):
                if sharding.sharding_type not in MOVABLE_SHARDING_TYPES:
                    raise ValueError(
                        f"table {name!r} {when} planned {sharding.sharding_type}: resharding "
                        f"in place moves KV tables sharded {' or '.join(MOVABLE_SHARDING_TYPES)}"
                        f"; {CHECKPOINT_HINT}"
                    )
        for name in changed:
            if name in options:
                _check_kv_placement(name, plan[name], options[name], world)
        return plan

    def _kv_rebuild(
        self, plan: dict[str, ParameterSharding], env: ShardingEnv, device: Any
    ) -> _Rebuilt:
        """New KV shardings and lookups (empty tables) for ``plan``, through the same
        factory the constructor uses; the stock ones as they are. Nothing changes."""
        view = _InfosView(
            self._embedding_bag_configs, self._is_weighted, self.sharding_type_to_sharding_infos
        )
        infos = self.create_grouped_sharding_infos(
            view, plan, "embedding_bags.", self._kv_fused_params
        )
        old = dict(zip(self._sharding_types, self._embedding_shardings, strict=True))
        old_lookups = dict(zip(self._sharding_types, self._lookups, strict=True))
        shardings, lookups, fresh = [], [], []
        for key, group in infos.items():
            if not key.startswith(KV_GROUP_PREFIX):
                infos[key] = self.sharding_type_to_sharding_infos[key]
                shardings.append(old[key])
                lookups.append(old_lookups[key])
                fresh.append(False)
                continue
            sharding = self.create_embedding_bag_sharding(
                group,
                env,
                device,
                permute_embeddings=True,
                qcomm_codecs_registry=self.qcomm_codecs_registry,
            )
            shardings.append(sharding)
            lookups.append(sharding.create_lookup())
            fresh.append(True)
        return _Rebuilt(infos, shardings, lookups, fresh)

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

    def _kv_switch(
        self, plan: dict[str, ParameterSharding], rebuilt: _Rebuilt, tables: dict
    ) -> None:
        """Make the rebuilt shardings the collection's: plan, infos, shardings, lookups,
        input and output dists, mean pooling divisors, fused optimizer, state_dict
        entries."""
        for name, sharding in plan.items():
            self.module_sharding_plan[name] = sharding
        self.sharding_type_to_sharding_infos = rebuilt.infos
        self._sharding_types = list(rebuilt.infos)
        self._embedding_shardings = rebuilt.shardings
        self._lookups = _like(self._lookups, rebuilt.lookups)

        pooled: dict[str, list[str]] = defaultdict(list)
        for config in self._embedding_bag_configs:
            if plan[config.name].sharding_type in _ROW_WISE_TYPES:
                pooled[config.pooling.value].extend(config.feature_names)
        self._pooling_type_to_rs_features = pooled
        self._has_mean_pooling_callback = PoolingType.MEAN.value in pooled
        self._pool_kv_mean_by_sum()

        # The input dists are built again at the next batch (as after the constructor).
        self._has_uninitialized_input_dist = True
        self._has_features_permute = True
        self._input_dists = _like(self._input_dists, [])
        self._features_order.clear()
        self._feature_splits.clear()
        self._kjt_key_indices = {}
        self._kt_key_ordering = None
        self._kjt_inverse_order = None
        self._inverse_indices_permute_indices = None

        self._update_output_dist()
        self._dim_per_key = torch.tensor(self._embedding_dims, device=self._device)
        (
            self._enable_feature_score_weight_accumulation,
            self._enabled_feature_score_auto_collection,
            self._sharding_type_feature_score_mapping,
        ) = create_sharding_type_to_feature_score_mapping(
            self._embedding_bag_configs, self.sharding_type_to_sharding_infos
        )

        optims = []
        for lookup, fresh in zip(rebuilt.lookups, rebuilt.fresh, strict=True):
            for _, kernel in lookup.named_modules():
                if isinstance(kernel, FusedOptimizerModule):
                    optimizer = kernel.fused_optimizer
                    if fresh:  # keyed as the TorchRec constructor keys them
                        optimizer.params = {
                            "embedding_bags." + key: value
                            for key, value in optimizer.params.items()
                        }
                    optims.append(("", optimizer))
        self._optim = CombinedOptimizer(optims)

        # Stock tables keep their state_dict entries (TorchRec's _initialize_torch_state
        # would also re-initialize their weights); the KV tables' entries are made again.
        kv_dims = {
            c.name: c.embedding_dim
            for c in self._embedding_bag_configs
            if c.name in self._kv_specs.options
        }
        container = self.embedding_bags
        for name in kv_dims:
            if name in container._modules:
                container[name] = nn.Module()
        devices = [table.device for table in tables.values()]
        install_table_entries(self, "embedding_bags", kv_dims, devices[0] if devices else None)


def _kv_parts(lookups: list[nn.Module], kv_lookup_type: Any) -> tuple[dict, dict]:
    tables, optimizers = {}, {}
    for lookup in lookups:
        while isinstance(lookup, nn.parallel.DistributedDataParallel):
            lookup = lookup.module
        if isinstance(lookup, kv_lookup_type):
            tables.update(lookup.kv_tables())
            optimizers.update(lookup.kv_fused_optimizers())
    return tables, optimizers


def _like(current: Any, modules: list[nn.Module]) -> Any:
    """``modules`` held as TorchRec's constructor holds ``current`` (a list or an
    ``nn.ModuleList``)."""
    return nn.ModuleList(modules) if isinstance(current, nn.ModuleList) else list(modules)
