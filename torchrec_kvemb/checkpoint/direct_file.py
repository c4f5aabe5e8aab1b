"""A checkpoint file written around the page cache (``O_DIRECT``), where the system allows.

A buffered write copies every byte into the page cache, and the kernel then
writes those pages back: on the 2-core VM of the benchmarks, 1 GB written
through the page cache cost 2.6 s of system CPU, against 0.08 s for the same
bytes with ``O_DIRECT`` (``dd``, 2026-11-26), which the disk then reads from our
memory by itself. A save beside training takes that CPU from the training
steps (docs/benchmarks.md, "Asynchronous checkpoints").

:class:`DirectFile` is a seekable, write-only binary file for a save's files:
writes go into a page-aligned buffer that is written out whole with
``O_DIRECT``; the tail (less than a buffer) and the few small writes behind
the buffer (a record's CRC, written after its data) are written through the
page cache when the file is finished. :func:`open_for_writing` gives one, or a
plain buffered file where the system or file system has no ``O_DIRECT``
(macOS, tmpfs) or refuses its first write; both hold the same bytes. Both
also checksum what they write on request (:meth:`DirectFile.write_crc32`): a
direct file copies the bytes into its buffer and checksums them in one pass
(``ops/checksum.py``, ``crc32_copy``), with non-temporal stores where the
CPU has them, so the buffer does not evict the training's cache lines.

Example::

    with open_for_writing(path) as f:
        f.write(header)
        f.write(rows)
        f.finish(sync=True)   # everything written (and fsync'd)
"""

from __future__ import annotations

import errno
import fcntl
import io
import mmap
import os

from torchrec_kvemb.ops.checksum import crc32, crc32_copy

#: Bytes a direct file buffers and writes at a time (a multiple of the page size).
BUFFER_BYTES = 8 << 20
#: The alignment ``O_DIRECT`` needs of offsets, lengths and addresses.
ALIGN = 4096


class PlainFile(io.FileIO):
    """A buffered (page cache) file with :meth:`DirectFile.finish`'s signature."""

    def finish(self, sync: bool) -> None:
        """Everything written; fsync'd when ``sync``."""
        if sync:
            os.fsync(self.fileno())

    def write_crc32(self, data: bytes | bytearray | memoryview, crc: int) -> int:
        """Write all of ``data``; returns ``zlib.crc32(data, crc)``."""
        view = memoryview(data).cast("B")
        crc = crc32(view, crc)
        done = 0
        while done < len(view):
            done += self.write(view[done:])
        return crc


