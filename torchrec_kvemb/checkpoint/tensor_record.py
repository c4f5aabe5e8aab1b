"""One tensor as a ``torch.save`` record, written block by block: what DCP's files hold.

DCP's ``FileSystemWriter`` stores each tensor as the bytes ``torch.save`` gives it:
a zip archive of stored (uncompressed) entries, ``<archive>/data.pkl`` describing
the tensor and ``<archive>/data/0`` holding its elements. ``torch.save`` needs the
whole tensor in memory and checksums it with a CRC-32 that runs at about 2.4 GB/s
here; :func:`write_tensor` writes the same archive from blocks of the tensor's
bytes (a deferred table entry is gathered block by block into one reused buffer,
never whole) and checksums them with :func:`~torchrec_kvemb.ops.checksum.crc32`
(about 14 GB/s here with the native kernels, 4.2 with zlib).

What it writes reads as a ``torch.save`` record everywhere: ``torch.load``, DCP's
``FileSystemReader``, ``zipfile`` (CRC-32 checked) and
:func:`~torchrec_kvemb.checkpoint.saved_tensor.locate`. The layout: torch.save's
entries in its order (``data.pkl``, ``.format_version``, ``.storage_alignment``,
``byteorder``, ``data/0``, ``version``, ``.data/serialization_id``) under
``archive/``, each entry's data at a multiple of 64 bytes from the record's start
(padding in the local header's extra field, as torch.save does), and zip64 sizes
and offsets on every entry, so one layout serves records past 4 GiB.

Example::

    with open(path, "wb", buffering=0) as f:
        length = write_tensor(f, torch.float32, (3, 5), [writable_bytes(rows)])
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import sys
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO

import torch

from torchrec_kvemb.checkpoint.saved_tensor import STORAGE_TYPES
from torchrec_kvemb.checkpoint.writeback import start_writeback
from torchrec_kvemb.ops.checksum import crc32

ARCHIVE = "archive"
ALIGNMENT = 64
_MAX32 = 0xFFFFFFFF
_ZIP64 = 45  # the zip version that reads zip64 fields
_UTF8_NAMES = 0x0800
_DOS_DATE = (1 << 5) | 1  # 1980-01-01
_ZIP64_EXTRA_ID = 0x0001
_PADDING_EXTRA_ID = 0x4246  # an extra field readers skip (torch.save pads with it too)
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_END64 = struct.Struct("<4sQHHIIQQQQ")
_LOCATOR = struct.Struct("<4sIQI")
_END = struct.Struct("<4sHHHHIIH")
_CRC_FIELD = 14  # offset of the CRC-32 in a local header


def writable(dtype: torch.dtype) -> bool:
    """Whether :func:`write_tensor` writes tensors of ``dtype``."""
    return dtype in STORAGE_TYPES


def write_all(f: BinaryIO, data: memoryview | bytes) -> int:
    """Write all of ``data`` to ``f`` (a raw file may take part of it per call)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += f.write(view[done:])
    return done


class _Storage:
    """The storage a record's pickle names (``torch.save``'s persistent id)."""

    def __init__(self, dtype: torch.dtype, numel: int) -> None:
        self.dtype, self.numel = dtype, numel


class _Tensor:
    """Pickles as ``torch.save`` pickles a contiguous CPU tensor over all its storage."""

    def __init__(self, storage: _Storage, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: int):
        stride, step = [], 1
        for n in reversed(self.shape):
            stride.append(step)
            step *= n
        args = (self.storage, 0, self.shape, tuple(reversed(stride)), False, OrderedDict())
        return torch._utils._rebuild_tensor_v2, args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: object) -> tuple | None:
        if isinstance(obj, _Storage):
            storage_type = getattr(torch, STORAGE_TYPES[obj.dtype])
            return ("storage", storage_type, "0", "cpu", obj.numel)
        return None


