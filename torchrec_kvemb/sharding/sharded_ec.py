"""The sharded sequence collection: TorchRec's ``ShardedEmbeddingCollection`` with KV tables.

Everything a stock sharded ``EmbeddingCollection`` does stays (input dists, the
sequence all-to-all of rows back to each id's place, ``JaggedTensor`` outputs,
the combined ``fused_optimizer``); tables whose plan says ``customized_kernel``
get a KV sequence sharding (:mod:`.sequence_shardings`) and are looked up by
:class:`~torchrec_kvemb.sharding.kv_sequence.KVEmbedding`. Tables without KV
options stay stock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.types import (
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_configs import EmbeddingConfig

from torchrec_kvemb.ec import KVEmbeddingCollection
from torchrec_kvemb.sharding.kv_embedding import KVTableSpecs
from torchrec_kvemb.sharding.kv_sequence import KVGroupedEmbeddingsLookup
from torchrec_kvemb.sharding.planner import check_plan
from torchrec_kvemb.sharding.reshard_sequences import KVSequenceResharding
from torchrec_kvemb.sharding.sequence_shardings import KV_SEQUENCE_SHARDINGS
from torchrec_kvemb.sharding.sharded_common import (
    KV_GROUP_PREFIX,
    KVModuleView,
    KVShardedMixin,
    kv_groups_first,
    sharding_group,
)
from torchrec_kvemb.state_dict.hooks import register_sharded_hooks

COLUMN_WISE = ShardingType.COLUMN_WISE.value


class _KVSequenceCollectionView(KVModuleView):
    """What ``ShardedEmbeddingCollection.__init__`` reads of a ``KVEmbeddingCollection``:
    its configs and ``meta`` placeholders."""

    def __init__(self, module: KVEmbeddingCollection) -> None:
        super().__init__(module, "embeddings", module.embedding_configs())

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


class _StockWeightsView:
    """A stock ``EmbeddingCollection`` as TorchRec's sharded collection reads it, with
    its KV tables' weights left out of ``state_dict()`` (0-row placeholders): built
    off the meta device, the stock module's weights are copied into the shards, which
    a KV table's rows never are (they are born from (id, seed), as when the module is
    on meta); the stock tables' weights are copied as TorchRec copies them."""

    def __init__(self, module: nn.Module, kv_tables: set[str]) -> None:
        self._module = module
        self._kv_keys = {f"embeddings.{name}.weight" for name in kv_tables}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            key: torch.empty(0, value.shape[-1], device="meta") if key in self._kv_keys else value
            for key, value in self._module.state_dict().items()
        }


