"""Incremental dumps of KV tables: the rows changed since the previous dump.

``IncrementalDumper(module, directory).dump()`` writes, per table, the ids whose
row (weights, optimizer state or eviction score) changed since its previous dump
and the ids evicted since then (stored then, absent now) into a new numbered
sub-directory ``directory/<seq:06d>/``. A dumper's first dump is a full dump.
``apply_dumps(directory)`` rebuilds every table's content from the last full dump
and the increments after it; ``load_dumps_into(module, directory)`` inserts that
content into a module's (empty) tables.

Changes are found without touching ``KVTable``: the dumper keeps, per table, the
ids of its previous export and a 64-bit digest of each row (weights, state and
score bits), and compares the next export with them. Layout:
docs/checkpoint-format.md ("Incremental dumps").

Example::

    from torchrec_kvemb.checkpoint.incremental import (
        IncrementalDumper, apply_dumps, load_dumps_into)

    dumper = IncrementalDumper(ebc, "/dumps/run1")
    for batch in batches:
        train_step(batch)
        dumper.dump()                      # /dumps/run1/000000 (full), 000001, ...
    tables = apply_dumps("/dumps/run1")    # {"user": {"ids": ..., "weights": ...}}
    load_dumps_into(fresh_ebc, "/dumps/run1")
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from torchrec_kvemb.table import KVTable

__all__ = [
    "IncrementalDumper",
    "RowTracker",
    "apply_dumps",
    "dump_incremental",
    "list_dumps",
    "load_dumps_into",
]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_SEQ_DIR = re.compile(r"^\d{6}$")
# Odd 64-bit constants (as signed int64) of the row digest's multiply-xor mix.
_MUL = -7046029254386353131  # 0x9E3779B97F4A7C15
_MUL2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_SENTINEL = -0x7FFF_FFFF_FFFF_FFFF  # digest that marks a row as "to be re-sent"


class HasKVTables(Protocol):
    """Anything with KV tables by name, e.g. ``KVEmbeddingBagCollection``."""

    def kv_tables(self) -> dict[str, KVTable]: ...


def _columns_int64(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[n, k]`` int64 holding its exact bits (float32 via int32)."""
    if t.dim() == 1:
        t = t.unsqueeze(1)
    if t.dtype == torch.float32:
        return t.contiguous().view(torch.int32).to(torch.int64)
    if t.dtype == torch.float64:
        return t.contiguous().view(torch.int64)
    if t.is_floating_point():
        return t.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    return t.to(torch.int64)


