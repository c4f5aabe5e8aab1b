"""``SlotIndex``: a lower tier's id index, a bucketed index with a record per slot.

The SSD tier's records are slab records (``ssd/store.py``), the host tier's rows
of its arrays (``host_tier.py``).

Bounded (a capacity): one fixed :class:`~torchrec_kvemb.index.BucketIndex`;
``insert`` ranks new ids against stored ones by the tier's eviction policy.
Unbounded: ids go to empty ways (``BucketIndex.place``); those whose bucket is
full go to a stash, a second index probed after the main one; the main part
doubles before it passes ``MAX_LOAD``, or when the stash holds more than
``1 / STASH_SHARE`` of the main slots, so it never drops a row. Slots are
global: main slots, then stash slots from ``main_slots`` on.
"""

from __future__ import annotations

import torch

from torchrec_kvemb.index import BucketIndex
from torchrec_kvemb.options import WAYS

#: Buckets of an unbounded index when it starts (1024 slots).
INITIAL_BUCKETS = 64
#: An unbounded index doubles its main part before it passes this load. Ids
#: whose main bucket is full go to a stash (why: at a load of 0.75 about 2% of
#: the ids overflow a 16-way bucket; doubling for each overflow instead kept
#: the load near 0.2, 120 bytes of index per row).
MAX_LOAD = 0.75
#: The stash has 1/32 of the main buckets (an odd count, so that its buckets
#: spread the ids of one main bucket); the main part doubles when the stash
#: holds more than 1/32 of the main slots.
STASH_SHARE = 32
#: Bytes of memory per index slot (key, score, record).
INDEX_BYTES_PER_SLOT = 24


class _Part:
    """One bucketed index with a record number per slot."""

    def __init__(self, buckets: int) -> None:
        self.index = BucketIndex.empty(buckets)
        self.record = torch.full((self.index.slots,), -1, dtype=torch.int64)

    @property
    def slots(self) -> int:
        return self.index.slots