class ShardedKVEmbeddingCollection(
    KVSequenceResharding, KVShardedMixin, ShardedEmbeddingCollection
):
    """A sharded ``EmbeddingCollection`` (or ``KVEmbeddingCollection``) whose KV tables
    are sharded row-wise, table-wise, column-wise or table-row-wise over ``KVTable``
    shards.

    Built by :class:`~torchrec_kvemb.KVEmbeddingCollectionSharder`; forward and
    ``fused_optimizer`` are TorchRec's. ``kv_tables()`` gives this rank's shards,
    ``metrics()`` their counters. ``state_dict()`` holds the KV tables' rows as
    ShardedTensors under ``embeddings.<table>.`` (a collective). ``update_shards``
    moves KV tables to a new plan in place (:mod:`.reshard`).

    Example::

        model = DistributedModelParallel(model, device=torch.device("cpu"),
                                         sharders=[KVEmbeddingCollectionSharder(options)])
        model.module.ec.kv_tables()["items"].size   # ids stored on this rank
    """

    kv_lookup_type = KVGroupedEmbeddingsLookup
    kv_configs_attribute = "_embedding_configs"

    def __init__(
        self,
        module: nn.Module,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(module, table_name_to_parameter_sharding, *args, **kwargs)
        self._kv_column_wise(module, table_name_to_parameter_sharding)

    def _kv_column_wise(self, module: nn.Module, plan: dict[str, ParameterSharding]) -> None:
        """What the stock module sets up for its ``column_wise`` sharding, for the KV one
        (under its own key): the width of the column shards, which must be one for
        every column-wise table (the stock module's rule), and how each feature's
        pieces go back in column order."""
        sharding = self._sharding_type_to_sharding.get(KV_GROUP_PREFIX + COLUMN_WISE)
        if sharding is None:
            return
        widths = {
            name: sorted({s.shard_sizes[1] for s in ps.sharding_spec.shards})
            for name, ps in plan.items()
            if ps.sharding_type == COLUMN_WISE
        }
        if len({w for ws in widths.values() for w in ws}) != 1:
            raise ValueError(
                f"column-wise sequence tables need column shards of one width, got {widths} "
                "(TorchRec's EmbeddingCollection rule, KV tables alike)"
            )
        if COLUMN_WISE not in self._sharding_type_to_sharding:
            self._local_embedding_dim = next(iter(widths.values()))[0]
            self._generate_permute_indices_per_feature(module.embedding_configs(), plan)

    def _embedding_dim_for_sharding_type(self, sharding_type: str) -> int:
        """The stock answer for KV shardings too (their key has a prefix)."""
        return super()._embedding_dim_for_sharding_type(sharding_type.removeprefix(KV_GROUP_PREFIX))

    def kv_module_to_shard(
        self, module: nn.Module, specs: KVTableSpecs, plan: dict[str, ParameterSharding]
    ) -> nn.Module:
        check_plan(specs.options, module.embedding_configs(), plan, list(KV_SEQUENCE_SHARDINGS))
        self.__dict__["_kv_unsharded_type"] = type(module)
        if isinstance(module, KVEmbeddingCollection):
            return _KVSequenceCollectionView(module)
        if module.device != torch.device("meta"):
            return _StockWeightsView(module, set(specs.options))
        return module

    # ------------------------------------------------- base class hooks
    def create_grouped_sharding_infos(
        self,
        module: Any,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        fused_params: dict[str, Any] | None,
    ) -> dict[str, list[EmbeddingShardingInfo]]:
        """The stock grouping, with KV tables under their own keys, KV first (kept:
        a reshard builds its new shardings beside these, see :meth:`kv_sharding_infos`)."""
        infos = self.grouped_kv_infos(module, table_name_to_parameter_sharding, fused_params)
        self.keep_kv_sharding_infos(infos)
        return infos

    def grouped_kv_infos(
        self,
        module: Any,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        fused_params: dict[str, Any] | None,
    ) -> dict[str, list[EmbeddingShardingInfo]]:
        """The stock grouping of ``module``'s tables for a plan, with KV tables under
        their own keys, KV first; nothing kept."""
        return kv_groups_first(
            super().create_grouped_sharding_infos(
                module, table_name_to_parameter_sharding, fused_params
            )
        )

    def keep_kv_sharding_infos(self, infos: dict[str, list[EmbeddingShardingInfo]]) -> None:
        """Keep the sharding infos the collection is built from."""
        self._kv_infos = infos

    def kv_sharding_infos(self) -> dict[str, list[EmbeddingShardingInfo]]:
        """The sharding infos (by sharding key) the collection's shardings are built from
        (TorchRec's sequence collection keeps none, the bag collection keeps
        ``sharding_type_to_sharding_infos``)."""
        return self._kv_infos

    @property
    def unsharded_module_type(self) -> type[nn.Module]:
        """The type of the module sharded (``EmbeddingCollection`` or
        ``KVEmbeddingCollection``): ``DistributedModelParallel.reshard`` finds the
        sharder by it."""
        return self._kv_unsharded_type

    def check_kv_plan(self, plan: Mapping[str, ParameterSharding]) -> None:
        """Raise ``ValueError`` naming the table where ``plan`` does not fit this
        collection's tables (what ``shard()`` checks)."""
        check_plan(
            self._kv_specs.options, self._embedding_configs, plan, list(KV_SEQUENCE_SHARDINGS)
        )

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

    def _initialize_torch_state(self, skip_registering: bool = False) -> None:
        """The stock state_dict entries, plus the KV tables' (docs/checkpoint-format.md)."""
        super()._initialize_torch_state(skip_registering)
        if not skip_registering:
            register_sharded_hooks(self, sharding_group(self._env), attribute="embeddings")
