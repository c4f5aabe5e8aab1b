"""``checkpoint.direct_file``: files written around the page cache hold exactly the
bytes written (appends across buffers, overwrites behind and inside the buffer,
odd sizes), and fall back to the page cache where ``O_DIRECT`` is refused."""

from __future__ import annotations

import errno
import fcntl
import io
import os
import random
import zlib

import pytest

from torchrec_kvemb.checkpoint import direct_file
from torchrec_kvemb.checkpoint.direct_file import (
    ALIGN,
    DirectFile,
    PlainFile,
    open_for_writing,
)


def _script(seed: int, total: int) -> list[tuple[str, int, bytes]]:
    """Appends of odd sizes, with overwrites of earlier bytes between them."""
    rng = random.Random(seed)
    ops: list[tuple[str, int, bytes]] = []
    size = 0
    while size < total:
        n = rng.choice([1, 3, 77, 4095, 4097, 9001, 3 * ALIGN + 5])
        ops.append(("append", size, rng.randbytes(n)))
        size += n
        if rng.random() < 0.3:
            at = rng.randrange(size)
            ops.append(("overwrite", at, rng.randbytes(min(rng.choice([1, 4, 700]), size - at))))
    return ops


def _play(f, ops) -> bytes:
    expected = bytearray()
    for kind, at, data in ops:
        if kind == "append":
            assert f.write(data) == len(data)
            expected += data
        else:
            end = f.tell()
            f.seek(at)
            f.write(data)
            f.seek(end)
            expected[at : at + len(data)] = data
        assert f.tell() == len(expected)
    return bytes(expected)


def _direct_fd(path) -> int:
    """A descriptor with ``O_DIRECT`` where this file system takes it, else a plain one
    (the buffering under test is the same; only the kernel's path differs)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        return os.open(path, flags | getattr(os, "O_DIRECT", 0))
    except OSError as e:
        assert e.errno == errno.EINVAL
        return os.open(path, flags)


@pytest.mark.parametrize("buffer_pages", [1, 2, 5], ids=lambda p: f"buffer{p}pages")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bytes_equal_what_was_written(tmp_path, buffer_pages, seed):
    path = tmp_path / "f.bin"
    f = DirectFile(_direct_fd(path), buffer_bytes=buffer_pages * ALIGN)
    expected = _play(f, _script(seed, 23 * ALIGN + 11))
    f.finish(sync=True)
    f.close()
    assert path.read_bytes() == expected


def test_empty_and_sub_page_files(tmp_path):
    for n in (0, 1, ALIGN - 1, ALIGN, ALIGN + 1):
        path = tmp_path / f"f{n}.bin"
        f = DirectFile(_direct_fd(path), buffer_bytes=2 * ALIGN)
        f.write(bytes(range(256)) * (n // 256) + bytes(n % 256))
        f.finish(sync=False)
        f.close()
        assert path.stat().st_size == n


def test_seek_past_the_end_and_long_overwrites_are_refused(tmp_path):
    f = DirectFile(_direct_fd(tmp_path / "f.bin"), buffer_bytes=ALIGN)
    f.write(b"x" * 10)
    with pytest.raises(OSError, match="outside"):
        f.seek(11)
    f.seek(8)
    with pytest.raises(OSError, match="past the end"):
        f.write(b"abc")
    f.close()


def test_a_refused_direct_write_goes_through_the_page_cache(tmp_path, monkeypatch):
    """A file system that opens O_DIRECT but refuses its writes (EINVAL): the file is
    written buffered, with the same bytes."""
    real = os.pwrite
    refused = []

    def pwrite(fd, data, offset):
        if not refused:
            refused.append(offset)
            raise OSError(errno.EINVAL, "no direct I/O here")
        return real(fd, data, offset)

    monkeypatch.setattr(direct_file.os, "pwrite", pwrite)
    path = tmp_path / "f.bin"
    f = DirectFile(_direct_fd(path), buffer_bytes=ALIGN)
    expected = _play(f, _script(7, 5 * ALIGN))
    f.finish(sync=True)
    f.close()
    assert refused == [0]
    assert path.read_bytes() == expected


def test_open_for_writing_uses_direct_io_where_the_file_system_has_it(tmp_path):
    path = tmp_path / "f.bin"
    probe = _direct_fd(tmp_path / "probe")
    has_direct = bool(getattr(os, "O_DIRECT", 0) & fcntl.fcntl(probe, fcntl.F_GETFL))
    os.close(probe)
    with open_for_writing(path) as f:
        assert isinstance(f, DirectFile if has_direct else PlainFile)
        f.write(b"abc")
        f.finish(sync=True)
    with open_for_writing(path, direct=False) as f:
        assert isinstance(f, PlainFile)
        f.write(b"de")
        f.seek(0)
        f.write(b"D")
        f.finish(sync=False)
    assert path.read_bytes() == b"De"


def test_the_io_protocol(tmp_path):
    f = DirectFile(_direct_fd(tmp_path / "f.bin"), buffer_bytes=ALIGN)
    assert f.writable() and f.seekable() and not f.readable()
    f.write(b"0123456789")
    assert f.seek(-3, io.SEEK_END) == 7
    assert f.seek(1, io.SEEK_CUR) == 8
    f.close()
    f.close()  # twice is fine
    assert f.closed


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "plain"])
def test_write_crc32_writes_the_bytes_and_returns_zlibs_crc(tmp_path, direct):
    """Appends of odd sizes (the buffer filled and written out between them), an
    overwrite behind the buffer and one inside it: the file holds the bytes and each
    call returns zlib's CRC of what it was given, continued."""
    path = tmp_path / "f.bin"
    rng = random.Random(3)
    f = DirectFile(_direct_fd(path), buffer_bytes=2 * ALIGN) if direct else PlainFile(path, "wb")
    expected, crc, want = bytearray(), 0, 0
    for n in (1, 77, 4097, 3 * ALIGN + 5, 9001, 0, 64, 5000):
        data = rng.randbytes(n)
        crc = f.write_crc32(memoryview(bytearray(data)), crc)
        want = zlib.crc32(data, want)
        expected += data
        assert crc == want and f.tell() == len(expected)
    for at in (5, len(expected) - 100):  # behind the buffer, then inside it
        data = rng.randbytes(40)
        f.seek(at)
        assert f.write_crc32(data, 7) == zlib.crc32(data, 7)
        f.seek(len(expected))
        expected[at : at + 40] = data
    f.finish(sync=True)
    f.close()
    assert path.read_bytes() == expected
