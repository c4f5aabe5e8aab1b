"""``ScratchPad``: rows for the ids of a batch that find no memory row.

With an SSD tier every id of a training batch that holds a row (in either tier)
or is new and admitted gets a row for the batch, even when more of the batch's
ids share a memory bucket than the bucket has ways. Those that lose the bucket
get a *scratch row*: extra rows after the memory rows, in the same arrays, so
that the pooled forward, the backward and the fused optimizer treat them as any
other row. After the batch's backward the table writes them to the SSD tier
(``TieredKVTable`` settles its share of the pad at its next call), so nothing
trained is dropped. FBGEMM's SSD TBE serves such rows the same way.

One pad serves one table with an SSD tier, or a group of them sharing arrays
(``torchrec_kvemb.group``): its rows come after all the memory rows
(``capacity``), each table takes rows of it through its :class:`TablePad`, and
``row_table`` says whose each row is (the backward's learning rate and
optimizer step). The pad grows (doubling) when a batch needs more rows, by
growing the arrays' storage in place, so that every tensor over it (a table's
``weights``, a group's arrays, an optimizer's parameters) stays valid.

Example::

    pad = ScratchPad(table.weights, table.state)
    share = pad.for_table(0, row_offset=0)
    slots = share.write(rows, ids, scores)  # rows [n, dim + state_dim]: slots capacity + k
    weights, state = pad.arrays              # what a batch's slots address
    ids, scores, rows = share.pending_rows()  # after the batch's backward: trained rows
"""

from __future__ import annotations

import torch

#: Scratch rows allocated at least (why: a pad grows by doubling; 256 rows of
#: dim 128 are 128 KiB, small beside any table with an SSD tier).
MIN_PAD_ROWS = 256


def _grow(tensor: torch.Tensor, rows: int) -> None:
    """Make ``tensor`` (contiguous, the start of its storage's used part) ``rows``
    rows long by growing its storage in place: every other tensor over the storage
    keeps pointing at the same rows."""
    storage = tensor.untyped_storage()
    cols = tensor.shape[1]
    storage.resize_((tensor.storage_offset() + rows * cols) * tensor.element_size())
    tensor.set_(storage, tensor.storage_offset(), (rows, cols), (cols, 1))


class ScratchPad:
    """Extra rows after the memory rows of a table or group (see the module docstring)."""

    def __init__(self, weights: torch.Tensor, state: torch.Tensor) -> None:
        for array in (weights, state):
            end = (array.storage_offset() + array.numel()) * array.element_size()
            if not array.is_contiguous() or end != array.untyped_storage().nbytes():
                raise ValueError(
                    "scratch pad: the rows must be contiguous and end their storage "
                    "(the pad grows it in place); a table with an SSD tier in a group "
                    "takes the group's pad"
                )
        #: Memory rows before the pad's first row.
        self.capacity = weights.shape[0]
        # Distinct tensor objects over the same storage: the given ones keep their shape.
        self.arrays = (weights.view(weights.shape), state.view(state.shape))
        #: The table (index in the group) of each scratch row.
        self.row_table = torch.zeros(0, dtype=torch.int64, device=weights.device)
        #: Scratch rows handed out since the batch began.
        self.used = 0
        self.shares: list[TablePad] = []

    def for_table(self, table: int, row_offset: int) -> TablePad:
        """The share of the pad of the group's table ``table``, whose rows start at
        ``row_offset`` in the arrays."""
        share = TablePad(self, table, row_offset)
        self.shares.append(share)
        return share

    @property
    def rows(self) -> int:
        """Scratch rows allocated."""
        return self.arrays[0].shape[0] - self.capacity

    @property
    def pending(self) -> int:
        """Rows of every table waiting to be written to the SSD tier."""
        return sum(share.pending for share in self.shares)

    def memory_bytes(self) -> int:
        weights, state = self.arrays
        return self.rows * (
            weights.shape[1] * weights.element_size() + state.shape[1] * state.element_size()
        )

    def ensure(self, n: int) -> None:
        """Room for ``n`` scratch rows (grows the arrays, keeping their content)."""
        if n <= self.rows:
            return
        rows = max(n, 2 * self.rows, MIN_PAD_ROWS)
        for array in self.arrays:
            _grow(array, self.capacity + rows)
        grown = self.row_table.new_zeros(rows)
        grown[: self.row_table.numel()] = self.row_table
        self.row_table = grown

    def begin_batch(self) -> None:
        """Every scratch row is free again (a batch begins; every table has written
        its pending rows back)."""
        if self.pending:
            raise RuntimeError("scratch pad: a batch began with rows not written back")
        self.used = 0

    def take(self, n: int, table: int) -> int:
        """Hand out the next ``n`` scratch rows to ``table``; the first one's index."""
        start = self.used
        self.ensure(start + n)
        self.row_table[start : start + n] = table
        self.used = start + n
        return start


