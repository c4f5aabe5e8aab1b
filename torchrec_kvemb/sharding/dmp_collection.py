"""``KVDMPCollection``: TorchRec's ``DMPCollection`` (2D parallelism) whose ``sync()``
also keeps the replicas of KV tables equal by id (:mod:`.replica_sync`).

``DMPCollection.sync()`` averages fbgemm TBE weights and optimizer state by row
position over each context's ``replica_pg``; a KV shard holds its ids in slots of
its own insert history, so it needs the by-id merge of :class:`KVReplicaSync`
instead. A subclass, because ``TrainPipelineSparseDist`` calls ``sync()`` only on an
``isinstance(model, DMPCollection)``. Like ``DMPCollection`` it runs on CUDA (or
MTIA) only; on CPU the same sync is a ``DistributedModelParallel`` over a
``ShardingEnv2D`` plus :class:`KVReplicaSync` (docs/sharding.md, "2D parallelism").
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torchrec.distributed.model_parallel import DMPCollection
from torchrec.distributed.types import ShardingStrategy

from torchrec_kvemb.sharding.replica_sync import KVReplicaSync, kv_replica_sync_enabled


def kv_syncs_for_contexts(model: nn.Module, contexts: list[Any]) -> list[KVReplicaSync]:
    """One :class:`KVReplicaSync` per context (``DMPCollectionContext``: its
    ``replica_pg``) over the KV shards of ``model`` sharded in that context (their
    ``ShardingEnv2D`` holds the context's ``replica_pg``); contexts without KV tables
    get none. Collective over each context's ``replica_pg``."""
    from torchrec_kvemb.sharding.sharded_common import KVShardedMixin

    sharded = [(path, m) for path, m in model.named_modules() if isinstance(m, KVShardedMixin)]
    syncs = []
    for ctx in contexts:
        mine = [(p, m) for p, m in sharded if m.replica_group is ctx.replica_pg]
        if mine:
            tables = {f"{p}.{n}": t for p, m in mine for n, t in m.kv_tables().items()}
            syncs.append(KVReplicaSync(tables, ctx.replica_pg))
    return syncs


class KVDMPCollection(DMPCollection):
    """``DMPCollection`` whose ``sync()`` also syncs the KV tables' replicas by id.

    Takes ``DMPCollection``'s arguments; the KV sharders accept its ``ShardingEnv2D``
    (only here, or inside ``kv_replica_sync_enabled()``). Strategy ``DEFAULT`` only.

    Example::

        model = KVDMPCollection(
            module=model, device=torch.device("cuda"), plan=plan, world_size=8,
            sharding_group_size=4, global_pg=dist.GroupMember.WORLD,
            sharders=[KVEmbeddingBagCollectionSharder({"user": KVTableOptions(capacity=1 << 20)})],
        )
        loss.backward()
        model.sync()          # stock tables by position, KV tables by id
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with kv_replica_sync_enabled():
            super().__init__(*args, **kwargs)
        self._kv_syncs = kv_syncs_for_contexts(self._dmp_wrapped_module, self._ctxs)
        if self._kv_syncs:
            other = [
                c.sharding_strategy
                for c in self._ctxs
                if c.sharding_strategy != ShardingStrategy.DEFAULT
            ]
            if other:
                raise NotImplementedError(
                    f"KV tables {[n for s in self._kv_syncs for n in s.tables]}: replica sync "
                    f"serves sharding strategy DEFAULT only, got {other[0]}"
                )

    @property
    def kv_replica_syncs(self) -> list[KVReplicaSync]:
        """The KV replica syncs, one per context holding KV tables."""
        return list(self._kv_syncs)

    def sync(self, include_optimizer_state: bool = True) -> None:
        """Stock ``sync()`` for stock tables, then the KV tables by id (their optimizer
        state always moves with their rows: a row's state belongs to its id)."""
        super().sync(include_optimizer_state)
        for kv_sync in self._kv_syncs:
            kv_sync.sync()

    def reset_kv_replicas(self) -> None:
        """Take the KV shards as they are now as the synced baseline: call after loading
        a checkpoint into every replica (``torchrec_kvemb.checkpoint.load``)."""
        for kv_sync in self._kv_syncs:
            kv_sync.reset()