class SlotIndex:
    """The SSD tier's id index (see the module docstring).

    Example::

        index = SlotIndex(INITIAL_BUCKETS, stash=True)
        slots = index.add(ids, scores)
        index.set_records(slots, records)
        index.records_at(index.probe(ids))
    """

    def __init__(self, buckets: int, stash: bool) -> None:
        self._main = _Part(buckets)
        self._stash = _Part(self._stash_buckets(buckets)) if stash else None
        self.size = 0
        #: Bumped whenever entries move to other slots (a rehash, a rebuilt stash).
        self.generation = 0

    @staticmethod
    def _stash_buckets(main_buckets: int) -> int:
        return (main_buckets // STASH_SHARE) | 1

    @property
    def main_slots(self) -> int:
        return self._main.slots

    @property
    def slots(self) -> int:
        """Slots in all (main and stash)."""
        return self.main_slots + (self._stash.slots if self._stash is not None else 0)

    def memory_bytes(self) -> int:
        return self.slots * INDEX_BYTES_PER_SLOT

    # --------------------------------------------------------- slot values
    def _split(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(positions in the stash, their stash slots)``; None when none is there."""
        if self._stash is None:
            return None
        in_stash = (slots >= self.main_slots).nonzero().squeeze(1)
        if in_stash.numel() == 0:
            return None
        return in_stash, slots[in_stash] - self.main_slots

    def _get(self, column: str, slots: torch.Tensor) -> torch.Tensor:
        def flat(part: _Part) -> torch.Tensor:
            if column == "record":
                return part.record
            return getattr(part.index, column).view(-1)

        split = self._split(slots)
        if split is None:
            return flat(self._main)[slots]
        out = flat(self._main)[slots.clamp(max=self.main_slots - 1)]
        pos, local = split
        out[pos] = flat(self._stash)[local]
        return out

    def _set(self, column: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        def flat(part: _Part) -> torch.Tensor:
            return part.record if column == "record" else part.index.scores.view(-1)

        split = self._split(slots)
        if split is None:
            flat(self._main)[slots] = values
            return
        pos, local = split
        main = torch.ones_like(slots, dtype=torch.bool)
        main[pos] = False
        flat(self._main)[slots[main]] = values[main]
        flat(self._stash)[local] = values[pos]

    def ids_at(self, slots: torch.Tensor) -> torch.Tensor:
        return self._get("keys", slots)

    def scores_at(self, slots: torch.Tensor) -> torch.Tensor:
        """The tier's eviction scores at ``slots``."""
        return self._get("scores", slots)

    def records_at(self, slots: torch.Tensor) -> torch.Tensor:
        """The slab records at ``slots`` (-1: none yet)."""
        return self._get("record", slots)

    def set_scores(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        self._set("scores", slots, values)

    def set_records(self, slots: torch.Tensor, records: torch.Tensor) -> None:
        self._set("record", slots, records)

    def arrays(self) -> tuple[torch.Tensor, ...]:
        """``(main keys, main scores, main records, stash keys, stash scores, stash
        records)``: the index's arrays as ``ops/host_exchange.py`` reads them (an
        index without a stash: empty stash arrays)."""
        main = self._main
        if self._stash is None:
            empty = main.index.keys.new_empty(0, WAYS)
            stash = (empty, empty.clone(), main.record.new_empty(0))
        else:
            stash = (self._stash.index.keys, self._stash.index.scores, self._stash.record)
        return (main.index.keys, main.index.scores, main.record, *stash)

    # ---------------------------------------------------------------- ids
    def probe(self, ids: torch.Tensor) -> torch.Tensor:
        """Global slots of ``ids``; -1 where absent."""
        slots = self._main.index.probe(ids)
        if self._stash is not None and self.size > 0:
            missing = (slots < 0).nonzero().squeeze(1)
            if missing.numel():
                local = self._stash.index.probe(ids[missing])
                slots[missing] = torch.where(local >= 0, local + self.main_slots, -1)
        return slots

    def live(self) -> torch.Tensor:
        """Global slots of every stored id."""
        slots = self._main.index.live_slots()
        if self._stash is not None:
            slots = torch.cat([slots, self._stash.index.live_slots() + self.main_slots])
        return slots

    def remove(self, slots: torch.Tensor) -> None:
        """Empty ``slots``."""
        split = self._split(slots)
        if split is None:
            self._main.index.remove(slots)
            self._main.record[slots] = -1
        else:
            _, local = split
            main = slots[slots < self.main_slots]
            self._main.index.remove(main)
            self._main.record[main] = -1
            self._stash.index.remove(local)
            self._stash.record[local] = -1
        self.size -= slots.numel()

    def insert(
        self, ids: torch.Tensor, values: torch.Tensor, keep_existing: bool
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Bounded: find-or-insert over the main part: ``(stored [n] bool, their
        slots, rows evicted)``; the records those slots held stay to be read."""
        result = self._main.index.insert(ids, values, False, keep_existing)
        evicted = result.evicted_ids.numel()
        self.size += int(result.inserted.sum()) - evicted
        stored = result.slots >= 0
        return stored, result.slots[stored], evicted

    def make_room(self, n: int) -> None:
        """Unbounded: the main part doubles, as often as needed, before ``n`` more ids
        would take it past ``MAX_LOAD`` (entries move: ``generation``)."""
        buckets = self._main.index.num_buckets
        while self.size + n > MAX_LOAD * buckets * WAYS:
            buckets *= 2
        if buckets != self._main.index.num_buckets:
            self._rehash(buckets)

    def placed(self, n: int) -> None:
        """Unbounded: ``n`` ids were placed in empty ways of the main part or the stash
        from outside (``host_exchange``, after ``make_room``); the main part doubles
        if the stash now holds more than its share."""
        self.size += n
        if self._stash is not None and self._stash.index.size > self.main_slots // STASH_SHARE:
            self._rehash(2 * self._main.index.num_buckets)

    def add(self, ids: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor:
        """Unbounded: store absent ``ids`` with scores ``values``; their slots. None:
        scores left as they are (an index that never ranks its ids: a host tier
        without a bound)."""
        n = ids.numel()
        self.make_room(n)
        slots = self._main.index.place(ids)
        over = (slots < 0).nonzero().squeeze(1)
        if over.numel():
            slots[over] = self._place_stash(ids[over])
            if self._stash.index.size > self.main_slots // STASH_SHARE:
                self.size += n
                if values is not None:
                    self.set_scores(slots, values)
                self._rehash(2 * self._main.index.num_buckets)
                return self.probe(ids)
        self.size += n
        if values is not None:
            self.set_scores(slots, values)
        return slots

    def _place_stash(self, ids: torch.Tensor) -> torch.Tensor:
        """Global slots of ``ids`` placed in the stash (which doubles until they fit)."""
        while True:
            local = self._stash.index.place(ids)
            if bool((local >= 0).all()):
                return local + self.main_slots
            self._stash.index.remove(local[local >= 0])  # undo, then grow and retry
            self._rebuild_stash(2 * self._stash.index.num_buckets + 1)

    def _rebuild_stash(self, buckets: int) -> None:
        old = self._stash
        live = old.index.live_slots()
        ids = old.index.ids_at(live)
        while True:
            new = _Part(buckets)
            local = new.index.place(ids)
            if bool((local >= 0).all()):
                break
            buckets = 2 * buckets + 1
        new.index.set_scores(local, old.index.scores_at(live))
        new.record[local] = old.record[live]
        self._stash = new
        self.generation += 1

    def _rehash(self, buckets: int) -> None:
        """Place every entry anew in a main part of ``buckets`` buckets (and a stash)."""
        live = self.live()
        ids, scores, records = self.ids_at(live), self.scores_at(live), self.records_at(live)
        self._main = _Part(buckets)
        self._stash = _Part(self._stash_buckets(buckets))
        slots = self._main.index.place(ids)
        over = (slots < 0).nonzero().squeeze(1)
        if over.numel():
            slots[over] = self._place_stash(ids[over])
        self.set_scores(slots, scores)
        self.set_records(slots, records)
        self.generation += 1
