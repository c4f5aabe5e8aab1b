"""The slab file: record round trips, checksums, growth, reopening, locking, errors."""

import errno
import os

import pytest
import torch

import torchrec_kvemb.ssd.slab as slab_module
from torchrec_kvemb.ssd import KVStorageError
from torchrec_kvemb.ssd.slab import HEADER_BYTES, Slab, record_words

DIM, STATE = 5, 1  # 6 floats: 3 words of floats, 6 words a record


def _rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, DIM + STATE, generator=torch.Generator().manual_seed(seed))


def _bits(rows: torch.Tensor) -> torch.Tensor:
    return rows.contiguous().view(torch.int32)


@pytest.fixture
def slab(tmp_path):
    s = Slab(tmp_path / "t.rank0.slab", "t", DIM, STATE)
    yield s
    s.close()


def test_geometry():
    assert record_words(5, 1) == 6  # id, score, checksum, 6 floats
    assert record_words(64, 1) == 3 + 33  # an odd float count is padded to a word
    assert record_words(8, 16) == 3 + 12


def test_round_trip_is_bit_exact(slab):
    slab.grow(100)
    records = torch.tensor([99, 0, 17, 3])
    ids = torch.tensor([2**62 + 5, 0, 7, 123456789])
    scores = torch.tensor([-3, 2**40, 0, 7])
    rows = _rows(4)
    rows[0, 0], rows[1, 1], rows[2, 2] = float("nan"), float("inf"), -0.0
    slab.write(records, ids, scores, rows)
    got_scores, got_rows, ok = slab.decode(slab.read(records), ids)
    assert ok.all()
    assert torch.equal(got_scores, scores)
    assert torch.equal(_bits(got_rows), _bits(rows))
    # read in another order, a view taken earlier
    view = slab.view()
    order = torch.tensor([2, 0, 3, 1])
    _, again, ok = slab.decode(slab.read(records[order], view), ids[order])
    assert ok.all() and torch.equal(_bits(again), _bits(got_rows[order]))


def test_checksum_catches_every_single_bit_flip(slab):
    slab.grow(8)
    ids = torch.tensor([11, 0])
    slab.write(torch.tensor([0, 1]), ids, torch.tensor([4, 0]), _rows(2))
    block = slab.read(torch.tensor([0, 1]))
    words = slab.words
    # one copy of each record per (word, bit): flip that bit
    flips = []
    for word in range(words):
        for bit in range(64):
            flipped = block.clone()
            flipped[:, word] ^= 1 << bit if bit < 63 else -(2**63)
            flips.append(flipped)
    flipped = torch.cat(flips)
    ok = slab.verify(flipped, ids.repeat(len(flips)))
    assert not ok.any(), f"{int(ok.sum())} flipped records passed their checks"
    assert slab.verify(block, ids).all()


def test_unwritten_record_never_verifies(slab):
    slab.grow(4)
    zero = slab.read(torch.tensor([2]))
    assert int(zero.abs().sum()) == 0
    assert not slab.verify(zero, torch.tensor([0])).any()


def test_parallel_read_matches(slab, monkeypatch):
    slab.grow(4000)
    records = torch.randperm(4000)[:3000]
    ids = torch.arange(3000) * 3
    slab.write(records, ids, ids, _rows(3000))
    serial = slab.read(records)
    monkeypatch.setattr(slab_module, "PARALLEL_READ_MIN", 1)
    slab.io_threads = 4
    assert torch.equal(slab.read(records), serial)


def test_reopen_keeps_records_and_checks_geometry(tmp_path):
    path = tmp_path / "t.rank0.slab"
    s = Slab(path, "t", DIM, STATE)
    s.grow(10)
    rows = _rows(3)
    s.write(torch.tensor([1, 5, 9]), torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0]), rows)
    s.sync()
    s.close()
    assert os.path.getsize(path) == HEADER_BYTES + 10 * s.record_bytes
    s = Slab(path, "t", DIM, STATE)
    assert s.records == 10
    _, got, ok = s.decode(s.read(torch.tensor([1, 5, 9])), torch.tensor([1, 2, 3]))
    assert ok.all() and torch.equal(got, rows)
    s.close()
    with pytest.raises(KVStorageError, match=r"table 'u'.*slab file .*'dim': 5.*'dim': 6"):
        Slab(path, "u", DIM + 1, STATE)
    s = Slab(path, "t", DIM, STATE, fresh=True)
    assert s.records == 0
    s.close()
    other = tmp_path / "other.bin"
    other.write_bytes(b"not a slab" * 1000)
    with pytest.raises(KVStorageError, match="not an SSD tier slab file"):
        Slab(other, "t", DIM, STATE)


def test_one_open_slab_per_file(slab):
    with pytest.raises(KVStorageError, match=r"table 't'.*open in another table or process"):
        Slab(slab.path, "t", DIM, STATE)


def test_full_disk_on_growth_is_a_clear_error(slab, monkeypatch):
    slab.grow(16)
    size = os.path.getsize(slab.path)

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(slab_module, "_fallocate", no_space)
    with pytest.raises(KVStorageError, match=r"table 't'.*grow.*t\.rank0\.slab.*no space left"):
        slab.grow(10_000)
    assert slab.records == 16 and os.path.getsize(slab.path) == size
    assert slab.view().shape[0] == 16
