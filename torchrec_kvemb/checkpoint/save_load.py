"""``save(model, path)`` / ``load(model, path)``: checkpoints on DCP, at any world size.

One checkpoint holds the whole model's ``state_dict()`` (KV tables as
:mod:`torchrec_kvemb.state_dict` describes them, stock tables, dense parameters
and buffers), the fused optimizer state of stock tables, the learning rate of
each KV table and, optionally, a dense optimizer (:mod:`.optimizer_state`).
``load`` reads, per KV table, the saved rows of the routing buckets a rank owns
(one contiguous range: rows are sorted by bucket) and replaces the table's
content; every check happens on every rank before anything changes.

Example::

    save(model, "/ckpt/step_1000", optimizer=dense_optimizer)
    load(model, "/ckpt/step_1000", optimizer=dense_optimizer)   # any world size
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchrec_kvemb.checkpoint import collectives as comm
from torchrec_kvemb.checkpoint.asynchronous import (
    AsyncCheckpoint,
    checkpoint_group,
    copied,
    staged,
    start,
    wait_previous,
)
from torchrec_kvemb.checkpoint.marker import check_target, publish, read_marker
from torchrec_kvemb.checkpoint.optimizer_state import (
    FUSED,
    OPTIM,
    fused_state,
    learning_rates,
    lr_key,
    optimizer_state,
    optimizer_to_load,
    restore_learning_rates,
    saved_learning_rates,
)
from torchrec_kvemb.checkpoint.placement import WEIGHT, RowPlacer, TablePlacement
from torchrec_kvemb.checkpoint.priority import SavePriority
from torchrec_kvemb.checkpoint.reader import ParallelFileSystemReader, RowRangePlanner
from torchrec_kvemb.checkpoint.row_stream import RowBlock, stream_rows
from torchrec_kvemb.checkpoint.writer import RowStreamWriter
from torchrec_kvemb.state_dict import (
    ADMISSION_KEYS,
    KNOWN_KEYS,
    ROW_KEYS,
    STATE_NAMES,
    CheckpointError,
    KVTableSlot,
    TableRows,
    check_fits,
    check_table_rows,
    describe_state_dict,
    kv_table_slots,
    restore_table,
)
from torchrec_kvemb.state_dict.deferred import DeferredEntries, deferring
from torchrec_kvemb.state_dict.rows import select_columns
from torchrec_kvemb.ttl import LAST_SEEN_KEY

MODEL = "model"
#: DCP writer threads (files) per rank of a blocking save.
THREADS = 4
#: ... and of an asynchronous one. why 1: its writes share the CPU with training;
#: one thread spreads them thinner (1.1 GB beside 2-thread training steps on 2
#: cores: steps at 0.69x-0.92x of their rate with 1 writer, 0.54x-0.65x with 4).
ASYNC_THREADS = 1
#: What to do with a stock table's rows in a checkpoint of a KV model.
MIGRATE_HINT = (
    "to load a stock table's rows into a KV table use "
    "torchrec_kvemb.checkpoint.migrate.load_dense_into_kv(model, path)"
)


# ------------------------------------------------------------------- save
def save(
    model: nn.Module,
    path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    thread_count: int | None = None,
    blocking: bool = True,
    max_write_bytes_per_s: float | None = None,
) -> AsyncCheckpoint | None:
    """Write ``model`` (and ``optimizer``'s state, keyed by parameter name) to the
    checkpoint directory ``path``, atomically; an older checkpoint at ``path`` is
    replaced. Collective when ``torch.distributed`` is initialized.

    ``thread_count``: DCP writer threads per rank, each writing its own file
    (``load`` reads them in parallel too); default 4 (:data:`ASYNC_THREADS` for
    an asynchronous save). ``max_write_bytes_per_s``: the most bytes per second
    the rank's writer threads write together (None: as fast as they can).

    ``blocking=False``: :func:`async_save` (returns its handle). Either way a save
    first waits for an asynchronous save still in flight, and raises the
    :class:`CheckpointError` of one that failed unless its ``result()`` raised it.
    """
    if not blocking:
        return async_save(model, path, optimizer, thread_count, max_write_bytes_per_s)
    _check_rate(max_write_bytes_per_s)
    wait_previous(raise_failure=True)
    path = os.fspath(path)
    group = comm.process_group()
    check_target(path)
    slots = kv_table_slots(model)
    tables = _table_configs(slots, group)
    with deferring() as deferred:  # rows are filled as they are written (writer.py)
        state = _state(model, slots, optimizer)
    _write(state, deferred, path, tables, thread_count or THREADS, group, max_write_bytes_per_s)
    return None


def async_save(
    model: nn.Module,
    path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    thread_count: int | None = None,
    max_write_bytes_per_s: float | None = None,
) -> AsyncCheckpoint:
    """Start writing ``model`` (and ``optimizer``) to ``path`` in the background;
    returns at once with an :class:`AsyncCheckpoint` whose ``result()`` waits for
    the ``COMPLETE`` marker (or raises :class:`CheckpointError`).

    The checkpoint holds the state at the call: every KV table's rows, optimizer
    state, scores, counters and admission entries (both tiers of a table with an
    SSD tier), stock tables, dense parameters and optimizer state are copied
    before it returns, so training may go on at once (the KV rows of tables in CPU
    memory into staging buffers kept for the next save:
    ``checkpoint.asynchronous.release_buffers()`` frees them). ``thread_count``:
    writer threads per rank, default :data:`ASYNC_THREADS`.
    ``max_write_bytes_per_s``: a cap on the rank's write rate, which spreads the
    writes' CPU cost over more training steps (the save takes longer). Collective when
    ``torch.distributed`` is initialized (call it on every rank at the same point);
    its collectives run on a gloo group of its own (:func:`checkpoint_group`),
    never on the groups training uses. One save at a time: a save (either kind)
    waits for the one in flight first. Guarantees and costs:
    docs/checkpoint-format.md#asynchronous-saves.

    Example::

        pending = checkpoint.async_save(model, "/ckpt/step_1000", optimizer=opt)
        for batch in batches:
            train_step(batch)           # while the files are written
        pending.result()                # raises CheckpointError if the save failed
    """
    _check_rate(max_write_bytes_per_s)
    wait_previous(raise_failure=True)
    path = os.fspath(path)
    group = checkpoint_group()
    check_target(path)
    slots = kv_table_slots(model)
    tables = _table_configs(slots, group)
    with deferring() as deferred:  # KV rows in CPU memory: filled into kept buffers
        state = _state(model, slots, optimizer)
    state = staged(state, _fresh_keys(slots), deferred)
    threads = thread_count or ASYNC_THREADS
    rate = max_write_bytes_per_s
    return start(
        path,
        lambda priority: _write(
            state, DeferredEntries(), path, tables, threads, group, rate, priority
        ),
    )


def _check_rate(bytes_per_s: float | None) -> None:
    if bytes_per_s is not None and not bytes_per_s > 0:
        raise ValueError(f"max_write_bytes_per_s must be > 0 (or None), got {bytes_per_s}")


def _state(
    model: nn.Module, slots: Mapping[str, KVTableSlot], optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """What a checkpoint holds: the model's state_dict, the fused optimizer state of
    stock tables with the KV tables' learning rates, the dense optimizer's state."""
    state: dict[str, Any] = {MODEL: model.state_dict()}
    fused = fused_state(model, slots)
    rates = learning_rates(slots)
    if rates:
        fused = {**fused, "param_groups": rates}
    if fused:
        state[FUSED] = fused
    if optimizer is not None:
        state[OPTIM] = optimizer_state(model, optimizer)
    return state


def _fresh_keys(slots: Mapping[str, KVTableSlot]) -> set[tuple[str, ...]]:
    """The paths in :func:`_state` of the KV tables' entries: exported into new
    tensors by ``state_dict()``, so a snapshot need not copy them again."""
    return {(MODEL, f"{prefix}{key}") for prefix in slots for key in KNOWN_KEYS}


def _write(
    state: dict[str, Any],
    deferred: DeferredEntries,
    path: str,
    tables: dict[str, dict[str, Any]],
    thread_count: int,
    group: Any,
    max_bytes_per_s: float | None = None,
    priority: SavePriority | None = None,
) -> None:
    """DCP writes ``state`` into ``<path>.tmp-<token>``; rank 0 publishes it (marker.py).
    ``priority``: the CPU priority of an asynchronous save's writer threads."""
    token = comm.broadcast(uuid.uuid4().hex if comm.rank(group) == 0 else None, group)
    tmp = f"{path}.tmp-{token}"
    try:
        with comm.single_process_ok():
            dcp.save(
                state,
                storage_writer=RowStreamWriter(
                    tmp,
                    thread_count=thread_count,
                    deferred=deferred,
                    max_bytes_per_s=max_bytes_per_s,
                    priority=priority,
                ),
                process_group=group,
                no_dist=group is None,
            )
    except CheckpointException as err:  # every rank gets it
        shutil.rmtree(tmp, ignore_errors=True)
        rank, first = _first_failure(err)
        raise CheckpointError(
            f"checkpoint {path!r}: writing failed on rank {rank}: {type(first).__name__}: "
            f"{first}; {path!r} is unchanged and the partly written files are removed"
        ) from err
    comm.barrier(group)
    error = None
    if comm.rank(group) == 0:
        try:
            publish(tmp, path, token, tables, comm.world_size(group))
        except Exception as e:
            error = e
    comm.agree(error, group)  # every rank returns once the marker is written, or raises


def _table_configs(slots: Mapping[str, KVTableSlot], group) -> dict[str, dict[str, Any]]:
    """Every KV table's config (gathered: a table-wise table is known on its rank)."""
    local = {
        prefix.rstrip("."): {
            "name": s.layout.name,
            "dim": s.layout.dim,
            "weights_dtype": str(s.layout.weights_dtype).removeprefix("torch."),
            "optimizer": s.optimizer,
            "state": list(s.state_shapes),
            "total_num_buckets": s.layout.num_buckets,
            "sharding": s.layout.sharding,
        }
        for prefix, s in slots.items()
        if s.optimizer is not None
    }
    merged: dict[str, dict[str, Any]] = {}
    for part in comm.gather(local, group):
        merged.update(part)
    return merged


# ------------------------------------------------------------------- load
def _read(
    path: str,
    targets: dict[str, Any],
    reader: ParallelFileSystemReader,
    row_offsets: dict[str, int],
    group: Any,
) -> None:
    """``dcp.load`` of ``targets`` (copies: the model is untouched). A read that fails
    on any rank (a truncated file, a disk error) raises ``CheckpointError`` naming
    the path and the first failure, on every rank."""
    try:
        with comm.single_process_ok():
            dcp.load(
                targets,
                storage_reader=reader,
                planner=RowRangePlanner(row_offsets),
                process_group=group,
                no_dist=group is None,
            )
    except CheckpointException as err:
        raise _reading_failed(path, *_first_failure(err)) from err


def _first_failure(err: CheckpointException) -> tuple[int, BaseException]:
    """The rank and error of the first failure DCP collected (every rank gets them)."""
    rank, (error, _traceback) = next(iter(err.failures.items()))
    return rank, error


def _reading_failed(path: str, rank: int, error: BaseException) -> CheckpointError:
    """The error every rank raises when reading failed on ``rank`` (nothing loaded)."""
    return CheckpointError(
        f"checkpoint {path!r}: reading failed on rank {rank}: {type(error).__name__}: "
        f"{error}; nothing was loaded"
    )


def load(
    model: nn.Module,
    path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
) -> None:
    """Load the checkpoint at ``path`` into ``model`` (and ``optimizer``), at any
    world size and KV sharding. Collective when ``torch.distributed`` is
    initialized. Raises :class:`CheckpointError` (nothing changed) for an
    incomplete checkpoint, KV tables of another config, or (``strict``) model
    entries the checkpoint lacks; checkpoint entries the model lacks are ignored.
    An asynchronous save in flight is waited for first.
    """
    wait_previous(raise_failure=False)
    path = os.fspath(path)
    group = comm.process_group()
    marker = read_marker(path)
    reader = ParallelFileSystemReader(path)
    metadata = reader.read_metadata()
    saved = metadata.state_dict_metadata
    slots, current = describe_state_dict(model)
    fused = fused_state(model, slots)

    # Checks that need no data; any rank's error stops every rank.
    error = None
    try:
        _check_kv_config(slots, marker["tables"], saved)
        if optimizer is not None and not any(k.startswith(OPTIM + ".") for k in saved):
            raise CheckpointError(f"checkpoint {path!r} holds no optimizer state")
        if strict:
            missing = [k for k in current if f"{MODEL}.{k}" not in saved]
            missing += [k for k in flatten_state_dict({FUSED: fused})[0] if k not in saved]
            if missing:
                raise CheckpointError(
                    f"checkpoint {path!r} lacks entries of the model: {sorted(missing)[:8]}"
                    f"{' ...' if len(missing) > 8 else ''}"
                )
    except Exception as e:
        error = e
    comm.agree(error, group)

    # 1. Rows per routing bucket of the KV tables this rank stores (small).
    kv_reads = {p: s for p, s in slots.items() if s.layout.owned is not None}
    buckets = {
        p: torch.empty(saved[f"{MODEL}.{p}bucket"].size, dtype=torch.int64) for p in kv_reads
    }
    _read(path, {f"{MODEL}.{p}bucket": t for p, t in buckets.items()}, reader, {}, group)

    # 2. Everything but the KV tables' rows: ids, scores and counters of the bucket
    #    ranges this rank owns, stock entries into copies, learning rates, optimizer.
    targets: dict[str, Any] = {}
    row_shapes: dict[str, torch.Tensor] = {}  # weight and optimizer state (meta): step 4
    row_offsets: dict[str, int] = {}
    for prefix, slot in kv_reads.items():
        start, stop = _row_range(slot, buckets[prefix])
        for key in _saved_row_keys(prefix, saved):
            md = saved[key]
            shape, dtype = (stop - start, *md.size[1:]), md.properties.dtype
            if _is_row_entry(key):
                row_shapes[key] = torch.empty(shape, dtype=dtype, device="meta")
            else:
                targets[key] = torch.empty(shape, dtype=dtype)
            row_offsets[key] = start
        for suffix in ("step", *(ADMISSION_KEYS if slot.layout.admission else ())):
            key = f"{MODEL}.{prefix}{suffix}"
            if key in saved:
                targets[key] = torch.empty(saved[key].size, dtype=saved[key].properties.dtype)
    stock_keys = [f"{MODEL}.{k}" for k in current if f"{MODEL}.{k}" in saved]
    targets.update({key: copied(current[key[len(MODEL) + 1 :]]) for key in stock_keys})
    fused_live, _ = flatten_state_dict({FUSED: fused})
    fused_keys = [k for k in fused_live if k in saved]
    targets.update({key: copied(fused_live[key]) for key in fused_keys})
    # KV learning rates: absent from checkpoints written before they were saved.
    lr_keys = {p: lr_key(p) for p, slot in slots.items() if slot.layout.table is not None}
    lr_keys = {p: key for p, key in lr_keys.items() if key in saved}
    optim_keys = [k for k in saved if k.startswith(OPTIM + ".")] if optimizer is not None else []
    for key in [*lr_keys.values(), *optim_keys]:
        md = saved[key]
        targets[key] = (
            torch.empty(md.size, dtype=md.properties.dtype)
            if isinstance(md, TensorStorageMetadata)
            else None
        )
    _read(path, targets, reader, {k: v for k, v in row_offsets.items() if k in targets}, group)

    # 3. Check what this rank keeps (rows by their shapes: not read yet), agree.
    contents: list[tuple[str, KVTableSlot, TableRows, torch.Tensor | None]] = []
    optim_state = None
    rates: dict[str, float] = {}
    error = None
    try:
        for prefix, slot in kv_reads.items():
            rows, keep = _rows(prefix, slot, {**targets, **row_shapes})
            layout = slot.layout
            shapes = _shapes_only(rows, keep)
            check_table_rows(layout.name, layout.dim, slot.state_shapes, shapes, layout.num_buckets)
            check_fits(slot.layout.table, shapes)
            contents.append((prefix, slot, rows, keep))
        rates = saved_learning_rates(slots, {p: targets[key] for p, key in lr_keys.items()})
        if optimizer is not None:
            optim_state = optimizer_to_load(
                model, optimizer, {k: targets[k] for k in optim_keys}, metadata
            )
    except Exception as e:
        error = e
    comm.agree(error, group)

    # 4. The rows, read in blocks (row_stream.py), each placed into its table as it
    #    is read (placement.py); a failure on any rank puts every table's rows back.
    #    Tables with an SSD tier get theirs whole, placed in step 5.
    placed = [content for content in contents if _placeable(content[1])]
    placer = RowPlacer(
        [
            TablePlacement(
                slot.layout.table,
                rows.ids,
                rows.scores,
                (WEIGHT, *rows.state),
                keep,
                rows.step,
                rows.admission,
                rows.last_seen,
            )
            for _, slot, rows, keep in placed
        ],
        {
            f"{MODEL}.{prefix}{entry}": (i, entry)
            for i, (prefix, _, rows, _) in enumerate(placed)
            for entry in (WEIGHT, *rows.state)
        },
    )
    whole = {
        f"{MODEL}.{prefix}{entry}": torch.empty_like(value, device="cpu")
        for prefix, slot, rows, _ in contents
        if not _placeable(slot)
        for entry, value in ((WEIGHT, rows.weights), *rows.state.items())
    }
    requests = {key: (row_offsets[key], shape.shape[0]) for key, shape in row_shapes.items()}

    # Column shards keep their columns of the 2-D entries (weight, Adam's moments);
    # a checkpoint saved by column shards gives blocks of some columns of each row.
    column_cut = {
        f"{MODEL}.{prefix}{entry}": slot.layout.columns
        for prefix, slot, rows, _ in placed
        if slot.layout.columns is not None
        for entry in (WEIGHT, *rows.state)
    }

    def take(block: RowBlock) -> None:
        if block.rows.dim() == 2 and block.key in column_cut:
            block = _cut_columns(block, *column_cut[block.key])
            if block is None:
                return
        if block.key in whole:
            rows, at = block.rows, block.column
            target = whole[block.key][block.start : block.start + rows.shape[0]]
            if rows.dim() == 2:
                target = target[:, at : at + rows.shape[1]]
            target.copy_(rows)
            block.release()
        else:
            placer.post(block)

    error = None
    try:
        with placer.running():
            stream_rows(reader, metadata, requests, take)
    except Exception as e:
        error = _reading_failed(path, comm.rank(group), e)
        error.__cause__ = e
    try:
        comm.agree(error, group)
    except CheckpointError:
        placer.rollback()
        raise

    # 5. Change the model.
    model.load_state_dict({key[len(MODEL) + 1 :]: targets[key] for key in stock_keys}, strict=False)
    placer.commit()
    for prefix, slot, rows, keep in contents:
        if not _placeable(slot):
            rows = select_columns(_with_rows(rows, prefix, whole), slot.layout.columns)
            restore_table(slot.layout.table, rows if keep is None else rows.select(keep))
    for key in fused_keys:
        _copy_into(fused_live[key], targets[key])
    restore_learning_rates(slots, rates)
    if optimizer is not None:
        optimizer.load_state_dict(optim_state)


def _cut_columns(block: RowBlock, first: int, width: int) -> RowBlock | None:
    """The part of a block of rows in a column shard's columns ``[first, first +
    width)``, its column renumbered from the shard's first (None: no column of it;
    the block is released)."""
    lo = max(first, block.column)
    hi = min(first + width, block.column + block.rows.shape[1])
    if lo >= hi:
        block.release()
        return None
    rows = block.rows[:, lo - block.column : hi - block.column]
    return replace(block, rows=rows, column=lo - first)


def _with_rows(rows: TableRows, prefix: str, whole: Mapping[str, torch.Tensor]) -> TableRows:
    """``rows`` with the row entries read whole (in place of their shapes)."""
    return replace(
        rows,
        weights=whole[f"{MODEL}.{prefix}{WEIGHT}"],
        state={name: whole[f"{MODEL}.{prefix}{name}"] for name in rows.state},
    )


def _is_row_entry(key: str) -> bool:
    """A KV table's ``weight`` or optimizer state entry (read and placed in blocks)."""
    return key.rpartition(".")[2] in (WEIGHT, *STATE_NAMES)


def _placeable(slot: KVTableSlot) -> bool:
    """Whether the table's rows are placed while they are read: a table in memory only
    (an SSD tier places rows by score over both tiers, after the whole read)."""
    table = slot.layout.table
    return table is not None and table.ssd is None and table.device.type != "meta"


def _row_range(slot: KVTableSlot, saved_buckets: torch.Tensor) -> tuple[int, int]:
    """The saved rows of the buckets this rank owns: one contiguous range when the
    bucket count is the model's, else every row (filtered after reading)."""
    layout = slot.layout
    total = int(saved_buckets.sum())
    if saved_buckets.numel() != layout.num_buckets:
        return 0, total
    lo, hi = layout.owned
    cumulative = torch.cat([torch.zeros(1, dtype=torch.int64), saved_buckets.cumsum(0)])
    return int(cumulative[lo]), int(cumulative[hi])


def _saved_row_keys(prefix: str, saved: Mapping[str, Any]) -> list[str]:
    names = (*ROW_KEYS, LAST_SEEN_KEY, *STATE_NAMES)
    return [f"{MODEL}.{prefix}{n}" for n in names if f"{MODEL}.{prefix}{n}" in saved]


def _rows(prefix: str, slot: KVTableSlot, targets: dict) -> tuple[TableRows, torch.Tensor | None]:
    """The rows read for one table and which of them this rank owns (None: all)."""

    def get(suffix: str) -> torch.Tensor | None:
        return targets.get(f"{MODEL}.{prefix}{suffix}")

    step = get("step")
    admission = None
    if slot.layout.admission and all(get(k) is not None for k in ADMISSION_KEYS):
        ids, counts, scores = (get(k) for k in ADMISSION_KEYS)
        keep = slot.layout.owns(ids)
        admission = (ids[keep], counts[keep], scores[keep])
    rows = TableRows(
        ids=get("weight_id"),
        weights=get("weight"),
        scores=get("weight_score"),
        state={n: get(n) for n in STATE_NAMES if get(n) is not None},
        step=None if step is None else (int(step[0]), int(step[1])),
        admission=admission,
        last_seen=get(LAST_SEEN_KEY),
    )
    keep = slot.layout.owns(rows.ids)
    return rows, None if bool(keep.all()) else keep


def _shapes_only(rows: TableRows, keep: torch.Tensor | None) -> TableRows:
    """``rows.select(keep)`` with the row entries as ``meta`` tensors of their shapes
    (the checks read the ids and scores, and only the shapes of the rest)."""
    n = rows.ids.numel() if keep is None else int(keep.sum())

    def shaped(t: torch.Tensor) -> torch.Tensor:
        length = n if t.dim() and t.shape[0] == rows.ids.numel() else t.shape[0]
        return torch.empty((length, *t.shape[1:]), dtype=t.dtype, device="meta")

    return TableRows(
        ids=rows.ids if keep is None else rows.ids[keep],
        weights=shaped(rows.weights),
        scores=rows.scores if keep is None or rows.scores is None else rows.scores[keep],
        state={k: shaped(v) for k, v in rows.state.items()},
        step=rows.step,
        admission=rows.admission,
        last_seen=rows.last_seen
        if keep is None or rows.last_seen is None
        else rows.last_seen[keep],
    )


def _check_kv_config(
    slots: Mapping[str, KVTableSlot], tables: Mapping[str, Any], saved: Mapping[str, Any]
) -> None:
    """The model's KV tables against the marker's and the metadata's shapes."""
    for prefix, slot in slots.items():
        layout = slot.layout
        key = prefix.rstrip(".")
        where = f"table {layout.name!r} ({key})"
        weight = f"{MODEL}.{prefix}weight"
        if key not in tables and weight in saved:
            raise CheckpointError(
                f"{where}: the checkpoint holds a stock table's weight there (no weight_id); "
                f"{MIGRATE_HINT}"
            )
        if key not in tables or weight not in saved:
            raise CheckpointError(f"{where} is not in the checkpoint")
        want = tables[key]
        if want["dim"] != layout.dim:
            raise CheckpointError(
                f"{where}: the checkpoint's rows have dim {want['dim']}, the model's "
                f"table has dim {layout.dim}"
            )
        size = saved[weight].size
        if len(size) != 2 or size[1] != layout.dim:
            raise CheckpointError(f"{where}: the checkpoint's weight has shape {tuple(size)}")
        stored = saved[weight].properties.dtype
        if stored != layout.weights_dtype:
            warnings.warn(
                f"{where}: the checkpoint's rows are {stored}, the table stores "
                f"{layout.weights_dtype}; converting them as they load",
                stacklevel=3,
            )
        if slot.optimizer is not None and want["optimizer"] != slot.optimizer:
            raise CheckpointError(
                f"{where}: saved with the {want['optimizer']} optimizer (state "
                f"{want['state'] or 'none'}), the model's table uses {slot.optimizer} "
                f"(state {list(slot.state_shapes) or 'none'})"
            )


# ---------------------------------------------------------------- tensors
def _copy_into(live: Any, loaded: Any) -> None:
    if isinstance(live, ShardedTensor):
        for a, b in zip(live.local_shards(), loaded.local_shards(), strict=True):
            a.tensor.detach().copy_(b.tensor)
    elif isinstance(live, torch.Tensor):
        live.detach().copy_(loaded)
