"""Column-wise sharding of KV tables: column shards of one table, each holding every id.

TorchRec's column-wise sharding is table-wise over column shards: shard ``i`` of
a table is a ``[rows, cols_i]`` piece at column offset ``c_i`` on some rank, every
shard's rank gets all of the table's features, and the pooled pieces come back
concatenated by columns. For a KV table each column shard is a
:class:`~torchrec_kvemb.table.KVTable` of width ``cols_i`` with the table's
options (capacity, buckets, eviction policy, admission, seed) and
``column_offset = c_i``:

* its initial rows are the whole table's columns ``[c_i, c_i + cols_i)`` (rows
  are a function of (id, seed, column));
* every shard sees the same ids in the same order (the table-wise all-to-all
  sends the global batch, rank-major, to each shard's rank), and find-or-insert,
  eviction and admission are deterministic functions of the index and the ids:
  every shard stores the same ids in the same slots at every step, with no
  communication between shards.

Policies whose decisions depend on the rows or the gradient would let shards
disagree; none exists (LRU, LFU, NONE and CUSTOM_SCORE through DMP all score by
ids and step). Lower tiers (SSD, host memory) size themselves by row bytes, which
differ between shards: refused.

Example::

    plan = construct_module_sharding_plan(ebc, {"user": column_wise(ranks=[0, 1])},
                                          sharder=sharder, world_size=2, device_type="cpu")
"""

from __future__ import annotations

import torch
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.sharding.cw_sharding import CwPooledEmbeddingSharding
from torchrec.distributed.types import QuantizedCommCodecs, ShardingEnv, ShardingType

from torchrec_kvemb.sharding.kv_embedding import KVTableSpecs
from torchrec_kvemb.sharding.kv_lookup import KVLookupMixin


def check_column_shards(sharding_infos: list[EmbeddingShardingInfo], world_size: int) -> None:
    """Each column shard of a KV table on a rank of its own (a rank holds a table's
    shard by the table's name)."""
    for info in sharding_infos:
        ranks = list(info.param_sharding.ranks or [])
        doubled = sorted({r for r in ranks if ranks.count(r) > 1})
        if doubled:
            raise ValueError(
                f"table {info.embedding_config.name!r}: column-wise KV tables need each "
                f"column shard on a rank of its own; ranks {doubled} hold several "
                f"(plan ranks {ranks}). Give ParameterConstraints(min_partition=...) a "
                f"width that makes at most {world_size} shards, or plan the ranks"
            )


class KVCwPooledEmbeddingSharding(KVLookupMixin, CwPooledEmbeddingSharding):
    """TorchRec's column-wise pooled sharding with KV lookups: each column shard a
    ``KVTable`` of its width holding every id of the table (its full capacity).

    Example::

        sharding = KVCwPooledEmbeddingSharding(sharding_infos, env, device, specs=specs)
    """

    kv_sharding_type = ShardingType.COLUMN_WISE

    def __init__(
        self,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        *,
        specs: KVTableSpecs,
    ) -> None:
        check_column_shards(sharding_infos, env.world_size)
        super().__init__(
            sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry, specs=specs
        )
        # The output dist puts the shards back in column order (the stock sharded
        # EBC builds its CW shardings so: why a table's shards may sit on ranks in
        # any order).
        self._permute_embeddings = True
        self._init_combined_embeddings()

    def kv_num_shards(self) -> int:
        """Every column shard holds all of the table's ids: its whole capacity."""
        return 1
