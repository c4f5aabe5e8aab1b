"""KV tables in ``state_dict()`` and ``load_state_dict()``.

Per table, under TorchRec's prefix ``embedding_bags.<table>.`` (the full
contract, with the sharded layout: docs/checkpoint-format.md):

==================  ==================  =======  ==========================================
key                 shape               dtype    meaning
==================  ==================  =======  ==========================================
``weight``          ``[rows, dim]``     float32  the rows (in the table's ``weights_dtype``)
``weight_id``       ``[rows]``          int64    the id of each row
``weight_score``    ``[rows]``          int64    its eviction score
``<state>``         ``[rows]`` or       float32  optimizer state: ``momentum1`` (row-wise
                    ``[rows, dim]``              Adagrad), ``exp_avg`` / ``exp_avg_sq`` (Adam)
``bucket``          ``[G]``             int64    rows per routing bucket
``step``            ``[2]``             int64    training lookups (the LRU clock), optimizer
                                                 steps (Adam's bias correction)
``admission_id``,   ``[n]``             int64    ids waiting for admission, their sightings
``admission_count``,                             and counter scores (tables with
``admission_score``                              ``admission_threshold > 1`` only)
==================  ==================  =======  ==========================================

A TTL table whose policy is not LRU adds ``weight_last_seen`` (``[rows]`` int64):
each row's last training step (an LRU table's ``weight_score`` is it).

Rows (and admission entries) are sorted by routing bucket
(:func:`~torchrec_kvemb.ops.hashing.route_bucket` over ``G =
total_num_buckets``), then by id. Unsharded, the values are plain tensors.
Sharded, they are ``ShardedTensor``s with one shard per rank holding that rank's
rows. A sharded module's ``state_dict()`` is a collective: call it on every rank.

Modules: :mod:`.layout` (where a model's KV tables are: ``TableLayout``,
``kv_table_slots``), :mod:`.rows` (a table's entries, ``TableRows``,
``restore_table``), :mod:`.entries` (entries given to a load, read into
``TableRows``), :mod:`.checks` (``CheckpointError`` and the checks before a
load), :mod:`.sharded` (ShardedTensor assembly), :mod:`.hooks` (the hooks KV
modules register), :mod:`.attributes` (each key as an attribute path, for
torch's ``get_model_state_dict`` / ``set_model_state_dict`` and TorchRec's
composable ``shard``).

Example::

    from torchrec_kvemb.state_dict import kv_table_slots

    for prefix, slot in kv_table_slots(model).items():
        print(prefix, slot.layout.name, slot.optimizer)
"""

from torchrec_kvemb.state_dict.attributes import (
    KVStateKey,
    KVTableEntries,
    install_table_entries,
)
from torchrec_kvemb.state_dict.checks import (
    CheckpointError,
    check_bucket_counts,
    check_fits,
    check_ids,
    check_state,
    check_table_rows,
)
from torchrec_kvemb.state_dict.entries import is_distributed, local_rows, rows_from_entries
from torchrec_kvemb.state_dict.hooks import register_sharded_hooks, register_unsharded_hooks
from torchrec_kvemb.state_dict.layout import (
    KVTableDescription,
    KVTableSlot,
    TableLayout,
    describe_state_dict,
    kv_table_slots,
    owned_buckets,
    sharded_layouts,
)
from torchrec_kvemb.state_dict.rows import (
    ADMISSION_KEYS,
    KNOWN_KEYS,
    ROW_KEYS,
    STATE_NAMES,
    TableRows,
    admission_state,
    restore_table,
    table_rows,
    table_state,
    warn_dropped,
)
from torchrec_kvemb.state_dict.sharded import (
    RowCounts,
    gather_row_counts,
    row_sharded_tensor,
    sharded_entries,
)

__all__ = [
    "ADMISSION_KEYS",
    "KNOWN_KEYS",
    "ROW_KEYS",
    "STATE_NAMES",
    "CheckpointError",
    "KVStateKey",
    "KVTableDescription",
    "KVTableEntries",
    "KVTableSlot",
    "RowCounts",
    "TableLayout",
    "TableRows",
    "admission_state",
    "check_fits",
    "check_bucket_counts",
    "check_ids",
    "check_state",
    "check_table_rows",
    "describe_state_dict",
    "gather_row_counts",
    "install_table_entries",
    "is_distributed",
    "kv_table_slots",
    "local_rows",
    "owned_buckets",
    "register_sharded_hooks",
    "register_unsharded_hooks",
    "restore_table",
    "row_sharded_tensor",
    "rows_from_entries",
    "sharded_entries",
    "sharded_layouts",
    "table_rows",
    "table_state",
    "warn_dropped",
]
