"""Resharding a sequence collection in place: the sequence half of :mod:`.reshard`.

``ShardedKVEmbeddingCollection`` mixes :class:`KVSequenceResharding` in: its KV
shardings for a new plan come from ``create_grouped_sharding_infos`` and
``create_embedding_sharding`` (the factory ``KV_SEQUENCE_SHARDINGS`` feeds), and
the switch resets what TorchRec's ``ShardedEmbeddingCollection`` derives from
its shardings (input and output dists, embedding names per sharding, the feature
score mapping).

Example::

    dmp.module.ec.update_shards({"items": new_parameter_sharding}, env, None)
"""

from __future__ import annotations

from typing import Any

from torchrec.distributed.feature_score_utils import create_sharding_type_to_feature_score_mapping
from torchrec.distributed.types import ParameterSharding, ShardingEnv

from torchrec_kvemb.sharding.reshard import (
    KVResharding,
    ParamsView,
    Rebuilt,
    held_like,
    rebuild_shardings,
)


class KVSequenceResharding(KVResharding):
    """``update_shards`` of ``ShardedKVEmbeddingCollection`` (see :mod:`.reshard`).

    Example::

        dmp.reshard({"ec": (0.0, {"items": new_parameter_sharding})}, "ec")
    """

    kv_attribute = "embeddings"

    def _kv_rebuild(
        self, plan: dict[str, ParameterSharding], env: ShardingEnv, device: Any
    ) -> Rebuilt:
        """New KV shardings and lookups (empty tables) for ``plan``, through the same
        factories the constructor uses; the stock ones as they are. Nothing changes."""
        old_infos = self.kv_sharding_infos()
        by_name = {i.embedding_config.name: i for group in old_infos.values() for i in group}
        configs = self._embedding_configs
        view = ParamsView("embedding_configs", configs, "embeddings", old_infos)
        view.embedding_names_by_table = lambda: [
            by_name[c.name].embedding_config.embedding_names for c in configs
        ]
        infos = self.grouped_kv_infos(view, plan, self._kv_fused_params)
        return rebuild_shardings(
            infos,
            old_infos,
            self._sharding_type_to_sharding,
            dict(zip(self._sharding_types, self._lookups, strict=True)),
            lambda key, group: self.create_embedding_sharding(
                key, group, env, device, qcomm_codecs_registry=self.qcomm_codecs_registry
            ),
        )

    def _kv_switch(
        self, plan: dict[str, ParameterSharding], rebuilt: Rebuilt, tables: dict
    ) -> None:
        """Make the rebuilt shardings the collection's: plan, infos, shardings, lookups,
        input and output dists, embedding names, fused optimizer, state_dict entries."""
        for name, sharding in plan.items():
            self.module_sharding_plan[name] = sharding
        self.keep_kv_sharding_infos(rebuilt.infos)
        self._sharding_types = list(rebuilt.infos)
        self._sharding_type_to_sharding = dict(
            zip(self._sharding_types, rebuilt.shardings, strict=True)
        )
        self._lookups = held_like(self._lookups, rebuilt.lookups)
        self._output_dists = held_like(
            self._output_dists, [s.create_output_dist() for s in rebuilt.shardings]
        )
        self._embedding_names_per_sharding = [s.embedding_names() for s in rebuilt.shardings]
        self._inverse_indices_permute_per_sharding = None

        # The input dists are built again at the next batch (as after the constructor).
        self._has_uninitialized_input_dist = True
        self._input_dists = held_like(self._input_dists, [])
        self._features_order.clear()
        self._feature_splits.clear()
        (
            self._enable_feature_score_weight_accumulation,
            self._enabled_feature_score_auto_collection,
            self._sharding_type_feature_score_mapping,
        ) = create_sharding_type_to_feature_score_mapping(self._embedding_configs, rebuilt.infos)

        self.kv_switch_optimizer_and_entries(rebuilt, tables)
