"""Reading DCP-saved tensors straight from their files (``checkpoint/saved_tensor.py``
and ``ParallelFileSystemReader``) gives what DCP's own reader gives, bit for bit:
odd sizes, every row dtype, row ranges, 0-d and empty tensors; records it does not
take (strided tensors, other dtypes) go through DCP's own path; a cut file raises."""

import io
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchrec_kvemb.checkpoint import reader as reader_module
from torchrec_kvemb.checkpoint.reader import ParallelFileSystemReader, RowRangePlanner
from torchrec_kvemb.checkpoint.saved_tensor import locate, read_rows_into

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64)


def _record(tensor: torch.Tensor, lead: int = 37) -> tuple[io.BytesIO, int, int]:
    """A file holding ``lead`` junk bytes, then ``torch.save(tensor)``, then junk."""
    body = io.BytesIO()
    torch.save(tensor, body)
    data = b"x" * lead + body.getvalue() + b"y" * 11
    return io.BytesIO(data), lead, len(body.getvalue())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 5), (1, 3), (13,), (), (0, 4)])
def test_locate_and_read_equal_torch_load(dtype, shape):
    g = torch.Generator().manual_seed(3)
    tensor = (torch.randn(shape, generator=g) * 100).to(dtype)
    stream, offset, length = _record(tensor)
    saved = locate(stream, offset, length)
    assert saved is not None and saved.dtype == dtype and saved.size == tuple(shape)
    rows = shape[0] if shape else None
    ranges = [(0, rows)] if rows is not None else [(0, None)]
    if rows and rows > 2:
        ranges += [(1, rows - 3), (rows - 1, 1)]
    for first, count in ranges:
        lengths = (count, *shape[1:]) if shape else ()
        offsets = (first,) + (0,) * (len(shape) - 1) if shape else ()
        target = torch.full(lengths, 7, dtype=dtype)
        assert saved.readable_as(dtype, offsets, lengths)
        read_rows_into(stream, saved, first, target)
        want = tensor[first : first + count] if shape else tensor
        assert torch.equal(target, want), (dtype, shape, first, count)


def test_strided_or_other_dtype_is_not_taken():
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # strides (1, 4)
    stream, offset, length = _record(tensor)
    saved = locate(stream, offset, length)
    assert saved is not None and not saved.contiguous
    assert not saved.readable_as(torch.float32, (0, 0), (4, 3))
    plain = locate(*_record(torch.zeros(4, 3)))
    assert plain.readable_as(torch.float32, (1, 0), (3, 3))
    assert not plain.readable_as(torch.float64, (0, 0), (4, 3))
    assert not plain.readable_as(torch.float32, (0, 1), (4, 2))  # a column range
    assert not plain.readable_as(torch.float32, (2, 0), (3, 3))  # past the end


def test_other_objects_are_not_located():
    stream, offset, length = _record(torch.nn.Parameter(torch.ones(2)))
    assert locate(stream, offset, length) is None


def test_cut_record_raises():
    stream, offset, length = _record(torch.ones(64, 8))
    cut = io.BytesIO(stream.getvalue()[: offset + length // 2])
    with pytest.raises((zipfile.BadZipFile, OSError, EOFError)):
        saved = locate(cut, offset, length)
        read_rows_into(cut, saved, 0, torch.empty(64, 8))


def test_reader_equals_dcp_reader(tmp_path, monkeypatch):
    """Row ranges (``RowRangePlanner``) and whole entries over several files, some
    entries strided (DCP's own path): the same tensors as DCP's reader gives."""
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(1001, 7, generator=g),
        "h": torch.randn(333, 5, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 2**62, (1001,), generator=g),
        "t": torch.randn(6, 9, generator=g).t(),
        "s": torch.tensor(3.5),
        "e": torch.empty(0, 3),
    }
    writer = dcp.FileSystemWriter(str(tmp_path), thread_count=3)
    dcp.save(state, storage_writer=writer, no_dist=True)

    def targets():
        return {
            "w": torch.zeros(500, 7),
            "h": torch.zeros(333, 5, dtype=torch.bfloat16),
            "ids": torch.zeros(500, dtype=torch.int64),
            "t": torch.zeros(9, 6),
            "s": torch.tensor(0.0),
            "e": torch.zeros(0, 3),
        }

    offsets = {"w": 499, "ids": 499}
    ours, stock = targets(), targets()
    straight = []
    real = reader_module.read_rows_into
    monkeypatch.setattr(
        reader_module, "read_rows_into", lambda *a: (straight.append(a[3].shape), real(*a))
    )
    reader = ParallelFileSystemReader(str(tmp_path))
    dcp.load(ours, storage_reader=reader, planner=RowRangePlanner(offsets), no_dist=True)
    stock_reader = dcp.FileSystemReader(str(tmp_path))
    dcp.load(stock, storage_reader=stock_reader, planner=RowRangePlanner(offsets), no_dist=True)
    for key, value in stock.items():
        assert torch.equal(ours[key], value), key
    assert torch.equal(ours["w"], state["w"][499:999])
    assert torch.equal(ours["t"], state["t"])
    assert torch.Size([500, 7]) in straight and torch.Size([9, 6]) not in straight
