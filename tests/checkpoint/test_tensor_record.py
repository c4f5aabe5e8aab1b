"""``write_tensor`` writes a record every ``torch.save`` reader takes: ``torch.load``
gives the tensor back bit for bit, ``zipfile`` finds every entry's CRC-32 right,
``saved_tensor.locate`` finds its bytes, and the entries are torch.save's; odd
sizes, every dtype it writes, 0-d and empty tensors, blocks of odd lengths, a
record in the middle of a file; blocks that do not add up are refused."""

import io
import struct
import zipfile

import pytest
import torch

from torchrec_kvemb.checkpoint.saved_tensor import STORAGE_TYPES, locate
from torchrec_kvemb.checkpoint.saved_tensor import writable_bytes as bytes_of
from torchrec_kvemb.checkpoint.tensor_record import ALIGNMENT, write_tensor

SHAPES = [(7, 5), (13,), (), (0, 3), (3, 1, 2)]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    values = torch.randn(shape, generator=g) * 100
    if dtype == torch.bool:
        return values > 0
    return values.to(dtype)


def _blocks(view: memoryview, cuts: tuple[int, ...]) -> list[memoryview]:
    """``view`` cut at ``cuts`` (clipped to its length) into blocks, in order."""
    edges = sorted({0, len(view), *(min(c, len(view)) for c in cuts)})
    return [view[a:b] for a, b in zip(edges, edges[1:], strict=False)]


def _write(tensor: torch.Tensor, lead: int = 37, cuts=(5, 6, 29)) -> tuple[bytes, int, int]:
    """A file of ``lead`` junk bytes, the record, then junk: (file, offset, length)."""
    f = io.BytesIO()
    f.write(b"x" * lead)
    blocks = _blocks(bytes_of(tensor.contiguous()), cuts)
    length = write_tensor(f, tensor.dtype, tuple(tensor.shape), blocks)
    f.write(b"y" * 11)
    return f.getvalue(), lead, length


@pytest.mark.parametrize("dtype", list(STORAGE_TYPES), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_torch_load_and_zipfile_read_it(dtype, shape):
    tensor = _tensor(dtype, shape)
    data, offset, length = _write(tensor)
    record = data[offset : offset + length]
    back = torch.load(io.BytesIO(record), weights_only=True)
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back.view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8))
    archive = zipfile.ZipFile(io.BytesIO(record))
    assert archive.testzip() is None  # every entry's CRC-32 checks
    saved = io.BytesIO()
    torch.save(tensor, saved)
    assert archive.namelist() == zipfile.ZipFile(saved).namelist()
    info = archive.getinfo("archive/data/0")
    assert archive.read(info) == bytes(bytes_of(tensor.contiguous()))
    for entry in archive.infolist():  # each local header agrees with the directory
        (local_crc,) = struct.unpack_from("<I", record, entry.header_offset + 14)
        assert record[entry.header_offset : entry.header_offset + 4] == b"PK\x03\x04"
        assert local_crc == entry.CRC, entry.filename


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_locate_finds_its_bytes_aligned(shape):
    tensor = _tensor(torch.float32, shape)
    data, offset, length = _write(tensor, lead=101)
    saved = locate(io.BytesIO(data), offset, length)
    assert saved is not None and saved.dtype == torch.float32 and saved.size == shape
    assert (saved.data_offset - offset) % ALIGNMENT == 0
    start, n = saved.data_offset, tensor.numel() * 4
    assert data[start : start + n] == bytes(bytes_of(tensor))


def test_blocks_may_reuse_one_buffer():
    tensor = torch.arange(23 * 3, dtype=torch.int64).reshape(23, 3)
    buffer = torch.empty(4, 3, dtype=torch.int64)

    def blocks():
        for start in range(0, 23, 4):
            part = buffer[: min(4, 23 - start)]
            part.copy_(tensor[start : start + 4])
            yield bytes_of(part)

    f = io.BytesIO()
    length = write_tensor(f, tensor.dtype, (23, 3), blocks())
    back = torch.load(io.BytesIO(f.getvalue()[:length]), weights_only=True)
    assert torch.equal(back, tensor)


@pytest.mark.parametrize("extra", [-1, 1], ids=["short", "long"])
def test_blocks_that_do_not_add_up_are_refused(extra):
    tensor = torch.zeros(5, 3)
    view = bytes_of(tensor)
    blocks = [view[: len(view) + extra]] if extra < 0 else [view, memoryview(b"z")]
    with pytest.raises(ValueError, match="bytes"):
        write_tensor(io.BytesIO(), tensor.dtype, (5, 3), blocks)


def test_other_dtypes_are_refused():
    with pytest.raises(ValueError, match="no storage type"):
        write_tensor(io.BytesIO(), torch.complex64, (2,), [])