class DirectFile(io.RawIOBase):
    """A new file written with ``O_DIRECT`` through an aligned buffer (see the module
    docstring). Writes append at the end, or overwrite bytes already written (seek
    back, write, seek to the end); call :meth:`finish` before closing.

    Example::

        f = DirectFile(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT))
        f.write(b"...")
        f.finish(sync=True)
        f.close()
    """

    def __init__(self, fd: int, buffer_bytes: int = BUFFER_BYTES) -> None:
        super().__init__()
        if buffer_bytes <= 0 or buffer_bytes % ALIGN:
            raise ValueError(f"buffer_bytes must be a positive multiple of {ALIGN}")
        self._fd = fd
        self._map = mmap.mmap(-1, buffer_bytes)  # page-aligned
        self._buffer = memoryview(self._map)
        self._base = 0  # file offset of the buffer's first byte
        self._filled = 0  # bytes of the buffer holding data
        self._pos = 0
        self._patches: list[tuple[int, bytes]] = []  # writes behind the buffer
        self._direct = True

    # ------------------------------------------------------------ io API
    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        end = self._base + self._filled
        target = {io.SEEK_SET: offset, io.SEEK_CUR: self._pos + offset, io.SEEK_END: end + offset}[
            whence
        ]
        if not 0 <= target <= end:
            raise OSError(errno.EINVAL, f"DirectFile: seek to {target} outside [0, {end}]")
        self._pos = target
        return target

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        n = len(view)
        end = self._base + self._filled
        if self._pos < end:  # an overwrite of bytes already written
            if self._pos + n > end:
                raise OSError(errno.EINVAL, "DirectFile: an overwrite runs past the end")
            self._overwrite(self._pos, view)
            self._pos += n
            return n
        self._append(view, None)
        return n

    def write_crc32(self, data: bytes | bytearray | memoryview, crc: int) -> int:
        """Write all of ``data`` as :meth:`write` does; returns ``zlib.crc32(data,
        crc)``, computed as the bytes are copied into the buffer (one pass)."""
        view = memoryview(data).cast("B")
        if self._pos < self._base + self._filled:
            crc = crc32(view, crc)
            self.write(view)
            return crc
        return self._append(view, crc)

    # ---------------------------------------------------------- internals
    def _append(self, view: memoryview, crc: int | None) -> int:
        """Append ``view`` at the end; with ``crc``, returns it continued over
        ``view`` (copied and checksummed in one pass), else 0."""
        n = len(view)
        done = 0
        while done < n:
            room = len(self._buffer) - self._filled
            take = min(room, n - done)
            into = self._buffer[self._filled : self._filled + take]
            if crc is None:
                into[:] = view[done : done + take]
            else:
                crc = crc32_copy(into, view[done : done + take], crc)
            self._filled += take
            done += take
            if self._filled == len(self._buffer):
                self._write_out(self._filled)
                self._base += self._filled
                self._filled = 0
        self._pos += n
        return crc or 0

    def finish(self, sync: bool) -> None:
        """Write what the buffer holds and the overwrites behind it; fsync when
        ``sync``. The file then holds every byte written."""
        aligned = self._filled - self._filled % ALIGN
        if aligned:
            self._write_out(aligned)
        self._buffered()  # the tail and the patches go through the page cache
        tail = self._buffer[aligned : self._filled]
        at = self._base + aligned
        while len(tail):
            written = os.pwrite(self._fd, tail, at)
            tail, at = tail[written:], at + written
        for offset, data in self._patches:
            os.pwrite(self._fd, data, offset)
        self._base += self._filled
        self._filled = 0
        self._patches.clear()
        if sync:
            os.fsync(self._fd)

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._buffer.release()
            self._map.close()
            os.close(self._fd)
        finally:
            super().close()

    def _overwrite(self, offset: int, view: memoryview) -> None:
        if offset >= self._base:  # still in the buffer
            start = offset - self._base
            self._buffer[start : start + len(view)] = view
            return
        split = min(len(view), self._base - offset)
        self._patches.append((offset, bytes(view[:split])))
        if split < len(view):
            self._overwrite(self._base, view[split:])

    def _write_out(self, nbytes: int) -> None:
        """Write buffer bytes ``[0, nbytes)`` at the buffer's file offset."""
        view = self._buffer[:nbytes]
        at = self._base
        while len(view):
            try:
                written = os.pwrite(self._fd, view, at)
            except OSError as e:
                if e.errno != errno.EINVAL or not self._direct:
                    raise
                self._buffered()  # a file system that opens but will not write O_DIRECT
                continue
            view, at = view[written:], at + written

    def _buffered(self) -> None:
        """Write through the page cache from now on."""
        if self._direct:
            flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            self._direct = False


def open_for_writing(path: str | os.PathLike, direct: bool = True) -> DirectFile | PlainFile:
    """A new (truncated) file at ``path`` for a save: a :class:`DirectFile` where
    ``direct`` and the system has ``O_DIRECT`` for this file system, else a buffered
    :class:`PlainFile`. Call ``finish(sync)`` once everything is written."""
    flag = getattr(os, "O_DIRECT", 0)
    if direct and flag:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | flag, 0o666)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: no O_DIRECT on this file system
                raise
        else:
            return DirectFile(fd)
    return PlainFile(path, "wb")
