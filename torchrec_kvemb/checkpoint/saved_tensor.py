"""Where a DCP-saved tensor's bytes lie in its file, and reading them straight into a tensor.

DCP's ``FileSystemWriter`` writes each tensor as one ``torch.save`` record (a zip
archive: ``<archive>/data.pkl`` describing the tensor, ``<archive>/data/<key>``
holding its storage, uncompressed) at an offset of a ``.distcp`` file. DCP's
reader ``torch.load``s the whole record and copies the part a load asks for into
the target: two passes over every byte. :func:`locate` parses the record's zip
directory and pickle (no tensor data) and gives the storage's file offset, dtype,
shape and strides; :func:`read_rows_into` reads a range of rows of a contiguous
saved tensor from the file into a contiguous target with no other copy.

A record this module does not recognise (another pickle layout, a compressed or
big-endian record, a strided tensor) gives ``None`` from :func:`locate`; the
caller then reads it with DCP's own path.

Example::

    with open(path, "rb") as f:
        saved = locate(f, offset, length)
        if saved is not None and saved.readable_as(target.dtype, storage_offsets, lengths):
            read_rows_into(f, saved, storage_offsets[0], target)
"""

from __future__ import annotations

import ctypes
import io
import math
import pickle
import struct
import sys
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_SIGNATURE = b"PK\x03\x04"
#: The typed storage class ``torch.save`` names in its pickle for each dtype.
STORAGE_TYPES = {
    torch.float64: "DoubleStorage",
    torch.float32: "FloatStorage",
    torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage",
    torch.int64: "LongStorage",
    torch.int32: "IntStorage",
    torch.int16: "ShortStorage",
    torch.int8: "CharStorage",
    torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
}
_STORAGE_DTYPES = {name: dtype for dtype, name in STORAGE_TYPES.items()}


@dataclass(frozen=True)
class SavedTensor:
    """A saved tensor: its storage's bytes at ``data_offset`` of the file."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    #: File offset of the tensor's first element (the storage's offset included).
    data_offset: int
    #: Bytes of the storage record (at least the tensor's bytes).
    storage_bytes: int

    @property
    def contiguous(self) -> bool:
        expected, step = [], 1
        for n in reversed(self.size):
            expected.append(step)
            step *= n
        return all(a == b for a, b, n in zip(self.stride, reversed(expected), self.size) if n > 1)

    def readable_as(
        self, dtype: torch.dtype, offsets: tuple[int, ...], lengths: tuple[int, ...]
    ) -> bool:
        """Whether the part ``offsets`` / ``lengths`` of this tensor, as ``dtype``, is one
        run of bytes: same dtype, contiguous, only the first dim narrowed."""
        if not (self.contiguous and dtype == self.dtype and len(lengths) == len(self.size)):
            return False
        inner = zip(offsets[1:], lengths[1:], self.size[1:], strict=True)
        if any(o != 0 or n != s for o, n, s in inner):
            return False
        if self.size and offsets[0] + lengths[0] > self.size[0]:
            return False
        return math.prod(self.size) * self.dtype.itemsize <= self.storage_bytes


class _Slice(io.RawIOBase):
    """``length`` bytes of ``stream`` from ``offset``, seekable (for ``zipfile``)."""

    def __init__(self, stream: BinaryIO, offset: int, length: int) -> None:
        super().__init__()
        self._stream, self._offset, self._length, self._pos = stream, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        if n == 0:
            return 0
        self._stream.seek(self._offset + self._pos)
        got = self._stream.readinto(memoryview(buffer)[:n]) or 0
        self._pos += got
        return got


class _UnsupportedRecordError(Exception):
    """A record this module does not read (DCP's path reads it)."""


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype


@dataclass(frozen=True)
class _TensorRef:
    storage: _StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor(storage, storage_offset, size, stride, *_rest) -> _TensorRef:
    if not isinstance(storage, _StorageRef):
        raise _UnsupportedRecordError("not a storage")
    return _TensorRef(storage, int(storage_offset), tuple(size), tuple(stride))


class _DescriptionUnpickler(pickle.Unpickler):
    """Reads a ``torch.save`` pickle of one plain tensor into a :class:`_TensorRef`;
    anything else raises :class:`_UnsupportedRecordError` (nothing is imported or run)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise _UnsupportedRecordError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _UnsupportedRecordError("persistent id")
        _, dtype, key, _location, _numel = pid
        if not isinstance(dtype, torch.dtype):
            raise _UnsupportedRecordError("storage type")
        return _StorageRef(str(key), dtype)


def locate(stream: BinaryIO, offset: int, length: int) -> SavedTensor | None:
    """The tensor ``torch.save`` wrote at ``offset`` (``length`` bytes) of ``stream``:
    its dtype, shape, strides and where its elements start; ``None`` for a record of
    another kind. A record cut short (a truncated file) raises (``zipfile.BadZipFile``,
    ``OSError``)."""
    archive = zipfile.ZipFile(_Slice(stream, offset, length))
    names = {info.filename: info for info in archive.infolist()}
    pickles = [n for n in names if n.endswith("/data.pkl")]
    if len(pickles) != 1:
        return None
    prefix = pickles[0][: -len("data.pkl")]
    order = names.get(f"{prefix}byteorder")
    if order is not None and archive.read(order).decode() != sys.byteorder:
        return None
    try:
        ref = _DescriptionUnpickler(io.BytesIO(archive.read(pickles[0]))).load()
    except _UnsupportedRecordError:
        return None
    if not isinstance(ref, _TensorRef):
        return None
    info = names.get(f"{prefix}data/{ref.storage.key}")
    if info is None or info.compress_type != zipfile.ZIP_STORED:
        return None
    stream.seek(offset + info.header_offset)
    header = stream.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size:
        raise zipfile.BadZipFile("a tensor record's header is cut short")
    fields = _LOCAL_HEADER.unpack(header)
    if fields[0] != _LOCAL_SIGNATURE:
        raise zipfile.BadZipFile("a tensor record's header is damaged")
    name_len, extra_len = fields[9], fields[10]
    start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if start + info.file_size > length:
        raise zipfile.BadZipFile("a tensor record overruns its slice of the file")
    itemsize = ref.storage.dtype.itemsize
    return SavedTensor(
        dtype=ref.storage.dtype,
        size=ref.size,
        stride=ref.stride,
        data_offset=offset + start + ref.storage_offset * itemsize,
        storage_bytes=info.file_size - ref.storage_offset * itemsize,
    )


def writable_bytes(tensor: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU ``tensor`` as a writable byte view (no copy)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def read_bytes_into(stream: BinaryIO, offset: int, target: torch.Tensor) -> None:
    """Fill the contiguous CPU ``target`` with the bytes of ``stream`` from ``offset``
    (no other copy). A file that ends early raises ``EOFError``."""
    nbytes = target.numel() * target.element_size()
    if nbytes == 0:
        return
    view = writable_bytes(target)
    stream.seek(offset)
    done = 0
    while done < nbytes:
        got = stream.readinto(view[done:])
        if not got:
            raise EOFError(f"the file ends {nbytes - done} bytes before a tensor's end")
        done += got


def read_rows_into(
    stream: BinaryIO, saved: SavedTensor, first_row: int, target: torch.Tensor
) -> None:
    """Read rows ``[first_row, first_row + len(target))`` of ``saved`` (checked with
    :meth:`SavedTensor.readable_as`) into the contiguous CPU ``target``."""
    row_bytes = math.prod(target.shape[1:]) * target.element_size()
    read_bytes_into(stream, saved.data_offset + first_row * row_bytes, target)