class TablePad:
    """One table's scratch rows in a :class:`ScratchPad`: the rows it took in this
    batch, and those of them whose ids wait to be written to the SSD tier."""

    def __init__(self, pad: ScratchPad, table: int, row_offset: int) -> None:
        self.pad = pad
        self.table = table
        self.row_offset = row_offset
        #: Ids whose rows wait in the pad to be written to the SSD tier (None: none).
        self.pending_ids: torch.Tensor | None = None
        #: Their in-memory eviction scores.
        self.pending_scores: torch.Tensor | None = None
        self._start = 0  # the first scratch row of the pending ones

    @property
    def arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the table's slots address: the pad's arrays from the table's first row
        on (the memory rows, then the scratch rows; row 0: the growing arrays
        themselves)."""
        if self.row_offset == 0:
            return self.pad.arrays
        weights, state = self.pad.arrays
        return weights[self.row_offset :], state[self.row_offset :]

    @property
    def pending(self) -> int:
        """Rows waiting to be written to the SSD tier."""
        return 0 if self.pending_ids is None else self.pending_ids.numel()

    def memory_bytes(self) -> int:
        """The pad's scratch rows, counted once: on the share of the group's first table."""
        return self.pad.memory_bytes() if self.table == 0 else 0

    def begin_batch(self) -> None:
        """A batch of this table begins: the pad starts over when it serves this table
        alone (a group's pad starts over when the group's batch begins)."""
        if len(self.pad.shares) == 1:
            self.pad.begin_batch()

    def write(
        self,
        rows: torch.Tensor,
        ids: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Put ``rows [n, dim + state_dim]`` in ``n`` scratch rows; their slots,
        relative to the table's first row. With ``ids`` (sorted) and their in-memory
        eviction ``scores``, the rows are the table's until written back
        (``pending_rows``); without, a read-only copy."""
        n = rows.shape[0]
        start = self.pad.take(n, self.table)
        self.pending_ids, self.pending_scores, self._start = ids, scores, start
        weights, state = self.pad.arrays
        lo = self.pad.capacity + start
        dim = weights.shape[1]
        weights[lo : lo + n] = rows[:, :dim]
        state[lo : lo + n] = rows[:, dim:]
        return torch.arange(lo, lo + n, device=weights.device) - self.row_offset

    def pending_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids, scores, rows [n, dim + state_dim])`` waiting to be written back (a
        copy; empty when none)."""
        weights, state = self.pad.arrays
        lo = self.pad.capacity + self._start
        hi = lo + self.pending
        rows = torch.cat([weights[lo:hi], state[lo:hi].to(weights.dtype)], dim=1)
        if not self.pending:
            empty = torch.empty(0, dtype=torch.int64, device=weights.device)
            return empty, empty, rows
        return self.pending_ids, self.pending_scores, rows

    def find(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions in ids, weights [k, dim])`` of the ``ids`` waiting in the pad."""
        weights = self.pad.arrays[0]
        if not self.pending:
            return ids[:0], weights[:0]
        where = torch.searchsorted(self.pending_ids, ids).clamp(max=self.pending - 1)
        held = (self.pending_ids[where] == ids).nonzero().squeeze(1)
        return held, weights[self.pad.capacity + self._start + where[held]]

    def release(self) -> None:
        """Nothing of this table waits in the pad any more."""
        self.pending_ids = self.pending_scores = None
