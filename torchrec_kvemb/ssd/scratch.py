"""``ScratchPad``: rows for the ids of a batch that find no memory row.

With an SSD tier every id of a training batch that holds a row (in either tier)
or is new and admitted gets a row for the batch, even when more of the batch's
ids share a memory bucket than the bucket has ways. Those that lose the bucket
get a *scratch row*: extra rows after the table's ``capacity`` rows, in the same
arrays, so that the pooled forward, the backward and the fused optimizer treat
them as any other row (slots ``capacity + k``). After the batch's backward the
table writes them to the SSD tier (``TieredKVTable`` settles the pad at its next
call), so nothing trained is dropped. FBGEMM's SSD TBE serves such rows the same
way.

The pad's arrays are the table's ``weights`` / ``state`` extended: ``batch_rows``
returns ``[capacity + pad, ...]`` tensors whose first ``capacity`` rows are the
table's own. The pad grows (doubling) when a batch needs more rows; it swaps the
storage under the same tensor objects (``Tensor.set_``), so that references to
``weights`` (an optimizer's parameters, a group's arrays) stay valid.

Example::

    pad = ScratchPad(table.weights, table.state)
    slots = pad.write(rows, ids, scores)  # rows [n, dim + state_dim]: slots capacity + k
    weights, state = pad.arrays            # what a batch's slots address
    ids, scores, rows = pad.pending_rows()  # after the batch's backward: trained rows
"""

from __future__ import annotations

import torch

#: Scratch rows allocated at least (why: a pad grows by doubling; 256 rows of
#: dim 128 are 128 KiB, small beside any table with an SSD tier).
MIN_PAD_ROWS = 256


def _rebind(tensor: torch.Tensor, source: torch.Tensor, rows: int) -> None:
    """Point ``tensor`` (same object) at the first ``rows`` rows of ``source``."""
    size = (rows, source.shape[1])
    tensor.set_(source.untyped_storage(), source.storage_offset(), size, source.stride())


class ScratchPad:
    """Extra rows after a table's ``weights`` / ``state`` (see the module docstring)."""

    def __init__(self, weights: torch.Tensor, state: torch.Tensor) -> None:
        self.capacity = weights.shape[0]
        self._table = (weights, state)
        # Distinct tensor objects over the same storage: the table's keep their shape.
        self.arrays = (weights.view(weights.shape), state.view(state.shape))
        #: Ids whose rows wait in the pad to be written to the SSD tier (None: none).
        self.pending_ids: torch.Tensor | None = None
        #: Their in-memory eviction scores.
        self.pending_scores: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        """Scratch rows allocated."""
        return self.arrays[0].shape[0] - self.capacity

    @property
    def pending(self) -> int:
        """Rows waiting to be written to the SSD tier."""
        return 0 if self.pending_ids is None else self.pending_ids.numel()

    def memory_bytes(self) -> int:
        weights, state = self.arrays
        return self.rows * (
            weights.shape[1] * weights.element_size() + state.shape[1] * state.element_size()
        )

    def ensure(self, n: int) -> None:
        """Room for ``n`` scratch rows (grows the arrays, keeping their content)."""
        if n <= self.rows:
            return
        rows = self.capacity + max(n, 2 * self.rows, MIN_PAD_ROWS)
        for mine, theirs in zip(self.arrays, self._table, strict=True):
            grown = mine.new_zeros(rows, mine.shape[1])
            grown[: mine.shape[0]] = mine
            _rebind(theirs, grown, self.capacity)
            _rebind(mine, grown, rows)

    def slots(self, n: int, device: torch.device) -> torch.Tensor:
        """The slots of the first ``n`` scratch rows."""
        return torch.arange(self.capacity, self.capacity + n, device=device)

    def write(
        self,
        rows: torch.Tensor,
        ids: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Put ``rows [n, dim + state_dim]`` in the first ``n`` scratch rows; their slots.
        With ``ids`` (sorted) and their in-memory eviction ``scores``, the rows are
        theirs until written back (``pending_rows``); without, a read-only copy."""
        n = rows.shape[0]
        self.pending_ids, self.pending_scores = ids, scores
        self.ensure(n)
        weights, state = self.arrays
        dim = weights.shape[1]
        weights[self.capacity : self.capacity + n] = rows[:, :dim]
        state[self.capacity : self.capacity + n] = rows[:, dim:]
        return self.slots(n, weights.device)

    def pending_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids, scores, rows [n, dim + state_dim])`` waiting to be written back (a
        copy; empty when none)."""
        weights, state = self.arrays
        lo, hi = self.capacity, self.capacity + self.pending
        rows = torch.cat([weights[lo:hi], state[lo:hi].to(weights.dtype)], dim=1)
        if not self.pending:
            empty = torch.empty(0, dtype=torch.int64, device=weights.device)
            return empty, empty, rows
        return self.pending_ids, self.pending_scores, rows

    def find(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions in ids, weights [k, dim])`` of the ``ids`` waiting in the pad."""
        weights = self.arrays[0]
        if not self.pending:
            return ids[:0], weights[:0]
        where = torch.searchsorted(self.pending_ids, ids).clamp(max=self.pending - 1)
        held = (self.pending_ids[where] == ids).nonzero().squeeze(1)
        return held, weights[self.capacity + where[held]]

    def release(self) -> None:
        """Nothing waits in the pad any more."""
        self.pending_ids = self.pending_scores = None
