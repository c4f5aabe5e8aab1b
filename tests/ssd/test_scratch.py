"""``ScratchPad`` shared by the tables of a group: each table's share, growth in place."""

import pytest
import torch

from torchrec_kvemb.ssd.scratch import MIN_PAD_ROWS, ScratchPad

DIM, STATE_DIM = 3, 1
ROWS = (5, 7)  # two tables' memory rows in one group's arrays


def _group_pad():
    weights = torch.arange(sum(ROWS) * DIM, dtype=torch.float32).view(-1, DIM)
    state = torch.zeros(sum(ROWS), STATE_DIM)
    views = [weights[: ROWS[0]], weights[ROWS[0] :]]  # the tables' own rows
    pad = ScratchPad(weights, state)
    shares = [pad.for_table(0, 0), pad.for_table(1, ROWS[0])]
    return weights, views, pad, shares


def _rows(n: int, start: float) -> torch.Tensor:
    return torch.arange(n * (DIM + STATE_DIM), dtype=torch.float32).view(n, -1) + start


def test_shares_take_rows_after_all_memory_rows_with_their_table():
    weights, _, pad, (a, b) = _group_pad()
    slots_a = a.write(_rows(2, 100.0), torch.tensor([4, 9]), torch.tensor([1, 2]))
    slots_b = b.write(_rows(3, 200.0), torch.tensor([1, 5, 8]), torch.tensor([3, 4, 5]))
    total = sum(ROWS)
    assert torch.equal(slots_a, torch.tensor([total, total + 1]))  # table 0: offset 0
    assert torch.equal(slots_b + ROWS[0], torch.arange(total + 2, total + 5))
    assert torch.equal(pad.row_table[:5], torch.tensor([0, 0, 1, 1, 1]))
    ids, scores, rows = b.pending_rows()
    assert torch.equal(ids, torch.tensor([1, 5, 8]))
    assert torch.equal(scores, torch.tensor([3, 4, 5]))
    assert torch.equal(rows, _rows(3, 200.0))
    held, found = a.find(torch.tensor([9, 5, 4]))  # 5 is b's, not a's
    assert torch.equal(held, torch.tensor([0, 2]))
    assert torch.equal(found, _rows(2, 100.0)[[1, 0], :DIM])
    assert pad.pending == 5
    with pytest.raises(RuntimeError, match="not written back"):
        pad.begin_batch()
    a.release()
    b.release()
    pad.begin_batch()
    assert torch.equal(a.write(_rows(1, 0.0)), torch.tensor([total]))  # starts over
    assert a.pending == 0  # a read-only copy


def test_growth_keeps_every_view_and_the_rows():
    weights, views, pad, (a, b) = _group_pad()
    before = [v.clone() for v in views]
    a.write(_rows(3, 1.0), torch.tensor([1, 2, 3]), torch.zeros(3, dtype=torch.int64))
    grown = MIN_PAD_ROWS + 9
    b.write(_rows(grown, 50.0), torch.arange(grown), torch.zeros(grown, dtype=torch.int64))
    assert pad.rows >= 3 + grown and pad.row_table.numel() == pad.rows
    assert weights.shape == (sum(ROWS), DIM)  # the given tensor keeps its shape
    for view, old in zip(views, before, strict=True):
        assert torch.equal(view, old)
        assert view.untyped_storage().data_ptr() == pad.arrays[0].untyped_storage().data_ptr()
    views[1][0] = -1.0  # a table's view still writes the group's rows
    assert torch.equal(pad.arrays[0][ROWS[0]], torch.full((DIM,), -1.0))
    assert torch.equal(a.pending_rows()[2], _rows(3, 1.0))  # written before the growth
    assert torch.equal(b.pending_rows()[2], _rows(grown, 50.0))


def test_rows_followed_by_other_rows_are_refused():
    weights, state = torch.zeros(12, DIM), torch.zeros(12, STATE_DIM)
    with pytest.raises(ValueError, match="end their storage"):
        ScratchPad(weights[:5], state[:5])  # growing would write over rows 5..11
