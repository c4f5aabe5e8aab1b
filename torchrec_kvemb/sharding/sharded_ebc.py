"""The sharded collection: TorchRec's ``ShardedEmbeddingBagCollection`` with KV tables.

Everything a stock sharded EBC does stays (feature permutation and split per
sharding, the two-stage input dist that ``TrainPipelineSparseDist`` fuses,
pooled all-to-all / reduce-scatter with autograd, ``KeyedTensor`` assembly,
the combined ``fused_optimizer``); tables whose plan says ``customized_kernel``
get a KV sharding (:mod:`.rw`, :mod:`.tw`, :mod:`.cw`, :mod:`.twrw`) instead of the
stock one. Tables without KV options in the same collection take the untouched stock path.

Gradients: TorchRec's pooled output dists divide the gradient by the world
size in backward (``torchrec.distributed.comm_ops``, gradient division on by
default). A sharded run therefore matches an unsharded one whose loss is the
mean of the ranks' losses (or their sum with the learning rate divided by the
world size), for KV and stock tables alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionContext,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.types import (
    Awaitable,
    LazyAwaitable,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_kvemb.ebc import KVEmbeddingBagCollection
from torchrec_kvemb.sharding.cw import KVCwPooledEmbeddingSharding
from torchrec_kvemb.sharding.kv_embedding import (
    KVGroupedPooledEmbeddingsLookup,
    KVTableSpecs,
)
from torchrec_kvemb.sharding.kv_sequence import KVGroupedEmbeddingsLookup
from torchrec_kvemb.sharding.planner import KV_COMPUTE_KERNEL, check_plan
from torchrec_kvemb.sharding.reshard_bags import KVBagResharding
from torchrec_kvemb.sharding.rw import KVRwPooledEmbeddingSharding
from torchrec_kvemb.sharding.rw_dedup import (
    KVDedupBagContext,
    KVDedupBagFeaturesDist,
    KVRwDedupPooledEmbeddingSharding,
)
from torchrec_kvemb.sharding.sharded_common import (
    KV_GROUP_PREFIX,
    KVModuleView,
    KVShardedMixin,
    kv_groups_first,
    sharding_group,
)
from torchrec_kvemb.sharding.tw import KVTwPooledEmbeddingSharding
from torchrec_kvemb.sharding.twrw import KVTwRwPooledEmbeddingSharding
from torchrec_kvemb.state_dict.hooks import register_sharded_hooks

_KV_SHARDINGS = {
    ShardingType.ROW_WISE.value: KVRwPooledEmbeddingSharding,
    ShardingType.TABLE_WISE.value: KVTwPooledEmbeddingSharding,
    ShardingType.COLUMN_WISE.value: KVCwPooledEmbeddingSharding,
    ShardingType.TABLE_ROW_WISE.value: KVTwRwPooledEmbeddingSharding,
}
#: Sharding types a KV table may have.
KV_SHARDING_TYPES = list(_KV_SHARDINGS)


def check_bag_plan(
    kv_tables: Mapping[str, Any],
    configs: list[EmbeddingBagConfig],
    plan: Mapping[str, ParameterSharding],
) -> None:
    """``planner.check_plan`` for a bag collection, and KV tables pool by SUM or MEAN."""
    check_plan(kv_tables, configs, plan, KV_SHARDING_TYPES)
    for config in configs:
        if config.name in kv_tables and config.pooling not in (PoolingType.SUM, PoolingType.MEAN):
            raise ValueError(f"table {config.name!r}: pooling {config.pooling} not supported")


class _KVCollectionView(KVModuleView):
    """What ``ShardedEmbeddingBagCollection.__init__`` reads of a
    ``KVEmbeddingBagCollection``: configs, weightedness, ``meta`` placeholders."""

    def __init__(self, module: KVEmbeddingBagCollection) -> None:
        super().__init__(module, "embedding_bags", module.embedding_bag_configs())

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._module.embedding_bag_configs()

    def is_weighted(self) -> bool:
        return self._module.is_weighted()


class ShardedKVEmbeddingBagCollection(
    KVBagResharding, KVShardedMixin, ShardedEmbeddingBagCollection
):
    """A sharded ``EmbeddingBagCollection`` (or ``KVEmbeddingBagCollection``) whose
    KV tables are sharded row-wise, table-wise, column-wise or table-row-wise over
    ``KVTable`` shards.

    Built by :class:`~torchrec_kvemb.KVEmbeddingBagCollectionSharder`; forward,
    ``input_dist`` / ``compute_and_output_dist`` and ``fused_optimizer`` are
    TorchRec's. ``kv_tables()`` gives this rank's shards, ``metrics()`` their
    counters, ``kv_fused_optimizers()`` the optimizers whose ``lr`` drives them.
    ``state_dict()`` holds the KV tables' rows as ShardedTensors (a collective:
    call it on every rank; see docs/checkpoint-format.md). ``update_shards`` (what
    ``DistributedModelParallel.reshard`` calls) moves KV tables to a new plan in
    place (:mod:`.reshard`).

    Example::

        model = DistributedModelParallel(model, device=torch.device("cpu"),
                                         sharders=[KVEmbeddingBagCollectionSharder(options)])
        sharded = model.module.ebc   # ShardedKVEmbeddingBagCollection
        sharded.kv_tables()["user"].size   # ids stored on this rank
    """

    #: Row-wise KV bags under ``use_index_dedup`` look ids up as a sequence lookup.
    kv_lookup_type = (KVGroupedPooledEmbeddingsLookup, KVGroupedEmbeddingsLookup)
    kv_configs_attribute = "_embedding_bag_configs"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pool_kv_mean_by_sum()

    def kv_module_to_shard(
        self, module: nn.Module, specs: KVTableSpecs, plan: dict[str, ParameterSharding]
    ) -> nn.Module:
        check_bag_plan(specs.options, module.embedding_bag_configs(), plan)
        self.__dict__["_kv_unsharded_type"] = type(module)
        if isinstance(module, KVEmbeddingBagCollection):
            return _KVCollectionView(module)
        return module

    @property
    def unsharded_module_type(self) -> type[nn.Module]:
        """The type of the module sharded (``EmbeddingBagCollection`` or
        ``KVEmbeddingBagCollection``): ``DistributedModelParallel.reshard`` finds the
        sharder by it."""
        return self._kv_unsharded_type

    def check_kv_plan(self, plan: Mapping[str, ParameterSharding]) -> None:
        """Raise ``ValueError`` naming the table where ``plan`` does not fit this
        collection's tables (what ``shard()`` checks)."""
        check_bag_plan(self._kv_specs.options, self._embedding_bag_configs, plan)

    # ------------------------------------------------- base class hooks
    def create_grouped_sharding_infos(
        self,
        module: Any,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        prefix: str,
        fused_params: dict[str, Any] | None,
        suffix: str | None = "weight",
    ) -> dict[str, list[EmbeddingShardingInfo]]:
        """The stock grouping, with KV tables under their own keys, KV first; under
        ``use_index_dedup``, row-wise KV tables by embedding dim (a deduplicated
        sharding sends rows of one width)."""
        infos = kv_groups_first(
            super().create_grouped_sharding_infos(
                module, table_name_to_parameter_sharding, prefix, fused_params, suffix
            )
        )
        key = KV_GROUP_PREFIX + ShardingType.ROW_WISE.value
        if not self._use_index_dedup or key not in infos:
            return infos
        by_dim: dict[str, list[EmbeddingShardingInfo]] = {}
        for info in infos[key]:
            by_dim.setdefault(f"{key}:dim{info.embedding_config.embedding_dim}", []).append(info)
        out = {}
        for name, group in infos.items():
            out.update(by_dim if name == key else {name: group})
        return out

    def create_embedding_bag_sharding(
        self,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        permute_embeddings: bool = False,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    ) -> EmbeddingSharding:
        """A KV sharding for KV groups, the stock one otherwise."""
        param_sharding = sharding_infos[0].param_sharding
        if param_sharding.compute_kernel != KV_COMPUTE_KERNEL:
            return super().create_embedding_bag_sharding(
                sharding_infos, env, device, permute_embeddings, qcomm_codecs_registry
            )
        sharding_cls = _KV_SHARDINGS[param_sharding.sharding_type]
        if self._use_index_dedup:
            if param_sharding.sharding_type != ShardingType.ROW_WISE.value:
                names = sorted(i.embedding_config.name for i in sharding_infos)
                raise ValueError(
                    f"use_index_dedup: KV bag tables {names} are planned "
                    f"{param_sharding.sharding_type}; index dedup of KV bags is row-wise "
                    "only: constrain them to row_wise or drop use_index_dedup"
                )
            sharding_cls = KVRwDedupPooledEmbeddingSharding
        return sharding_cls(
            sharding_infos,
            env,
            device,
            qcomm_codecs_registry=qcomm_codecs_registry,
            specs=self._kv_specs,
        )

    def input_dist(
        self, ctx: EmbeddingBagCollectionContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KJTList]]:
        """The stock input dist; a deduplicated sharding's context (its batch, where its
        ids went) replaces the stock one (:mod:`.rw_dedup`)."""
        awaitable = super().input_dist(ctx, features)
        for i, input_dist in enumerate(self._input_dists):
            if isinstance(input_dist, KVDedupBagFeaturesDist):
                ctx.sharding_contexts[i] = input_dist.context(ctx.sharding_contexts[i])
        return awaitable

    def compute_and_output_dist(
        self, ctx: EmbeddingBagCollectionContext, input: KJTList
    ) -> LazyAwaitable[KeyedTensor]:
        """The stock step; a deduplicated sharding's context first records the ids'
        lengths after the input dist (its sequence all-to-all sends rows back by them)."""
        for features, sharding_ctx in zip(input, ctx.sharding_contexts, strict=True):
            if isinstance(sharding_ctx, KVDedupBagContext):
                sharding_ctx.lengths_after_input_dist = features.lengths().view(
                    -1, features.stride()
                )
        return super().compute_and_output_dist(ctx, input)

    def _initialize_torch_state(self, skip_registering: bool = False) -> None:
        """The stock state_dict entries, plus the KV tables' (docs/checkpoint-format.md)."""
        super()._initialize_torch_state(skip_registering)
        if not skip_registering:
            register_sharded_hooks(self, sharding_group(self._env))

    def _pool_kv_mean_by_sum(self) -> None:
        """Row-wise KV MEAN tables get their ``1 / bag length`` per id in the input dist
        (see :func:`~torchrec_kvemb.sharding.rw.bucketize_kv_features`), so the stock
        mean divisor, applied after the reduce-scatter, must leave them alone."""
        mean_key, sum_key = PoolingType.MEAN.value, PoolingType.SUM.value
        kv_features = {
            f
            for c in self._embedding_bag_configs
            if c.name in self._kv_specs.options and c.pooling == PoolingType.MEAN
            for f in c.feature_names
        }
        moved = [f for f in self._pooling_type_to_rs_features[mean_key] if f in kv_features]
        if not moved:
            return
        kept = [f for f in self._pooling_type_to_rs_features[mean_key] if f not in kv_features]
        if kept:
            self._pooling_type_to_rs_features[mean_key] = kept
        else:
            del self._pooling_type_to_rs_features[mean_key]
        self._pooling_type_to_rs_features[sum_key].extend(moved)
        self._has_mean_pooling_callback = bool(kept)
