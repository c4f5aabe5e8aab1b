"""The native slab-record kernels against ``ssd/slab.py``'s torch/numpy reference.

``record_checksum`` must give ``slab.checksum``'s bits; ``write_records`` must leave
a slab exactly as ``index_copy_`` of ``Slab.encode``'s block does (padding word
included), and refuse a record outside the slab before writing anything.
"""

from __future__ import annotations

import pytest
import torch

from torchrec_kvemb.ops import native
from torchrec_kvemb.ssd.slab import CHECKSUM_WORD, HEAD_WORDS, checksum, record_words


@pytest.fixture(autouse=True)
def build(native_build: str) -> str:
    return native_build


def encode_reference(ids, scores, rows, words) -> torch.Tensor:
    block = torch.zeros(ids.numel(), words, dtype=torch.int64)
    block[:, 0], block[:, 1] = ids, scores
    block[:, HEAD_WORDS:].view(torch.float32)[:, : rows.shape[1]] = rows
    block[:, CHECKSUM_WORD] = torch.from_numpy(checksum(block.numpy()))
    return block


@pytest.mark.parametrize("width", [1, 6, 9, 65], ids=lambda w: f"width{w}")
@pytest.mark.parametrize("k", [0, 1, 1_031], ids=lambda k: f"k{k}")
def test_checksum_matches_numpy(width: int, k: int) -> None:
    gen = torch.Generator().manual_seed(width * 7 + k)
    words = record_words(width, 0)
    block = torch.randint(-(2**63), 2**63 - 1, (k, words), generator=gen)
    assert torch.equal(
        native.record_checksum(block, num_threads=2), torch.from_numpy(checksum(block.numpy()))
    )


@pytest.mark.parametrize("width", [1, 6, 9, 65], ids=lambda w: f"width{w}")
def test_write_records_matches_encode(width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    words = record_words(width, 0)
    slab = torch.randint(0, 1000, (2_053, words), generator=gen)
    want = slab.clone()
    records = torch.randperm(2_053, generator=gen)[:1_297]
    ids = torch.randint(0, 2**62, (1_297,), generator=gen)
    scores = torch.randint(-5, 5, (1_297,), generator=gen)
    rows = torch.randn(1_297, width, generator=gen)
    want.index_copy_(0, records, encode_reference(ids, scores, rows, words))
    native.write_records(slab, records, ids, scores, rows, num_threads=3)
    assert torch.equal(slab, want)


def test_record_outside_the_slab_is_refused_and_nothing_written() -> None:
    words = record_words(4, 1)
    slab = torch.zeros(11, words, dtype=torch.int64)
    records = torch.tensor([3, 11])
    with pytest.raises(native.NativeOpError, match="write_records"):
        native.write_records(
            slab, records, torch.tensor([5, 6]), torch.tensor([0, 0]), torch.ones(2, 5)
        )
    assert int(slab.abs().sum()) == 0


@pytest.mark.parametrize("width", [1, 9, 65], ids=lambda w: f"width{w}")
def test_read_records_matches_index_select_and_verify(width: int) -> None:
    """Copies and checks: a record read for another id, or with one word changed,
    is not ok; every other is, and the copies equal ``index_select``'s."""
    gen = torch.Generator().manual_seed(width + 1)
    words = record_words(width, 0)
    ids = torch.randint(0, 2**62, (1_501,), generator=gen)
    rows = torch.randn(1_501, width, generator=gen)
    slab = encode_reference(ids, torch.zeros_like(ids), rows, words)
    slab[7, HEAD_WORDS] ^= 1 << 20  # a changed float
    slab[11, 1] += 1  # a changed score
    records = torch.randperm(1_501, generator=gen)[:1_033]
    asked = ids[records].clone()
    asked[5] += 1  # a record read for another id
    block, ok = native.read_records(slab, records, asked, num_threads=2)
    assert torch.equal(block, slab.index_select(0, records))
    want = (slab[records, 0] == asked) & (
        slab[records, CHECKSUM_WORD] == torch.from_numpy(checksum(block.numpy()))
    )
    assert torch.equal(ok, want)
    bad = set((~ok).nonzero().squeeze(1).tolist())
    assert 5 in bad and len(bad) == 1 + sum(int(r) in (7, 11) for r in records.tolist())
