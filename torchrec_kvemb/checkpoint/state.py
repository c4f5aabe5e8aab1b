"""KV tables in ``state_dict()`` and ``load_state_dict()``.

Per table, under TorchRec's prefix ``embedding_bags.<table>.`` (the full
contract, with the sharded layout: docs/checkpoint-format.md):

==================  ==================  =======  ==========================================
key                 shape               dtype    meaning
==================  ==================  =======  ==========================================
``weight``          ``[rows, dim]``     float32  the rows
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

Rows (and admission entries) are sorted by routing bucket
(:func:`~torchrec_kvemb.ops.hashing.route_bucket` over ``G =
total_num_buckets``), then by id. Unsharded, the values are plain tensors.
Sharded, they are ``ShardedTensor``s with one shard per rank holding that rank's
rows: a row-wise rank owns a contiguous range of buckets, so rank order is
bucket order and the global tensor is the table a single rank would hold.
``bucket`` is sharded by bucket range; ``step`` is a plain tensor (equal on
every rank). A sharded module's ``state_dict()`` is a collective (one
``all_gather_object`` for the row counts): call it on every rank.

``load_state_dict`` replaces each table's content: it takes plain tensors (the
whole table; a sharded rank keeps the ids it owns) or ShardedTensors (their
local shards). Every table is checked before any changes (dim, optimizer state
set, ids), errors name the table.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

from torchrec_kvemb.ops.hashing import route_bucket
from torchrec_kvemb.table import KVTable

#: Optimizer state names of every supported optimizer (``FusedOptimConfig.state_names``).
STATE_NAMES = ("momentum1", "exp_avg", "exp_avg_sq")
ROW_KEYS = ("weight", "weight_id", "weight_score")
ADMISSION_KEYS = ("admission_id", "admission_count", "admission_score")
KNOWN_KEYS = frozenset(ROW_KEYS + STATE_NAMES + ADMISSION_KEYS + ("bucket", "step"))


class CheckpointError(ValueError):
    """A state_dict or checkpoint that does not fit the model; nothing was changed."""


# ------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class TableLayout:
    """One KV table of a module as this rank sees it.

    ``table``: this rank's shard (None where a table-wise table lives on another
    rank). ``owned``: the routing buckets ``[lo, hi)`` this rank stores, None
    for none.
    """

    name: str
    dim: int
    num_buckets: int
    table: KVTable | None
    owned: tuple[int, int] | None
    admission: bool
    #: ``"unsharded"``, ``"row_wise"`` or ``"table_wise"``.
    sharding: str = "unsharded"
    #: Sharded: the ``KVFusedOptimizer`` whose ``lr`` drives this shard (shared by
    #: the tables of its grouped config). Unsharded: None, ``table.optim`` does.
    fused_optimizer: Any = field(default=None, compare=False, repr=False)

    def learning_rate(self) -> float | None:
        """The fused optimizer's current learning rate for this table (None where
        this rank holds no shard of it)."""
        return None if self.table is None else self.table.learning_rate

    def set_learning_rate(self, lr: float) -> None:
        """Make ``lr`` the learning rate of the next update (sharded: of every table
        sharing this shard's fused optimizer)."""
        if self.table is not None:
            self.table.learning_rate = lr

    def owns(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of ``ids`` this rank stores."""
        if self.owned is None:
            return torch.zeros_like(ids, dtype=torch.bool)
        lo, hi = self.owned
        if (lo, hi) == (0, self.num_buckets):
            return torch.ones_like(ids, dtype=torch.bool)
        buckets = route_bucket(ids, self.num_buckets)
        return (buckets >= lo) & (buckets < hi)


@dataclass(frozen=True)
class KVTableSlot:
    """What ``state_dict()`` holds for a KV table under :func:`describe_kv_tables`:
    no rows, just where the table is (used by ``torchrec_kvemb.checkpoint.load``)."""

    layout: TableLayout
    #: The fused optimizer (``OptimKind`` value) and its state tensors' shapes per
    #: row (``FusedOptimConfig.state_shapes``), where this rank holds the table
    #: (None elsewhere).
    optimizer: str | None
    state_shapes: dict[str, tuple[int, ...]] | None


_DESCRIBE = {"on": False}


@contextlib.contextmanager
def describe_kv_tables() -> Iterator[None]:
    """Within this block, ``state_dict()`` puts one :class:`KVTableSlot` per KV table
    under its ``weight`` key instead of rows (no export, no collective)."""
    previous = _DESCRIBE["on"]
    _DESCRIBE["on"] = True
    try:
        yield
    finally:
        _DESCRIBE["on"] = previous


# --------------------------------------------------------------- the rows
@dataclass
class TableRows:
    """A table's content: ids with their rows, scores and optimizer state."""

    ids: torch.Tensor
    weights: torch.Tensor
    #: Eviction scores, None to keep those the insert gives.
    scores: torch.Tensor | None
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    #: (training lookups, optimizer steps), None to leave the table's counters.
    step: tuple[int, int] | None = None
    #: (ids, sightings, counter scores) waiting for admission, None when absent.
    admission: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def select(self, keep: torch.Tensor) -> TableRows:
        """The rows where ``keep`` is True (admission entries unchanged)."""
        if bool(keep.all()):
            return self
        return TableRows(
            self.ids[keep],
            self.weights[keep],
            None if self.scores is None else self.scores[keep],
            {k: v[keep] for k, v in self.state.items()},
            self.step,
            self.admission,
        )


def bucket_order(ids: torch.Tensor, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, buckets)``: the permutation that sorts id-sorted ``ids`` by routing
    bucket (then id), and the sorted bucket numbers."""
    buckets, order = torch.sort(route_bucket(ids, num_buckets), stable=True)
    return order, buckets


def table_state(table: KVTable) -> dict[str, torch.Tensor]:
    """A table's state_dict entries (key suffixes after ``embedding_bags.<table>.``),
    rows sorted by routing bucket, then id."""
    num_buckets = table.options.total_num_buckets
    data = table.export(route_buckets=num_buckets)
    out = {"weight": data["weights"], "weight_id": data["ids"], "weight_score": data["scores"]}
    for name in table.optim.state_names():
        out[name] = data[name]
    out["bucket"] = torch.bincount(route_bucket(data["ids"], num_buckets), minlength=num_buckets)
    out["step"] = torch.tensor([table.step, table.optim_step], dtype=torch.int64)
    if table.options.admission_threshold > 1:
        out.update(zip(ADMISSION_KEYS, admission_state(table), strict=True))
    return out


def admission_state(table: KVTable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, sightings, scores)`` of the ids the admission counter tracks, sorted by
    routing bucket, then id (empty for a table without admission)."""
    ids, counts, scores = table.admission_entries()
    ids, by_id = torch.sort(ids)
    order, _ = bucket_order(ids, table.options.total_num_buckets)
    entry = by_id[order]
    return ids[order], counts[entry], scores[entry]


# ---------------------------------------------------------------- checks
def check_table_rows(
    name: str,
    dim: int,
    state_shapes: Mapping[str, tuple[int, ...]],
    rows: TableRows,
    num_buckets: int | None = None,
) -> None:
    """Shapes, dtypes, optimizer state set and ids of a table's rows; raises
    :class:`CheckpointError` naming the table. ``num_buckets``: the routing bucket
    count the rows may be sorted by (their order then proves the ids unique)."""

    def fail(message: str) -> None:
        raise CheckpointError(f"table {name!r}: {message}")

    n = rows.ids.numel()
    if rows.ids.dim() != 1 or rows.ids.dtype != torch.int64:
        fail(f"weight_id must be a 1-D int64 tensor, got {rows.ids.dtype} {tuple(rows.ids.shape)}")
    if rows.weights.dim() != 2 or not rows.weights.is_floating_point():
        fail(f"weight must be a 2-D float tensor, got {tuple(rows.weights.shape)}")
    if rows.weights.shape[1] != dim:
        fail(f"weight has dim {rows.weights.shape[1]}, the table has dim {dim}")
    if rows.weights.shape[0] != n:
        fail(f"weight has {rows.weights.shape[0]} rows but weight_id has {n}")
    if rows.scores is not None and (
        tuple(rows.scores.shape) != (n,) or rows.scores.is_floating_point()
    ):
        fail(f"weight_score must be an integer tensor of {n} entries")
    given = sorted(rows.state)
    if given != sorted(state_shapes):
        fail(
            f"optimizer state {given or 'none'} does not match the table's optimizer, "
            f"which keeps {sorted(state_shapes) or 'none'}"
        )
    for key, value in rows.state.items():
        want = (n, *state_shapes[key])
        if tuple(value.shape) != want or not value.is_floating_point():
            fail(f"{key} must be a float tensor of shape {want}, got {tuple(value.shape)}")
    if n and bool((rows.ids < 0).any()):
        fail("weight_id holds negative ids")
    if not _sorted_unique(rows.ids, num_buckets) and n != torch.unique(rows.ids).numel():
        fail("weight_id holds an id twice")
    if rows.admission is not None:
        ids, counts, scores = rows.admission
        if not (ids.shape == counts.shape == scores.shape) or ids.dim() != 1:
            fail("admission_id, admission_count and admission_score must be 1-D of one length")


def _sorted_unique(ids: torch.Tensor, num_buckets: int | None) -> bool:
    """Whether ``ids`` are sorted by routing bucket, then strictly by id (so unique:
    an id has one bucket)."""
    if ids.numel() < 2 or num_buckets is None:
        return ids.numel() < 2
    buckets = route_bucket(ids, num_buckets)
    same = buckets[1:] == buckets[:-1]
    return bool((buckets[1:] >= buckets[:-1]).all()) and bool((ids[1:] > ids[:-1])[same].all())


def check_fits(table: KVTable, rows: TableRows) -> None:
    """A table without an SSD tier cannot take more rows than its capacity."""
    if table.ssd is None and rows.ids.numel() > table.capacity:
        raise CheckpointError(
            f"table {table.name!r}: {rows.ids.numel()} rows do not fit its capacity "
            f"{table.capacity} (this shard)"
        )


# --------------------------------------------------------------- restore
def restore_table(table: KVTable, rows: TableRows) -> int:
    """Replace the table's content by ``rows`` (checked already); returns how many
    rows found no room (a full index bucket), after a warning.

    With an SSD tier, each index bucket keeps its rows of the highest scores in
    memory (then smallest ids, as a fresh insert ranks them) and the others go to
    the SSD tier; every row keeps its saved score in either tier."""
    table.reserve(rows.ids.numel())  # a full disk raises here, before the table changes
    table.clear()
    state = table.optim.join_state(rows.state, table.dim) if rows.ids.numel() else None
    lost = table.load_rows(rows.ids, rows.weights, state, rows.scores, rows.step)
    if rows.admission is not None:
        table.load_admission(*rows.admission)
    if lost:
        warnings.warn(
            f"table {table.name!r}: {lost} of {rows.ids.numel()} rows found no room "
            "(their index buckets are full) and were dropped",
            stacklevel=2,
        )
    return lost


# ------------------------------------------------------ state_dict entries
def rows_from_entries(name: str, entries: dict[str, Any]) -> TableRows:
    """A table's rows from its state_dict entries (suffix -> plain tensor or
    ShardedTensor, whose local shards are taken)."""
    local = {k: _local(v) for k, v in entries.items()}
    admission = None
    if all(k in local for k in ADMISSION_KEYS):
        admission = tuple(local[k].to(torch.int64) for k in ADMISSION_KEYS)
    ids = local["weight_id"]
    scores = local.get("weight_score")
    step = None
    if "step" in local:
        value = local["step"].reshape(-1).tolist()
        if len(value) != 2:
            raise CheckpointError(f"table {name!r}: step must hold 2 values, got {len(value)}")
        step = (int(value[0]), int(value[1]))
    return TableRows(
        ids=ids,
        weights=local["weight"],
        scores=scores,
        state={k: local[k] for k in STATE_NAMES if k in local},
        step=step,
        admission=admission,
    )


def _local(value: Any) -> torch.Tensor:
    """A plain tensor, or the rows of a ShardedTensor's local shards (in offset order)."""
    if isinstance(value, ShardedTensor):
        shards = sorted(value.local_shards(), key=lambda s: s.metadata.shard_offsets[0])
        size = value.size()
        if not shards:
            return torch.empty((0, *size[1:]), dtype=value.dtype)
        return torch.cat([s.tensor for s in shards])
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"expected a tensor, got {type(value).__name__}")
    return value.detach()


# ------------------------------------------------------------------ hooks
def register_unsharded_hooks(module: nn.Module) -> None:
    """state_dict / load_state_dict hooks of a ``KVEmbeddingBagCollection``."""
    _register(module, _unsharded_layouts, None)


def register_sharded_hooks(module: nn.Module) -> None:
    """state_dict / load_state_dict hooks of a ``ShardedKVEmbeddingBagCollection``."""
    _register(module, _sharded_layouts, lambda m: m._env.process_group)


def _unsharded_layouts(module: nn.Module) -> list[TableLayout]:
    return [
        TableLayout(
            name,
            table.dim,
            table.options.total_num_buckets,
            table,
            (0, table.options.total_num_buckets),
            table.options.admission_threshold > 1,
        )
        for name, table in module.kv_tables().items()
    ]


def _sharded_layouts(module: nn.Module) -> list[TableLayout]:
    """Row-wise: rank ``r`` of ``W`` owns buckets ``[r*G/W, (r+1)*G/W)``; table-wise:
    the rank holding the table owns all of them."""
    env = module._env
    tables = module.kv_tables()
    optimizers = module.kv_fused_optimizers()
    options = module._kv_specs.options
    out = []
    for config in module._embedding_bag_configs:
        if config.name not in options:
            continue
        num_buckets = options[config.name].total_num_buckets
        table = tables.get(config.name)
        sharding = module.module_sharding_plan[config.name].sharding_type
        if sharding == "row_wise":
            per_rank = num_buckets // env.world_size
            owned = (env.rank * per_rank, (env.rank + 1) * per_rank)
        else:
            owned = (0, num_buckets) if table is not None else None
        admission = options[config.name].admission_threshold > 1
        out.append(
            TableLayout(
                config.name,
                config.embedding_dim,
                num_buckets,
                table,
                owned,
                admission,
                sharding,
                optimizers.get(config.name),
            )
        )
    return out


def _register(
    module: nn.Module,
    layouts: Callable[[nn.Module], list[TableLayout]],
    group: Callable[[nn.Module], dist.ProcessGroup | None] | None,
) -> None:
    # The hooks get the module as an argument: closing over it would make a
    # reference cycle that keeps a model (and its process group) alive until gc.
    def state_dict_hook(module: nn.Module, destination: dict, prefix: str, _metadata) -> None:
        tables = layouts(module)
        if _DESCRIBE["on"]:
            for layout in tables:
                optim = None if layout.table is None else layout.table.optim
                destination[f"{prefix}embedding_bags.{layout.name}.weight"] = KVTableSlot(
                    layout,
                    None if optim is None else optim.kind.value,
                    None if optim is None else optim.state_shapes(layout.dim),
                )
            return
        if group is None:
            for layout in tables:
                for key, value in table_state(layout.table).items():
                    destination[f"{prefix}embedding_bags.{layout.name}.{key}"] = value
            return
        for name, entries in sharded_entries(tables, group(module)).items():
            for key, value in entries.items():
                destination[f"{prefix}embedding_bags.{name}.{key}"] = value

    def load_hook(
        module: nn.Module,
        state_dict: dict,
        prefix: str,
        _metadata,
        strict: bool,
        missing_keys: list[str],
        _unexpected: list[str],
        _errors: list[str],
    ) -> None:
        pending = []
        for layout in layouts(module):
            base = f"{prefix}embedding_bags.{layout.name}."
            entries = {
                key[len(base) :]: state_dict.pop(key)
                for key in [k for k in state_dict if k.startswith(base)]
                if key[len(base) :] in KNOWN_KEYS
            }
            if "weight_id" not in entries:
                weight = entries.get("weight")
                if weight is not None and not _is_placeholder(weight):
                    raise CheckpointError(
                        f"table {layout.name!r}: the state_dict holds a weight but no "
                        "weight_id, as a stock table would; to load a stock table's rows use "
                        "torchrec_kvemb.checkpoint.migrate.load_dense_into_kv"
                    )
                if weight is None and strict:
                    missing_keys.extend(base + k for k in ROW_KEYS)
                continue
            rows = rows_from_entries(layout.name, entries)
            if layout.table is None:
                continue
            table = layout.table
            check_table_rows(
                layout.name,
                layout.dim,
                table.optim.state_shapes(layout.dim),
                rows,
                layout.num_buckets,
            )
            rows = rows.select(layout.owns(rows.ids))
            if rows.admission is not None:
                keep = layout.owns(rows.admission[0])
                rows.admission = tuple(t[keep] for t in rows.admission)
            check_fits(table, rows)
            pending.append((table, rows))
        for table, rows in pending:
            restore_table(table, rows)

    module.register_state_dict_post_hook(state_dict_hook)
    module.register_load_state_dict_pre_hook(load_hook)


def _is_placeholder(value: Any) -> bool:
    """A stand-in weight (TorchRec's meta EBC weight, or an empty one)."""
    if isinstance(value, ShardedTensor):
        return value.numel() == 0 or any(s.tensor.is_meta for s in value.local_shards())
    return isinstance(value, torch.Tensor) and (value.is_meta or value.numel() == 0)


# -------------------------------------------------------- sharded entries
def sharded_entries(
    layouts: list[TableLayout], group: dist.ProcessGroup | None
) -> dict[str, dict[str, Any]]:
    """Every KV table's state_dict entries as ShardedTensors over ``group``: one shard
    per rank with that rank's rows (a collective: one ``all_gather_object``)."""
    local: list[dict[str, torch.Tensor] | None] = []
    info = []
    for layout in layouts:
        if layout.table is None:
            local.append(None)
            info.append(None)
            continue
        state = table_state(layout.table)
        lo, hi = layout.owned
        state["bucket"] = state["bucket"][lo:hi]
        local.append(state)
        info.append(
            {
                "rows": state["weight_id"].numel(),
                "admission": state["admission_id"].numel() if layout.admission else 0,
                "step": state["step"].tolist(),
                "state_shapes": layout.table.optim.state_shapes(layout.dim),
                "bucket": hi - lo,
            }
        )
    device = _device_of(layouts)
    world = dist.get_world_size(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (device, info), group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    placements = [f"rank:{ranks[r]}/{gathered[r][0]}" for r in range(world)]
    me = dist.get_rank(group)
    out: dict[str, dict[str, Any]] = {}
    for i, layout in enumerate(layouts):
        holders = [g[1][i] for g in gathered]
        known = [h for h in holders if h is not None]
        if not known:
            continue  # no rank holds it (cannot happen for a planned table)
        state_shapes = known[0]["state_shapes"]
        rows = [0 if h is None else h["rows"] for h in holders]
        mine = local[i]
        entries: dict[str, Any] = {}

        def sharded(key: str, counts: list[int], tail: tuple[int, ...], dtype) -> ShardedTensor:
            value = None if mine is None else mine[key]  # noqa: B023
            return _sharded_tensor(value, counts, tail, dtype, placements, me, group)

        entries["weight"] = sharded("weight", rows, (layout.dim,), torch.float32)
        entries["weight_id"] = sharded("weight_id", rows, (), torch.int64)
        entries["weight_score"] = sharded("weight_score", rows, (), torch.int64)
        for name, tail in state_shapes.items():
            entries[name] = sharded(name, rows, tail, torch.float32)
        buckets = [0 if h is None else h["bucket"] for h in holders]
        entries["bucket"] = sharded("bucket", buckets, (), torch.int64)
        steps = [h["step"] for h in known]
        entries["step"] = torch.tensor([max(s[0] for s in steps), max(s[1] for s in steps)])
        if layout.admission:
            counts = [0 if h is None else h["admission"] for h in holders]
            for key in ADMISSION_KEYS:
                entries[key] = sharded(key, counts, (), torch.int64)
        out[layout.name] = entries
    return out


def _device_of(layouts: list[TableLayout]) -> str:
    for layout in layouts:
        if layout.table is not None:
            return str(layout.table.device)
    return "cpu"


def _sharded_tensor(
    value: torch.Tensor | None,
    counts: list[int],
    tail: tuple[int, ...],
    dtype: torch.dtype,
    placements: list[str],
    me: int,
    group: dist.ProcessGroup | None,
) -> ShardedTensor:
    """A ShardedTensor of ``sum(counts)`` rows, rank ``r`` holding ``counts[r]`` of them
    at offset ``sum(counts[:r])`` (zero-row shards included: DCP and ShardedTensor
    need every rank's shard, and a table may be empty).

    Zero-row shards sit at the end offset: DCP keys a saved chunk by (name, offset),
    so an empty shard at a real shard's offset could replace it in the save plan.
    """
    total = sum(counts)
    shards_md = []
    offset = 0
    for rank, n in enumerate(counts):
        at = offset if n else total
        shards_md.append(ShardMetadata([at] + [0] * len(tail), [n, *tail], placements[rank]))
        offset += n
    metadata = ShardedTensorMetadata(
        shards_md, torch.Size([total, *tail]), TensorProperties(dtype=dtype)
    )
    if value is None:
        device = placements[me].split("/", 1)[1]
        value = torch.empty((0, *tail), dtype=dtype, device=device)
    local = [Shard(value.contiguous(), shards_md[me])]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, metadata, process_group=group
    )
