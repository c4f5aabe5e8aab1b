"""Resharding a bag collection in place: the bag half of :mod:`.reshard`.

``ShardedKVEmbeddingBagCollection`` mixes :class:`KVBagResharding` in: its KV
shardings for a new plan come from ``create_grouped_sharding_infos`` and
``create_embedding_bag_sharding`` (the factory ``_KV_SHARDINGS`` feeds), and the
switch resets what TorchRec's ``ShardedEmbeddingBagCollection`` derives from its
shardings (input and output dists, the reduce-scatter feature lists of MEAN
pooling, the feature score mapping).

Example::

    dmp.module.ebc.update_shards({"user": new_parameter_sharding}, env, None)
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torchrec.distributed.feature_score_utils import create_sharding_type_to_feature_score_mapping
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import PoolingType

from torchrec_kvemb.sharding.reshard import (
    KVResharding,
    ParamsView,
    Rebuilt,
    held_like,
    rebuild_shardings,
)

_ROW_WISE_TYPES = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)


class KVBagResharding(KVResharding):
    """``update_shards`` of ``ShardedKVEmbeddingBagCollection`` (see :mod:`.reshard`).

    Example::

        dmp.reshard({"ebc": (0.0, {"user": new_parameter_sharding})}, "ebc")
    """

    kv_attribute = "embedding_bags"

    def _kv_rebuild(
        self, plan: dict[str, ParameterSharding], env: ShardingEnv, device: Any
    ) -> Rebuilt:
        """New KV shardings and lookups (empty tables) for ``plan``, through the same
        factories the constructor uses; the stock ones as they are. Nothing changes."""
        old_infos = self.sharding_type_to_sharding_infos
        view = ParamsView(
            "embedding_bag_configs", self._embedding_bag_configs, "embedding_bags", old_infos
        )
        view.is_weighted = lambda: self._is_weighted
        infos = self.create_grouped_sharding_infos(
            view, plan, "embedding_bags.", self._kv_fused_params
        )
        return rebuild_shardings(
            infos,
            old_infos,
            dict(zip(self._sharding_types, self._embedding_shardings, strict=True)),
            dict(zip(self._sharding_types, self._lookups, strict=True)),
            lambda _key, group: self.create_embedding_bag_sharding(
                group,
                env,
                device,
                permute_embeddings=True,
                qcomm_codecs_registry=self.qcomm_codecs_registry,
            ),
        )

    def _kv_switch(
        self, plan: dict[str, ParameterSharding], rebuilt: Rebuilt, tables: dict
    ) -> None:
        """Make the rebuilt shardings the collection's: plan, infos, shardings, lookups,
        input and output dists, mean pooling divisors, fused optimizer, state_dict
        entries."""
        for name, sharding in plan.items():
            self.module_sharding_plan[name] = sharding
        self.sharding_type_to_sharding_infos = rebuilt.infos
        self._sharding_types = list(rebuilt.infos)
        self._embedding_shardings = rebuilt.shardings
        self._lookups = held_like(self._lookups, rebuilt.lookups)

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
        self._input_dists = held_like(self._input_dists, [])
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

        self.kv_switch_optimizer_and_entries(rebuilt, tables)