def describe(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """The ``data.pkl`` of a contiguous tensor of ``dtype`` and ``shape``."""
    out = io.BytesIO()
    _Pickler(out, protocol=2).dump(_Tensor(_Storage(dtype, math.prod(shape)), tuple(shape)))
    return out.getvalue()


@dataclass
class _Entry:
    name: bytes
    offset: int  # of its local header, from the record's start
    size: int
    crc: int


class _Record:
    """A zip archive being written at the current position of ``f``."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.start = f.tell()
        self.pos = 0  # bytes written since ``start``
        self.entries: list[_Entry] = []

    def write(self, data: memoryview | bytes) -> None:
        n = write_all(self.f, data)
        start_writeback(self.f, self.start + self.pos, n)  # large blocks only
        self.pos += n

    def write_crc32(self, data: memoryview, crc: int) -> int:
        """Write ``data``; returns ``crc`` continued over it (in the same pass as the
        copy into the file's buffer where ``f`` can: ``direct_file.py``)."""
        write = getattr(self.f, "write_crc32", None)
        if write is None:
            crc = crc32(data, crc)
            n = write_all(self.f, data)
        else:
            crc = write(data, crc)
            n = len(data)
        start_writeback(self.f, self.start + self.pos, n)
        self.pos += n
        return crc

    def open_entry(self, name: str, size: int, crc: int) -> _Entry:
        """Write an entry's local header (its data must follow: ``size`` bytes)."""
        raw = f"{ARCHIVE}/{name}".encode()
        sizes = struct.pack("<HHQQ", _ZIP64_EXTRA_ID, 16, size, size)
        data_at = self.pos + _LOCAL.size + len(raw) + len(sizes) + 4
        pad = -data_at % ALIGNMENT
        extra = sizes + struct.pack("<HH", _PADDING_EXTRA_ID, pad) + bytes(pad)
        entry = _Entry(raw, self.pos, size, crc)
        header = _LOCAL.pack(
            b"PK\x03\x04", _ZIP64, _UTF8_NAMES, 0, 0, _DOS_DATE, crc, _MAX32, _MAX32,
            len(raw), len(extra),
        )  # fmt: skip
        self.write(header + raw + extra)
        self.entries.append(entry)
        return entry

    def small_entry(self, name: str, data: bytes) -> None:
        self.open_entry(name, len(data), zlib.crc32(data))
        self.write(data)

    def set_crc(self, entry: _Entry) -> None:
        """Write ``entry.crc`` into its local header (written with a placeholder)."""
        here = self.f.tell()
        self.f.seek(self.start + entry.offset + _CRC_FIELD)
        write_all(self.f, struct.pack("<I", entry.crc))
        self.f.seek(here)

    def close(self) -> int:
        """Write the central directory and the end records; returns the record's length."""
        directory = self.pos
        for e in self.entries:
            extra = struct.pack("<HHQQQ", _ZIP64_EXTRA_ID, 24, e.size, e.size, e.offset)
            self.write(
                _CENTRAL.pack(
                    b"PK\x01\x02",
                    _ZIP64,
                    _ZIP64,
                    _UTF8_NAMES,
                    0,
                    0,
                    _DOS_DATE,
                    e.crc,
                    _MAX32,
                    _MAX32,
                    len(e.name),
                    len(extra),
                    0,
                    0,
                    0,
                    0,
                    _MAX32,
                )  # fmt: skip
                + e.name
                + extra
            )
        end64 = self.pos
        n = len(self.entries)
        size = end64 - directory
        self.write(
            _END64.pack(
                b"PK\x06\x06", _END64.size - 12, _ZIP64, _ZIP64, 0, 0, n, n, size, directory
            )
        )
        self.write(_LOCATOR.pack(b"PK\x06\x07", 0, end64, 1))
        self.write(_END.pack(b"PK\x05\x06", 0, 0, n, n, _MAX32, _MAX32, 0))
        return self.pos


def write_tensor(
    f: BinaryIO, dtype: torch.dtype, shape: tuple[int, ...], blocks: Iterable[memoryview]
) -> int:
    """Write a ``torch.save`` record of a contiguous CPU tensor of ``dtype`` and ``shape``
    whose bytes are ``blocks`` (in order; they may reuse one buffer) at the current
    position of the seekable binary ``f``; returns the record's length in bytes.
    Raises ``ValueError`` when the blocks do not add up to the tensor's bytes."""
    if not writable(dtype):
        raise ValueError(f"write_tensor: no storage type for {dtype}")
    nbytes = dtype.itemsize * math.prod(shape)
    record = _Record(f)
    record.small_entry("data.pkl", describe(dtype, tuple(shape)))
    record.small_entry(".format_version", b"1")
    record.small_entry(".storage_alignment", str(ALIGNMENT).encode())
    record.small_entry("byteorder", sys.byteorder.encode())
    entry = record.open_entry("data/0", nbytes, 0)
    crc, written = 0, 0
    for block in blocks:
        if written + len(block) > nbytes:
            raise ValueError(f"write_tensor: blocks exceed the tensor's {nbytes} bytes")
        crc = record.write_crc32(memoryview(block).cast("B"), crc)
        written += len(block)
    if written != nbytes:
        raise ValueError(f"write_tensor: blocks hold {written} of the tensor's {nbytes} bytes")
    entry.crc = crc
    record.set_crc(entry)
    record.small_entry("version", b"3\n")
    record.small_entry(".data/serialization_id", f"{uuid.uuid4().int:040d}"[:40].encode())
    return record.close()