def row_digests(export: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A 64-bit digest ``[n]`` of every exported row: all tensors but ``ids``."""
    n = export["ids"].numel()
    h = torch.full((n,), 0x12345, dtype=torch.int64, device=export["ids"].device)
    for name in sorted(export):
        if name == "ids":
            continue
        cols = _columns_int64(export[name])
        for j in range(cols.shape[1]):
            h = (h ^ cols[:, j]) * _MUL
            h = h ^ (h >> 29)
    h = (h ^ (h >> 31)) * _MUL2
    h = h ^ (h >> 32)
    # A real row never gets the sentinel, so invalidated rows always differ.
    return torch.where(h == _SENTINEL, h + 1, h)


@dataclass
class TableDelta:
    """What changed in one table since the tracker's previous look."""

    #: Rows of the changed ids (sorted): ``ids``, ``weights``, ``scores`` and
    #: the optimizer state by name, as ``KVTable.export()`` gives them.
    rows: dict[str, torch.Tensor]
    #: Ids stored at the previous look and absent now (sorted).
    evicted: torch.Tensor

    @property
    def empty(self) -> bool:
        return self.rows["ids"].numel() == 0 and self.evicted.numel() == 0


class RowTracker:
    """Remembers each table's ids and row digests to tell what changed since.

    Example::

        tracker = RowTracker()
        deltas = tracker.diff(ebc.kv_tables())   # first call: every row
        train_step()
        deltas = tracker.diff(ebc.kv_tables())   # only the rows the step changed
    """

    def __init__(self) -> None:
        self._ids: dict[str, torch.Tensor] = {}
        self._digests: dict[str, torch.Tensor] = {}

    def diff(self, tables: Mapping[str, KVTable]) -> dict[str, TableDelta]:
        """The changes of every table since the last call, and remember the new state."""
        out: dict[str, TableDelta] = {}
        for name, table in tables.items():
            export = table.export()
            ids = export["ids"]
            digests = row_digests(export)
            prev_ids = self._ids.get(name)
            if prev_ids is None or prev_ids.numel() == 0:
                changed = torch.ones_like(ids, dtype=torch.bool)
                evicted = ids[:0]
            else:
                prev_ids = prev_ids.to(ids.device)
                prev_digests = self._digests[name].to(ids.device)
                pos = torch.searchsorted(prev_ids, ids).clamp(max=prev_ids.numel() - 1)
                known = prev_ids[pos] == ids
                changed = ~known | (prev_digests[pos] != digests)
                evicted = prev_ids[~torch.isin(prev_ids, ids)]
            out[name] = TableDelta({k: v[changed] for k, v in export.items()}, evicted)
            self._ids[name] = ids
            self._digests[name] = digests
        return out

    def invalidate(self, name: str, ids: torch.Tensor) -> None:
        """Make the next ``diff`` report ``ids`` of table ``name`` again: as changed
        where stored then, as evicted where absent (used when a delta was lost)."""
        if name not in self._ids or ids.numel() == 0:
            return
        prev_ids = self._ids[name]
        ids = ids.to(prev_ids.device)
        keep = ~torch.isin(prev_ids, ids)
        merged, order = torch.sort(torch.cat([prev_ids[keep], ids]))
        sentinel = torch.full_like(ids, _SENTINEL)
        self._ids[name] = merged
        self._digests[name] = torch.cat([self._digests[name][keep], sentinel])[order]


# ------------------------------------------------------------------ dumps
def list_dumps(directory: str | os.PathLike[str]) -> list[int]:
    """Sequence numbers of the complete dumps in ``directory``, ascending (leftover
    temporary directories of interrupted dumps are ignored)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    return sorted(
        int(entry)
        for entry in os.listdir(directory)
        if _SEQ_DIR.match(entry) and os.path.isfile(os.path.join(directory, entry, MANIFEST))
    )


def _table_file(index: int) -> str:
    return f"table_{index:04d}.pt"


class IncrementalDumper:
    """Writes numbered incremental dumps of a module's KV tables.

    Each ``dump()`` writes ``directory/<seq:06d>/`` with one ``torch.save`` file
    per table (the changed rows and the evicted ids) and ``manifest.json``. The
    dumper's first dump is a full dump; numbering continues after dumps already
    in ``directory``. A dump is written into a temporary directory and renamed,
    so a crash leaves no partial ``<seq>`` directory.

    Example::

        dumper = IncrementalDumper(ebc, "/dumps/run1")
        train_step(); dumper.dump()   # full
        train_step(); dumper.dump()   # rows that step changed, ids it evicted
    """

    def __init__(self, module: HasKVTables, directory: str | os.PathLike[str]) -> None:
        if not hasattr(module, "kv_tables"):
            raise TypeError(f"{type(module).__name__} has no kv_tables(): not a KV module")
        self.module = module
        self.directory = os.fspath(directory)
        self._tracker = RowTracker()
        self._first = True

    def dump(self) -> dict[str, Any]:
        """Write the next dump; returns its manifest (``seq``, ``full`` and per
        table ``dim``, ``changed`` and ``evicted`` counts)."""
        tables = self.module.kv_tables()
        deltas = self._tracker.diff(tables)
        os.makedirs(self.directory, exist_ok=True)
        done = list_dumps(self.directory)
        seq = done[-1] + 1 if done else 0
        manifest: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "seq": seq,
            "full": self._first,
            "tables": {},
        }
        tmp = os.path.join(self.directory, f".tmp-{seq:06d}-{uuid.uuid4().hex}")
        os.makedirs(tmp)
        try:
            for index, (name, delta) in enumerate(deltas.items()):
                table = tables[name]
                payload = {k: v.cpu() for k, v in delta.rows.items()}
                payload["evicted"] = delta.evicted.cpu()
                torch.save(payload, os.path.join(tmp, _table_file(index)))
                manifest["tables"][name] = {
                    "file": _table_file(index),
                    "dim": table.dim,
                    "state_names": table.optim.state_names(),
                    "changed": int(delta.rows["ids"].numel()),
                    "evicted": int(delta.evicted.numel()),
                }
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump(manifest, f, indent=1)
            os.rename(tmp, os.path.join(self.directory, f"{seq:06d}"))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._first = False
        return manifest


_DUMPERS: dict[tuple[int, str], IncrementalDumper] = {}


def dump_incremental(module: HasKVTables, directory: str | os.PathLike[str]) -> dict[str, Any]:
    """``IncrementalDumper(module, directory).dump()`` with the dumper kept per
    ``(module, directory)`` in this process, so that repeated calls write increments.
    Prefer holding an ``IncrementalDumper`` (the registry keeps modules alive)."""
    key = (id(module), os.path.abspath(os.fspath(directory)))
    dumper = _DUMPERS.get(key)
    if dumper is None or dumper.module is not module:
        dumper = _DUMPERS[key] = IncrementalDumper(module, directory)
    return dumper.dump()


def _read_manifest(path: str) -> dict[str, Any]:
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: unknown dump format {manifest.get('format_version')!r}")
    return manifest


def apply_dumps(directory: str | os.PathLike[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Every table's content (``ids`` sorted, ``weights``, ``scores``, optimizer
    state by name) from the last full dump in ``directory`` and the increments after
    it, applied in order. Raises ``FileNotFoundError`` without a full dump and
    ``ValueError`` when a dump in the chain is missing."""
    directory = os.fspath(directory)
    seqs = list_dumps(directory)
    manifests = {s: _read_manifest(os.path.join(directory, f"{s:06d}")) for s in seqs}
    fulls = [s for s in seqs if manifests[s]["full"]]
    if not fulls:
        raise FileNotFoundError(f"{directory}: no complete full dump")
    chain = [s for s in seqs if s >= fulls[-1]]
    if chain != list(range(chain[0], chain[0] + len(chain))):
        raise ValueError(f"{directory}: dumps {chain} are not consecutive; one is missing")
    state: dict[str, dict[str, torch.Tensor]] = {}
    for seq in chain:
        path = os.path.join(directory, f"{seq:06d}")
        for name, info in manifests[seq]["tables"].items():
            delta = torch.load(os.path.join(path, info["file"]), weights_only=True)
            evicted = delta.pop("evicted")
            current = state.get(name)
            if current is None:
                state[name] = delta
                continue
            if set(current) != set(delta):
                raise ValueError(f"{path}: table {name!r} has other tensors than before")
            gone = torch.isin(current["ids"], evicted) | torch.isin(current["ids"], delta["ids"])
            ids, order = torch.sort(torch.cat([current["ids"][~gone], delta["ids"]]))
            state[name] = {
                k: torch.cat([current[k][~gone], delta[k]])[order] if k != "ids" else ids
                for k in current
            }
    return state


def load_dumps_into(module: HasKVTables, directory: str | os.PathLike[str]) -> None:
    """Insert the content ``apply_dumps(directory)`` rebuilds into ``module``'s
    tables, with optimizer state and eviction scores. The tables must be empty (both
    tiers) and match the dumped ones (names, dims, optimizer); raises ``ValueError``
    otherwise, before anything is inserted. Rows a table has no room for raise
    ``RuntimeError``: before anything is inserted where they outnumber its capacity
    (memory, plus ``SSDOptions.capacity`` when set), else when an index bucket
    overflows (tables inserted before it keep their rows).

    With an SSD tier, every row keeps its dumped score in whichever tier it lands:
    each index bucket keeps its rows of the highest scores in memory and the others
    go to the SSD tier (``KVTable.insert(..., exact_scores=True)``, as a checkpoint
    load places them). Disk records for the rows of every SSD table are reserved
    before any table changes, so a full disk raises ``KVStorageError`` (naming the
    table and its file) with every table as it was."""
    content = apply_dumps(directory)
    tables = module.kv_tables()
    for name, rows in content.items():
        table = tables.get(name)
        if table is None:
            raise ValueError(f"dumped table {name!r} is not in the module")
        stored = table.total_size
        if stored != 0:
            raise ValueError(f"table {name!r} is not empty ({stored} ids)")
        if rows["weights"].shape[1:] != (table.dim,):
            raise ValueError(
                f"table {name!r}: dumped dim {tuple(rows['weights'].shape[1:])} != {table.dim}"
            )
        names = table.optim.state_names()
        if set(rows) != {"ids", "weights", "scores", *names}:
            raise ValueError(f"table {name!r}: dumped optimizer state does not match {names}")
        room = table.room()
        if room is not None and rows["ids"].numel() > room:
            raise RuntimeError(
                f"table {name!r}: {rows['ids'].numel()} dumped rows do not fit its "
                f"capacity of {room} rows"
            )
    for name, rows in content.items():
        # A full disk raises here, before any table changes.
        tables[name].reserve(rows["ids"].numel())
    for name, rows in content.items():
        table = tables[name]
        n = rows["ids"].numel()
        if n == 0:
            continue
        state = table.optim.join_state(rows, table.dim)
        table.insert(rows["ids"], rows["weights"], state, rows["scores"], exact_scores=True)
        lost = n - table.total_size
        if lost:
            raise RuntimeError(f"table {name!r}: {lost} rows found no room")
